"""Process CPU accounting from /proc and core pinning, for side-by-side benchmark runs."""

from __future__ import annotations

import os

__all__ = ["children", "cpu_seconds", "pin"]

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` and its reaped children, in seconds."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    # fields[11:15] are utime, stime, cutime, cstime (proc(5), counted after the command name)
    return sum(int(value) for value in fields[11:15]) / _TICKS


def children(pid: int) -> list[int]:
    """The processes ``pid`` started and that still run (from every thread's /proc list)."""
    found: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as listed:
            found += [int(child) for child in listed.read().split()]
    return found


def pin(pid: int, core: int) -> None:
    """Pin ``pid`` to ``core`` when the machine has it (a no-op on one core)."""
    if core < (os.cpu_count() or 1):  # None: the count is unknown
        os.sched_setaffinity(pid, {core})
