"""Live vLLM engines (the CPU build, tiny MoE models) behind Baton's gateway, one cell per module.

Every engine here is real vLLM started by ``rigs.vllm_live`` as the controller renders its pod.
Starting a cell takes one to several minutes, so a module shares one and its tests use prompts
of their own (a prompt another test sent may sit in a prefix cache).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from rigs.processes import eventually, free_port, stop_process
from rigs.vllm_live import LiveEngine, LiveRig, live_rig
from tests.conftest import _Launcher
from tests.helpers import ROOT, SimHandle

# The engines' API key: the gateway sends it (--engine-api-key-file), clients never see it.
ENGINE_KEY = "engine-secret"
SECRETS = {("engine-key", "key"): ENGINE_KEY}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/live/" in str(item.path):
            item.add_marker(pytest.mark.live)
            # an engine's start counts against the first test that needs it
            item.add_marker(pytest.mark.timeout(1200))


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRig]:
    """The module's engines, every one stopped after its last test."""
    with live_rig(tmp_path_factory.mktemp("live")) as live:
        yield live


@pytest.fixture(scope="module")
def start_gateway_module(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., SimHandle]]:
    """``baton gateway`` with flags, for a whole module: stopped after its last test."""
    launcher = _Launcher(tmp_path_factory.mktemp("gateway"))

    def start(*flags: str) -> SimHandle:
        return launcher.start("gateway", ("--health-interval", "0.5", *flags), None)

    yield start
    launcher.stop()


def gateway_flags(
    prefill: LiveEngine | str, decode: LiveEngine, key_file: Path | None = None
) -> tuple[str, ...]:
    """A gateway in front of the cell: every prompt through P/D, the engines' key sent when
    they have one."""
    prefill_url = prefill if isinstance(prefill, str) else prefill.url
    flags = ("--prefill", prefill_url, "--decode", decode.url, "--pd-threshold-tokens", "0")
    return (*flags, "--engine-api-key-file", str(key_file)) if key_file else flags


@dataclass(frozen=True)
class LiveStack:
    process: subprocess.Popen[bytes]
    url: str  # the gateway's
    targets: Path  # its Prometheus file_sd targets
    log: Path


@contextmanager
def baton_up_live(directory: Path) -> Iterator[LiveStack]:
    """``baton up --engine vllm`` on a free port, once it says it is up; stopped after."""
    port, log = free_port(), directory / "up.log"
    targets = directory / "targets.json"
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "baton.cli", "up", "--engine", "vllm"),
            *("--port", str(port), "--prometheus-targets", str(targets)),
        ],
        cwd=ROOT,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        eventually(
            lambda: "Baton is up" in log.read_text() or process.poll() is not None,
            timeout=900,
            interval=1,
        )
        assert process.poll() is None, log.read_text()
        yield LiveStack(process, f"http://127.0.0.1:{port}", targets, log)
    finally:
        stop_process(process)
