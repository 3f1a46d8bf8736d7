"""The lab: real slice hosts on this machine (QEMU/TCG guests under a libvirt daemon of the lab's own, inside a
network namespace the lab makes; see lab.py)."""
