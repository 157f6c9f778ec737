"""A process's resident memory from /proc, without torch: the trial reads its own, the cost model a fork server
child's (sltune.tuning.cost.baseline)."""

from __future__ import annotations


def resident_bytes(peak: bool = False) -> int:
    """This process's resident memory now, or its high-water mark (Linux; 0 where /proc is missing)."""
    key = "VmHWM:" if peak else "VmRSS:"
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
