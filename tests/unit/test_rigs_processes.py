"""The process helpers every test, benchmark and ``baton up`` waits with."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from rigs import processes
from rigs.processes import (
    ProcessExited,
    busy_host,
    eventually,
    free_port,
    reserve_ports,
    wait_healthy,
)


def test_waiting_for_health_ends_as_soon_as_the_process_exits() -> None:
    # Seen running baton up: a component that exited at once was waited on for the whole
    # timeout, and the error said only that the condition was not met.
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(ProcessExited, match="exited with 3"):
        wait_healthy(f"http://127.0.0.1:{free_port()}", process, timeout=600)


def test_eventually_keeps_trying_through_other_errors() -> None:
    calls = iter([ValueError("not yet"), False, "done"])

    def check() -> object:
        value = next(calls)
        if isinstance(value, Exception):
            raise value
        return value

    assert eventually(check, timeout=60, interval=0) == "done"


def test_a_port_a_caller_named_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # Seen in CI: a test named baton up's EPLB metrics port, and baton up's own free-port check
    # (which binds and closes) found that port free and gave it to an engine: the service
    # could not bind it, and baton up exited.
    named, other = free_port(), free_port()
    processes._HANDED_OUT.difference_update({named, other})
    bases = iter([named, other])

    class Draws:
        def randrange(self, start: int, stop: int) -> int:
            return next(bases)

    monkeypatch.setattr(processes, "_RANDOM", Draws())
    reserve_ports(named, None)
    assert free_port() == other


def test_a_busy_host_runs_its_processes_only_while_the_block_runs() -> None:
    me = psutil.Process()
    before = set(me.children())
    with busy_host(1):
        started = set(me.children()) - before
        assert len(started) == (os.cpu_count() or 1)
        assert all(p.status() != psutil.STATUS_ZOMBIE for p in started)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in started)
