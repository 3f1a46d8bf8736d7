"""Which libvirt domain type this host can run: `kvm` where the CPU offers hardware virtualisation to this
kernel, `qemu` (TCG, emulated) where it does not.

/dev/kvm alone is not enough: inside a VM whose hypervisor hides VMX/SVM (no nested virtualisation) the device
can exist and KVM_CREATE_VM succeed, while a guest then dies with "KVM internal error … emulation failure".
The CPU flags are what the kernel was told, so they decide; the reason is logged with the choice.
"""

from __future__ import annotations

from .host import HostFs


def probe_domain_type(fs: HostFs) -> tuple[str, str]:
    """(domain type, reason in words)."""
    if not fs.exists("/dev/kvm"):
        return "qemu", "/dev/kvm is missing"
    flags: set[str] = set()
    for line in (fs.read_raw("/proc/cpuinfo") or "").splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    if flags & {"vmx", "svm"}:
        return "kvm", f"/dev/kvm present and the CPU offers {'vmx' if 'vmx' in flags else 'svm'}"
    return "qemu", "/dev/kvm present but the CPU hides vmx/svm (no nested virtualisation): guests would fault"


def choose_domain_type(setting: str, fs: HostFs) -> tuple[str, str]:
    if setting in ("kvm", "qemu"):
        return setting, f"set by GPUAAS_DOMAIN_TYPE={setting}"
    return probe_domain_type(fs)
