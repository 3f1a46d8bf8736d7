#!/usr/bin/python3
"""What a slice guest sees of its GPUs, written by the image's readiness unit for the node agent's login to read.

This file is installed into every slice image as it is (the customisers copy its source), and runs there with
the guest's own python3 (cloud-init's interpreter), so it imports nothing but the standard library.

The report (version 1):
    {"version": 1,
     "pci_gpus": [{"address": "0000:00:06.0", "device": "0x2335", "driver": "nvidia"}, ...],
     "driver": {"state": "loaded" | "absent" | "failed", "version": "580.159.04" | null, "detail": str | null},
     "nvidia_smi_gpus": [{"bus_id": "00000000:00:06.0", "name": "NVIDIA H200", "uuid": "GPU-..."}, ...] | null}

`pci_gpus` are the NVIDIA 3D controllers on the guest's PCI bus, whether or not a driver holds them: what the
hypervisor passed through. `nvidia_smi_gpus` are those `nvidia-smi -q -x` listed, present only when it answered
(state `loaded`); `absent` is no nvidia-smi at all, `failed` one that ran and could not talk to a driver.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET  # noqa: S405 - nvidia-smi's output, in the guest that ran it

VERSION = 1
NVIDIA = 0x10DE
# PCI class 03 (display), subclass 02 (3D controller): what a data-centre GPU such as the H200 is. A VGA-class
# NVIDIA device (a workstation card, a host's display) is not a GPU this cloud passes through.
CLASS_3D_CONTROLLER = 0x0302
NVIDIA_SMI_TIMEOUT_S = 120


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def pci_gpus(sys_root: str = "/sys") -> list[dict]:
    """The NVIDIA 3D controllers under <sys_root>/bus/pci/devices, by address."""
    base = os.path.join(sys_root, "bus/pci/devices")
    try:
        addresses = sorted(os.listdir(base))
    except OSError:
        return []
    found = []
    for address in addresses:
        dev = os.path.join(base, address)
        try:
            vendor = int(_read(os.path.join(dev, "vendor")) or "", 16)
            cls = int(_read(os.path.join(dev, "class")) or "", 16)
        except ValueError:
            continue
        if vendor != NVIDIA or cls >> 8 != CLASS_3D_CONTROLLER:
            continue
        link = os.path.join(dev, "driver")
        driver = os.path.basename(os.readlink(link)) if os.path.islink(link) else None
        found.append({"address": address, "device": _read(os.path.join(dev, "device")), "driver": driver})
    return found


def parse_nvidia_smi_xml(text: str) -> tuple[str | None, list[dict]]:
    """(driver version, GPUs) from `nvidia-smi -q -x`. Raises ValueError on anything that is not its log."""
    try:
        root = ET.fromstring(text)  # noqa: S314 - see the import
    except ET.ParseError as exc:
        raise ValueError(f"nvidia-smi -q -x is not XML: {exc}") from None
    if root.tag != "nvidia_smi_log":
        raise ValueError(f"nvidia-smi -q -x gave <{root.tag}>, not <nvidia_smi_log>")
    gpus = [
        {"bus_id": gpu.get("id"), "name": gpu.findtext("product_name"), "uuid": gpu.findtext("uuid")}
        for gpu in root.findall("gpu")
    ]
    return (root.findtext("driver_version") or "").strip() or None, gpus


def nvidia_smi(argv0: str = "nvidia-smi") -> tuple[dict, list[dict] | None]:
    """The driver's state and, when it answered, its GPUs."""
    try:
        res = subprocess.run(  # noqa: S603 - a fixed argv
            [argv0, "-q", "-x"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False
        )
    except FileNotFoundError:
        return {"state": "absent", "version": None, "detail": "nvidia-smi is not installed"}, None
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"state": "failed", "version": None, "detail": f"nvidia-smi: {exc}"[:500]}, None
    if res.returncode != 0:
        # E.g. 9 "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver".
        words = (res.stdout.strip() or res.stderr.strip()).splitlines()
        detail = f"nvidia-smi exited {res.returncode}: {words[-1] if words else ''}"
        return {"state": "failed", "version": None, "detail": detail[:500]}, None
    try:
        version, gpus = parse_nvidia_smi_xml(res.stdout)
    except ValueError as exc:
        return {"state": "failed", "version": None, "detail": str(exc)[:500]}, None
    return {"state": "loaded", "version": version, "detail": None}, gpus


def build_report(gpus_on_pci: list[dict], driver: dict, smi_gpus: list[dict] | None) -> dict:
    return {"version": VERSION, "pci_gpus": gpus_on_pci, "driver": driver, "nvidia_smi_gpus": smi_gpus}


def collect(sys_root: str = "/sys", nvidia_smi_argv0: str = "nvidia-smi") -> dict:
    driver, smi_gpus = nvidia_smi(nvidia_smi_argv0)
    return build_report(pci_gpus(sys_root), driver, smi_gpus)


def write(report: dict, path: str) -> None:
    """Whole or not at all: the agent's login may read the file at any moment."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Report the GPUs this guest sees, for the node agent.")
    parser.add_argument("--out", help="write the report here (atomically) instead of printing it")
    parser.add_argument("--sys-root", default="/sys")
    parser.add_argument("--nvidia-smi", default="nvidia-smi")
    args = parser.parse_args(argv)
    report = collect(args.sys_root, args.nvidia_smi)
    if args.out:
        write(report, args.out)
    else:
        json.dump(report, sys.stdout, sort_keys=True)
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
