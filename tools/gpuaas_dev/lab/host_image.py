"""The lab's MAAS host image: the root tree the image pipeline archives as `custom/<slug>` and MAAS deploys.

The runbook's image is Ubuntu 24.04 with the H200 package set; the lab's is Debian 12 from the Debian archive
(what this machine can reach), made the same way where it matters to a deploy: the packages installed with the
image's own apt and read back from its package database, the IOMMU kernel arguments staged in
/etc/default/grub and a grub.d drop-in, a bounded network-online wait, the node agent installed from a wheel
built from this checkout into its own virtualenv with its systemd unit (deploy/systemd/) enabled, and both
site bootstraps at the paths the runbook runs them from. The curtin marker is the pipeline's part (it adds it
to every tgz it builds).

Cached in two layers, like the image's own build would be: the packages layer (Debian's packages, the kernel
arguments, the bounded wait) under a key of that recipe, and the image (the layer plus the agent, its unit and the
site bootstraps) under a key of the layer and of the agent's source. An edit to the agent (or to the shared
library it is built from) rebuilds only the top: the layer is linked into a new tree (`cp -al`: every step above
it adds files or replaces them by rename, none writes into one in place) and the agent installed there.
"""

from __future__ import annotations

import asyncio
import base64
import csv
import hashlib
import importlib.metadata
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

from gpuaas_common.logging import get_logger
from gpuaas_image_pipeline.adapters.customise_chroot import (
    chroot_mounts,
    host_resolver,
    no_service_starts,
    parse_dpkg_status,
)

from . import base_image
from .base_image import default_cache_dir

log = get_logger(__name__)

HOST_IMAGE_VERSION = "2"
SLUG = "gpuaas-lab-host-debian12"
REPO = Path(__file__).resolve().parents[3]
UNIT = REPO / "deploy" / "systemd" / "gpuaas-node-agent.service"
BOOTSTRAPS = REPO / "deploy" / "site-bootstrap"
AGENT_VENV = "/opt/gpuaas-node-agent"
# The lab base's packages, plus what a deployed host runs: cloud-init reads MAAS's user-data, sshd takes the
# tenant's login, Python runs the agent (its libvirt binding from Debian: libvirt-python is source-only).
PACKAGES = (
    *base_image.PACKAGES,
    "cloud-init",
    "openssh-server",
    "python3",
    "python3-venv",
    "python3-libvirt",
)
# The runbook's slice passthrough arguments, staged so the first deployed boot already has IOMMU groups.
KERNEL_ARGS = ("intel_iommu=on", "iommu=pt")
# The agent's own sources: the wheel carries these two top-level packages and nothing of the dev tools.
AGENT_PACKAGES = (REPO / "libs" / "gpuaas_common", REPO / "services" / "node-agent" / "gpuaas_node_agent")
# Installed from Debian instead (above); every other runtime dependency is copied from this interpreter's
# environment, the same versions the tests ran the agent with.
FROM_DEBIAN = {"libvirt-python"}


class HostImageError(RuntimeError):
    pass


@dataclass(frozen=True)
class HostImageTree:
    slug: str
    rootfs: Path
    key: str
    packages: dict[str, str]  # name -> version, read back from the tree's dpkg database
    agent_version: str
    built: bool
    seconds: dict[str, float]


def _version() -> str:
    text = (REPO / "pyproject.toml").read_text()
    match = re.search(r'^version = "([^"]+)"', text, re.M)
    return match.group(1) if match else "0"


def _agent_files() -> list[tuple[Path, str]]:
    out = []
    for pkg in AGENT_PACKAGES:
        for path in sorted(pkg.rglob("*")):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            if path.suffix in (".py", ".sql", ".json", ".yaml", ".typed"):
                out.append((path, f"{pkg.name}/{path.relative_to(pkg).as_posix()}"))
    return out


def _source_digest() -> str:
    h = hashlib.sha256()
    for path, arc in _agent_files():
        h.update(arc.encode() + b"\0" + path.read_bytes())
    for extra in (UNIT, *sorted(BOOTSTRAPS.rglob("*.sh"))):
        h.update(extra.read_bytes())
    return h.hexdigest()


