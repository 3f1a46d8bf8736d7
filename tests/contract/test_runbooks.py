"""The runbooks the configuration cites are in the repository: every runbook the README or a settings comment names
resolves to a file under docs/runbooks/, and docs/README.md indexes each of those files with a working link."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNBOOKS = ROOT / "docs" / "runbooks"
NAME = r"([a-z0-9]+(?:-[a-z0-9]+)+)"
# How the README and the settings cite a runbook: "the slice-node-bootstrap runbook", "runbook (`NAME` …",
# "(NAME: \"a quoted line\")", and the parity table's runbook column ("| `NAME`: …").
CITATIONS = (
    rf"`?{NAME}`?(?:'s)? runbook",
    rf"runbooks?:? \(?`?{NAME}\b",
    rf"\({NAME}:? \"",
    rf"\| `{NAME}`: ",
)


def cited() -> dict[str, set[str]]:
    sources = [
        ROOT / "README.md",
        *ROOT.glob("services/*/gpuaas_*/settings.py"),
        ROOT / "libs/gpuaas_common/settings.py",
    ]
    found: dict[str, set[str]] = {}
    for path in sources:
        text = path.read_text()
        for form in CITATIONS:
            for match in re.finditer(form, text):
                found.setdefault(match.group(1), set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_cited_runbook_is_a_file_under_docs() -> None:
    have = {p.stem for p in RUNBOOKS.iterdir() if p.suffix in (".md", ".txt")}
    citations = cited()
    # The forms above still find what the README is known to cite: a reworded citation style fails here, not silently.
    assert {"slice-node-bootstrap", "maas-host-image-pipeline"} <= set(citations)
    missing = {name: sorted(where) for name, where in citations.items() if name not in have}
    assert missing == {}, f"cited but not under docs/runbooks/: {missing}"


def test_the_docs_index_links_every_runbook_and_every_link_resolves() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    links = set(re.findall(r"\]\((runbooks/[^)]+)\)", index))
    assert links == {f"runbooks/{p.name}" for p in RUNBOOKS.iterdir()}
    assert all((ROOT / "docs" / link).is_file() for link in links)
