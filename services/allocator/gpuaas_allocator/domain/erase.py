"""The MAAS erase a baremetal release asks for, from the site's wipe policy the placement carried. Pure.

MAAS's release takes `erase`, `secure_erase` and `quick_erase` (the MAAS API's machine release operation):
- `erase` alone overwrites every block of every disk with zeros (slow, but nothing of the tenant is left);
- `secure_erase` asks the drive's own secure erase (ATA secure erase / NVMe format with secure erase). On a
  drive without one MAAS falls back to the full overwrite when `quick_erase` is not also set, and to the quick
  erase when it is;
- `quick_erase` wipes only 2 MiB at each end of a disk: partition tables go, the tenant's data stays readable.

So a tenant release never sets `quick_erase`: with `secure_erase` alone, a drive lacking secure erase still
gets the full overwrite, the fallback that destroys the data.

Every policy maps to `secure`: the drive's own erase where it has one, the full overwrite where it has none.
- `nvme_format` and `crypto_erase` are the drive's own erase (the NVMe format with secure erase setting 1 or 2):
  MAAS's secure erase is exactly that call on each drive;
- `blkdiscard` asks that no block reads back the tenant's data. MAAS cannot discard; the drive's own erase does
  what it asks in seconds to minutes, where the full overwrite of a host's NVMe disks (tens of TB) takes hours,
  longer than a release may wait, and the overwrite is still what a drive without one gets.
A policy this allocator does not know gets the full overwrite alone: it trusts no drive's firmware for it.
"""

from __future__ import annotations

from gpuaas_common.contract import WipePolicy
from gpuaas_common.contract import messages as m

ERASE_MODES: dict[str, m.EraseMode] = {
    WipePolicy.NVME_FORMAT: "secure",
    WipePolicy.CRYPTO_ERASE: "secure",
    WipePolicy.BLKDISCARD: "secure",
}
# The scheduler's default wipe policy (its domain/approval.py): what a placement from a scheduler that did not
# say stands for.
DEFAULT_WIPE_POLICY = WipePolicy.BLKDISCARD


def erase_mode_for(wipe_policy: str | None) -> m.EraseMode:
    """The erase for a site's wipe policy; None (an older scheduler's placement) is the site default's. A policy
    this allocator does not know gets the full overwrite, which destroys the data on every drive."""
    return ERASE_MODES.get(wipe_policy or DEFAULT_WIPE_POLICY, "full")
