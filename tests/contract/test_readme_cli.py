"""The README's hand-written CLI tables say what the code does: the exit codes every command keeps to, and
every reason code a release can be refused with (the contract's own list, each with its exit code)."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from gpuaas_common.contract import messages as m
from gpuaas_dev.cli import common


def _table_after(readme: str, heading: str) -> list[list[str]]:
    """The rows of the first Markdown table after `heading`, header and rule left out."""
    rest = readme[readme.index(heading) :]
    rows = []
    for line in rest.splitlines()[1:]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]


def test_exit_codes_are_the_ones_the_cli_uses(repo_root: Path) -> None:
    rows = _table_after((repo_root / "README.md").read_text(), "**Exit codes**")
    documented = {int(code): meaning for code, meaning in rows}
    assert documented.keys() == {
        common.EXIT_OK,
        common.EXIT_FAILED,
        common.EXIT_USAGE,
        common.EXIT_UNREACHABLE,
        common.EXIT_TIMEOUT,
    }
    assert documented[common.EXIT_USAGE].startswith("bad argument")
    assert documented[common.EXIT_TIMEOUT].startswith("no answer in time")
    assert documented[common.EXIT_UNREACHABLE].startswith("nothing to connect to")


def test_every_release_refusal_is_documented_with_its_exit_code(repo_root: Path) -> None:
    rows = _table_after((repo_root / "README.md").read_text(), "**Release answers.**")
    documented = {re.sub(r"`", "", code): exit_code for code, _, exit_code in rows}
    reason_codes = typing.get_args(m.AllocationReleaseRejected.model_fields["reason_code"].annotation)
    assert sorted(documented) == sorted(reason_codes)
    # A release already under way is no failure (the CLI waits for it or takes it as the answer).
    assert documented.pop("already_releasing").startswith(str(common.EXIT_OK))
    assert set(documented.values()) == {str(common.EXIT_FAILED)}
