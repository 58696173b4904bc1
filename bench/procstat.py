"""Process CPU accounting from /proc and core pinning, for side-by-side benchmark runs."""

from __future__ import annotations

import os

__all__ = ["children", "core_ticks", "cpu_seconds", "keep_off", "pin"]

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


def keep_off(pids: list[int], core: int) -> None:
    """Every thread of ``pids`` and of the processes under them on every core but ``core``,
    which is then another process's own (a no-op on one core)."""
    cores = set(range(os.cpu_count() or 1)) - {core}
    if not cores:
        return
    pending = list(pids)
    while pending:
        pid = pending.pop()
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(task), cores)
            pending += children(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended meanwhile


def core_ticks(core: int) -> tuple[int, int]:
    """``core``'s busy and total clock ticks since boot, from /proc/stat."""
    with open("/proc/stat") as stat:
        for line in stat:
            if line.startswith(f"cpu{core} "):
                ticks = [int(v) for v in line.split()[1:]]
                idle = ticks[3] + ticks[4]  # idle, iowait
                return sum(ticks) - idle, sum(ticks)
    raise ValueError(f"/proc/stat has no cpu{core}")