def packages_key(base_recipe: str) -> str:
    blob = {"v": HOST_IMAGE_VERSION, "base": base_recipe, "packages": sorted(PACKAGES), "args": KERNEL_ARGS}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:24]


def recipe_key(base_recipe: str) -> str:
    blob = {"packages": packages_key(base_recipe), "agent": _source_digest()}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:24]


def _requirement_name(req: str) -> str | None:
    """The distribution a requirement names, or None when its marker leaves it out here (extras, other
    platforms). Markers are evaluated with `packaging` when present (it is, wherever pip is)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pragma: no cover
        if "extra ==" in req:
            return None
        match = re.match(r"[A-Za-z0-9._-]+", req)
        return match.group(0) if match else None
    parsed = Requirement(req)
    if parsed.marker is not None and not parsed.marker.evaluate({"extra": ""}):
        return None
    return parsed.name


def runtime_closure(requirements: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions the requirements need, transitively (minus those Debian provides)."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = [r for r in requirements]
    while todo:
        name = _requirement_name(todo.pop())
        if name is None:
            continue
        norm = re.sub(r"[-_.]+", "-", name).lower()
        if norm in seen or norm in FROM_DEBIAN:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            raise HostImageError(f"the agent needs {name}, which is not installed here") from None
        seen[norm] = dist
        todo.extend(dist.requires or [])
    return list(seen.values())


def project_dependencies() -> list[str]:
    import tomllib

    return list(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])


def build_agent_wheel(out_dir: Path, requires: list[str]) -> Path:
    """A wheel (PEP 427) of the node agent and the shared library, from this checkout, with the agent's console
    script. Built here with the standard library: this machine's setuptools is older than the project's build
    backend needs, and the agent's wheel should not carry the dev tools anyway."""
    version = _version()
    name = "gpuaas_node_agent"
    dist_info = f"{name}-{version}.dist-info"
    wheel = out_dir / f"{name}-{version}-py3-none-any.whl"
    out_dir.mkdir(parents=True, exist_ok=True)
    metadata = "Metadata-Version: 2.1\nName: gpuaas\nVersion: {}\nRequires-Python: >=3.11\n".format(version)
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    meta_files = {
        f"{dist_info}/METADATA": metadata.encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: gpuaas-lab\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist_info}/entry_points.txt": (
            b"[console_scripts]\ngpuaas-node-agent = gpuaas_node_agent.entrypoints.console:main\n"
        ),
    }
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:

        def add(arc: str, data: bytes) -> None:
            # Fixed timestamps: the same sources give the same wheel.
            info = zipfile.ZipInfo(arc, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            zf.writestr(info, data, zipfile.ZIP_DEFLATED)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            writer.writerow([arc, f"sha256={digest}", len(data)])

        for path, arc in _agent_files():
            add(arc, path.read_bytes())
        for arc, data in meta_files.items():
            add(arc, data)
        writer.writerow([f"{dist_info}/RECORD", "", ""])
        info = zipfile.ZipInfo(f"{dist_info}/RECORD", date_time=(2020, 1, 1, 0, 0, 0))
        info.external_attr = 0o644 << 16
        zf.writestr(info, record.getvalue())
    return wheel


def copy_dists(dists: list[importlib.metadata.Distribution], site_packages: Path) -> list[str]:
    """Each distribution's installed files (its RECORD) into the image's virtualenv: the same bytes the tests
    ran with. Compiled modules are CPython 3.11 manylinux builds, which Debian 12's Python 3.11 loads."""
    names = []
    for dist in dists:
        for rel in dist.files or []:
            src = Path(str(dist.locate_file(rel)))
            parts = Path(str(rel)).parts
            if parts and parts[0] == ".." or "__pycache__" in parts or not src.is_file():
                continue  # console scripts outside site-packages; bytecode is compiled in the guest
            dst = site_packages / Path(str(rel))
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
        names.append(f"{dist.metadata['Name']}=={dist.version}")
    return sorted(names)


def _sh(*argv: str | Path, **kw) -> str:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise HostImageError(
            f"{Path(str(argv[0])).name} failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-2000:]}"
        )
    return proc.stdout


def _mmdebstrap(rootfs: Path) -> None:
    _sh(
        "mmdebstrap",
        "--variant=minbase",
        "--mode=root",
        f"--include={','.join(PACKAGES)}",
        '--setup-hook=mkdir -p "$1/etc" && printf "link_in_boot = yes\\n" > "$1/etc/kernel-img.conf"',
        '--customize-hook=echo "en_US.UTF-8 UTF-8" > "$1/etc/locale.gen" && chroot "$1" locale-gen',
        '--customize-hook=rm -f "$1"/var/cache/apt/archives/*.deb',
        base_image.SUITE,
        rootfs,
    )


def _kernel_args(rootfs: Path) -> None:
    args = " ".join(KERNEL_ARGS)
    grub = rootfs / "etc/default/grub"
    text = grub.read_text() if grub.exists() else ""
    line = f'GRUB_CMDLINE_LINUX_DEFAULT="{args}"'
    text = (
        re.sub(r"^GRUB_CMDLINE_LINUX_DEFAULT=.*$", line, text, flags=re.M)
        if "GRUB_CMDLINE_LINUX_DEFAULT" in text
        else text + line + "\n"
    )
    grub.parent.mkdir(parents=True, exist_ok=True)
    grub.write_text(text)
    dropin = rootfs / "etc/default/grub.d/60-gpuaas-iommu.cfg"
    dropin.parent.mkdir(parents=True, exist_ok=True)
    dropin.write_text(f'GRUB_CMDLINE_LINUX_DEFAULT="$GRUB_CMDLINE_LINUX_DEFAULT {args}"\n')


def _bounded_wait_online(rootfs: Path) -> None:
    # Unused fabric ports must not hold the first boot: wait for any one interface, briefly.
    for unit in ("systemd-networkd-wait-online.service", "ifupdown-wait-online.service"):
        d = rootfs / "etc/systemd/system" / f"{unit}.d"
        d.mkdir(parents=True, exist_ok=True)
        (d / "gpuaas-bounded.conf").write_text("[Service]\nTimeoutStartSec=60\n")


def _enable_unit(rootfs: Path) -> None:
    target = rootfs / "etc/systemd/system" / UNIT.name
    shutil.copy2(UNIT, target)
    wants = rootfs / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    link = wants / UNIT.name
    link.unlink(missing_ok=True)
    link.symlink_to(f"/etc/systemd/system/{UNIT.name}")


def _site_bootstraps(rootfs: Path) -> list[str]:
    placed = []
    for script in sorted(BOOTSTRAPS.glob("*/bootstrap.sh")):
        dst = rootfs / "usr/local/share/gpuaas/site-bootstrap" / script.parent.name / "bootstrap.sh"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(script, dst)
        dst.chmod(0o755)
        placed.append(script.parent.name)
    return placed


async def _install_agent(rootfs: Path, work: Path) -> tuple[str, list[str]]:
    deps = project_dependencies()
    wheel = build_agent_wheel(work / "wheels", [d for d in deps if _requirement_name(d) not in FROM_DEBIAN])
    staged = rootfs / "tmp" / wheel.name
    shutil.copy2(wheel, staged)
    async with no_service_starts(rootfs), chroot_mounts(rootfs), host_resolver(rootfs):
        await asyncio.to_thread(_sh, "chroot", rootfs, "python3", "-m", "venv", "--system-site-packages", AGENT_VENV)
        pyver = _sh(
            "chroot", rootfs, f"{AGENT_VENV}/bin/python", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"
        ).strip()
        if pyver != f"{sys.version_info[0]}.{sys.version_info[1]}":
            raise HostImageError(f"the image's Python is {pyver}, the dependencies here are for {sys.version_info[:2]}")
        site = rootfs / AGENT_VENV.lstrip("/") / "lib" / f"python{pyver}" / "site-packages"
        copied = await asyncio.to_thread(copy_dists, runtime_closure(deps), site)
        await asyncio.to_thread(
            _sh,
            "chroot",
            rootfs,
            f"{AGENT_VENV}/bin/pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            f"/tmp/{wheel.name}",
        )
        # Read back: the installed console script must start and name its version, in the image's own Python.
        version = await asyncio.to_thread(_sh, "chroot", rootfs, f"{AGENT_VENV}/bin/gpuaas-node-agent", "--version")
    staged.unlink()
    return version.strip(), copied


def _read_back(rootfs: Path) -> dict[str, str]:
    db = parse_dpkg_status((rootfs / "var/lib/dpkg/status").read_text(errors="replace"))
    versions, missing = {}, []
    for name in PACKAGES:
        state, version = db.get(name, ("", ""))
        if state == "install ok installed":
            versions[name] = version
        else:
            missing.append(name)
    if missing:
        raise HostImageError(f"package_missing_after_build: {', '.join(missing)}")
    return versions


def _prune(parent: Path, keep: str) -> None:
    for old in parent.iterdir():
        if old.name != keep and not old.name.startswith("."):
            shutil.rmtree(old, ignore_errors=True)


def _packages_layer(cache: Path, key: str, timings: dict[str, float]) -> tuple[Path, dict[str, str]]:
    """The packages layer's tree and its package versions (read back from its dpkg database), built once per key."""
    entry = cache / "host-packages" / key
    done = entry / "packages.json"
    if done.exists():
        return entry / "rootfs", json.loads(done.read_text())
    work = cache / "host-packages" / f".{key}.{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True)
    try:
        rootfs = work / "rootfs"
        t = time.monotonic()
        _mmdebstrap(rootfs)
        timings["packages"] = round(time.monotonic() - t, 2)
        base_image._configure_rootfs(rootfs)
        _kernel_args(rootfs)
        _bounded_wait_online(rootfs)
        packages = _read_back(rootfs)
        (work / "packages.json").write_text(json.dumps(packages, indent=2))
        if entry.exists():
            shutil.rmtree(work)
        else:
            work.rename(entry)
            _prune(entry.parent, key)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return entry / "rootfs", packages


async def ensure_host_image_tree(cache_dir: Path | None = None) -> HostImageTree:
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    base_recipe = base_image.recipe_hash()
    key = recipe_key(base_recipe)
    entry = cache / "host" / key
    done = entry / "image.json"
    if done.exists():
        meta = json.loads(done.read_text())
        return HostImageTree(SLUG, entry / "rootfs", key, meta["packages"], meta["agent_version"], False, {})
    timings: dict[str, float] = {}
    layer, packages = await asyncio.to_thread(_packages_layer, cache, packages_key(base_recipe), timings)
    work = cache / "host" / f".{key}.{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True)
    try:
        rootfs = work / "rootfs"
        t = time.monotonic()
        await asyncio.to_thread(_sh, "cp", "-al", layer, rootfs)
        timings["layer_link"] = round(time.monotonic() - t, 2)
        t = time.monotonic()
        agent_version, deps = await _install_agent(rootfs, work)
        timings["agent"] = round(time.monotonic() - t, 2)
        await asyncio.to_thread(_enable_unit, rootfs)
        bootstraps = await asyncio.to_thread(_site_bootstraps, rootfs)
        stamp = {"slug": SLUG, "key": key, "agent_version": agent_version, "site_bootstraps": bootstraps, "lab": True}
        (rootfs / "etc/gpuaas-image-build.json").write_text(json.dumps({**stamp, "packages": packages}, indent=2))
        meta = {"packages": packages, "agent_version": agent_version, "agent_dependencies": deps, "seconds": timings}
        (work / "image.json").write_text(json.dumps(meta, indent=2))
        shutil.rmtree(work / "wheels", ignore_errors=True)
        entry.parent.mkdir(parents=True, exist_ok=True)
        if entry.exists():
            shutil.rmtree(work)
        else:
            work.rename(entry)
            _prune(cache / "host", key)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    log.info("lab_host_image_built", key=key, agent_version=agent_version, seconds=timings)
    return HostImageTree(SLUG, entry / "rootfs", key, packages, agent_version, True, timings)


def main() -> int:
    tree = asyncio.run(ensure_host_image_tree())
    print(
        json.dumps(
            {
                "rootfs": str(tree.rootfs),
                "built": tree.built,
                "agent": tree.agent_version,
                "packages": tree.packages,
                "seconds": tree.seconds,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    raise SystemExit(main())
