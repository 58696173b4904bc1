"""bench/procstat.py: CPU accounting and core placement for side-by-side benchmark runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.procstat import core_ticks, keep_off

# a process with a second thread and a child of its own, both waiting on stdin
_TREE = (
    "import subprocess, sys, threading\n"
    "threading.Thread(target=sys.stdin.read, daemon=True).start()\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'],"
    " stdin=subprocess.PIPE)\n"
    "print(child.pid, flush=True)\n"
    "sys.stdin.read()\n"
)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: nothing to keep off")
def test_every_thread_of_a_process_and_its_children_is_kept_off_a_core() -> None:
    tree = subprocess.Popen(
        [sys.executable, "-c", _TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert tree.stdout is not None
        child = int(tree.stdout.readline())
        keep_off([tree.pid], 0)
        others = set(range(os.cpu_count() or 1)) - {0}
        for pid in (tree.pid, child):
            tasks = os.listdir(f"/proc/{pid}/task")
            assert tasks and all(os.sched_getaffinity(int(t)) == others for t in tasks)
        assert len(os.listdir(f"/proc/{tree.pid}/task")) >= 2  # the second thread too
    finally:
        tree.kill()
        tree.wait()


def test_a_cores_ticks_are_busy_within_total_and_only_grow() -> None:
    busy, total = core_ticks(0)
    assert 0 <= busy <= total
    later_busy, later_total = core_ticks(0)
    assert later_busy >= busy and later_total >= total
    with pytest.raises(ValueError, match="no cpu"):
        core_ticks(100_000)
