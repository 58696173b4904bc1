"""The process helpers every test, benchmark and ``baton up`` waits with."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rigs.processes import ProcessExited, eventually, free_port, wait_healthy


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
