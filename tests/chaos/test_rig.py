"""The chaos rig's own parts: what the suite's verdicts rest on."""

from __future__ import annotations

import sys
from pathlib import Path

from rigs.chaos import Component


def test_overlapping_faults_restart_a_component_once(tmp_path: Path) -> None:
    # Two kills of one component overlapping: the first fault restarts it, and the second,
    # ending later, must not start a second process beside it (seen: a second EPLB service
    # that could not bind its metrics port, and a stack never back to serving).
    component = Component(
        name="server",
        role="eplb",
        command=[sys.executable, "-c", "import signal; signal.pause()"],  # runs until killed
        log_path=tmp_path / "server.log",
    )
    try:
        component.start()
        first = component.process
        component.kill()
        component.start()
        restarted = component.process
        component.start()
        assert component.process is restarted and restarted is not first
        assert component.alive and component.starts == 2
    finally:
        component.stop()
    assert not component.alive
