"""Shared fixtures: real simulator processes on loopback, started and stopped per test."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import (
    NIXL,
    ROOT,
    SimHandle,
    free_port,
    free_port_block,
    stop_process,
    wait_healthy,
)


@pytest.fixture
def start_sim(tmp_path: Path) -> Iterator[Callable[..., SimHandle]]:
    """Start ``baton sim`` with extra flags on a free port; every process is stopped after."""
    handles: list[SimHandle] = []

    def start(*flags: str, env: dict[str, str] | None = None, port: int | None = None) -> SimHandle:
        port = port or free_port()
        log_path = tmp_path / f"sim-{port}.log"
        command = [sys.executable, "-m", "baton.cli", "sim", "--port", str(port), *flags]
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=log_path.open("wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        handle = SimHandle(f"http://127.0.0.1:{port}", port, process, log_path)
        handles.append(handle)
        wait_healthy(handle.url, process, log_path)
        return handle

    yield start
    for handle in handles:
        stop_process(handle.process)


@pytest.fixture
def start_pd(start_sim) -> Callable[..., tuple[SimHandle, SimHandle]]:
    """A prefill and a decode simulator wired for NIXL, each with its own side channel."""

    def start(
        *, prefill_kv: str = NIXL, decode_kv: str = NIXL, flags: tuple[str, ...] = ()
    ) -> tuple[SimHandle, SimHandle]:
        prefill = start_sim(
            "--kv-transfer-config",
            prefill_kv,
            "--enable-fault-injection",
            *flags,
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port_block(2))},
        )
        decode = start_sim(
            "--kv-transfer-config",
            decode_kv,
            "--enable-fault-injection",
            *flags,
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port_block(2))},
        )
        return prefill, decode

    return start


@pytest.fixture
def start_gateway(tmp_path: Path) -> Iterator[Callable[..., SimHandle]]:
    """Start ``baton gateway`` with flags on a free port; stopped after the test."""
    handles: list[SimHandle] = []

    def start(*flags: str, env: dict[str, str] | None = None) -> SimHandle:
        port = free_port()
        log_path = tmp_path / f"gateway-{port}.log"
        command = [
            sys.executable,
            "-m",
            "baton.cli",
            "gateway",
            "--port",
            str(port),
            "--health-interval",
            "0.5",
            *flags,
        ]
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=log_path.open("wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        handle = SimHandle(f"http://127.0.0.1:{port}", port, process, log_path)
        handles.append(handle)
        wait_healthy(handle.url, process, log_path)
        return handle

    yield start
    for handle in handles:
        stop_process(handle.process)
