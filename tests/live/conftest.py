"""Live vLLM engines (the CPU build, tiny MoE models) behind Baton's gateway, one cell per module.

Every engine here is real vLLM started by ``rigs.vllm_live`` as the controller renders its pod.
Starting a cell takes one to several minutes, so a module shares one and its tests use prompts
of their own (a prompt another test sent may sit in a prefix cache).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from rigs.processes import baton_command, eventually, free_port, stop_process
from rigs.vllm_live import LiveEngine, LiveRig, live_rig
from tests.conftest import _Launcher
from tests.helpers import ROOT, SimHandle, scrape

# The engines' API key: the gateway sends it (--engine-api-key-file), clients never see it.
ENGINE_KEY = "engine-secret"
SECRETS = {("engine-key", "key"): ENGINE_KEY}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/live/" in str(item.path):
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
    prefill: LiveEngine | str,
    decode: LiveEngine | Sequence[LiveEngine],
    key_file: Path | None = None,
) -> tuple[str, ...]:
    """A gateway in front of the cell (its decode rank, or every rank of its decode group):
    every prompt through P/D, the engines' key sent when they have one."""
    prefill_url = prefill if isinstance(prefill, str) else prefill.url
    ranks = [decode] if isinstance(decode, LiveEngine) else decode
    flags: tuple[str, ...] = ("--prefill", prefill_url, "--pd-threshold-tokens", "0")
    flags += tuple(flag for rank in ranks for flag in ("--decode", rank.url))
    return (*flags, "--engine-api-key-file", str(key_file)) if key_file else flags


def sources(engine: LiveEngine) -> dict[str, float]:
    """The engine's prompt tokens by where their KV came from, so far."""
    return {
        source: scrape(engine.url, "vllm:prompt_tokens_by_source_total", source=source)
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


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
            *baton_command("up", "--engine", "vllm"),
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
