"""Shared fixtures: real simulator and gateway processes on loopback, started and stopped per
test, or per module for tests that only read what the processes answer."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rigs.faults import FaultInjection
from rigs.processes import busy_host
from tests.helpers import (
    NIXL,
    ROOT,
    SimHandle,
    baton_command,
    fault_injection,
    free_port,
    free_port_block,
    stop_process,
    wait_healthy,
)

pytest_plugins = ["tests.interrupts", "pytester"]
TIERS = ("unit", "integration", "k8s", "vllm", "live", "chaos")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="run the tests beside N CPU-bound processes per core (a busy machine; make test-busy)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test's tier is its directory under tests/."""
    for item in items:
        tier = item.path.relative_to(ROOT / "tests").parts[0]
        if tier in TIERS:
            item.add_marker(tier)


@pytest.fixture(scope="session", autouse=True)
def busy_machine(request: pytest.FixtureRequest) -> Iterator[None]:
    """``--busy N``: every test runs while N CPU-bound processes per core load the machine."""
    with busy_host(request.config.getoption("busy")):
        yield


class _Launcher:
    """Starts ``baton <command>`` processes on free ports, and stops them all."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.handles: list[SimHandle] = []

    def start(
        self,
        command: str,
        flags: tuple[str, ...],
        env: dict[str, str] | None,
        port: int | None = None,
    ) -> SimHandle:
        port = port or free_port()
        log_path = self.tmp_path / f"{command}-{port}.log"
        process = subprocess.Popen(
            baton_command(command, "--port", str(port), *flags),
            cwd=ROOT,
            stdout=log_path.open("wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        handle = SimHandle(f"http://127.0.0.1:{port}", port, process, log_path)
        self.handles.append(handle)
        wait_healthy(handle.url, process, log_path)
        return handle

    def stop(self) -> None:
        stop_process(*(handle.process for handle in self.handles))


@pytest.fixture(scope="session")
def faults() -> FaultInjection:
    """The token engines started with ``faults.flags`` want on ``POST /sim/faults``."""
    return fault_injection()


def _sim_starter(launcher: _Launcher) -> Callable[..., SimHandle]:
    def start(*flags: str, env: dict[str, str] | None = None, port: int | None = None) -> SimHandle:
        return launcher.start("sim", flags, env, port)

    return start


def _gateway_starter(launcher: _Launcher) -> Callable[..., SimHandle]:
    def start(*flags: str, env: dict[str, str] | None = None) -> SimHandle:
        return launcher.start("gateway", ("--health-interval", "0.5", *flags), env)

    return start


@pytest.fixture
def start_sim(tmp_path: Path) -> Iterator[Callable[..., SimHandle]]:
    """Start ``baton sim`` with extra flags on a free port; every process is stopped after."""
    launcher = _Launcher(tmp_path)
    yield _sim_starter(launcher)
    launcher.stop()


@pytest.fixture(scope="module")
def module_launchers(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Callable[..., SimHandle], Callable[..., SimHandle]]]:
    """``start_sim`` and ``start_gateway`` whose processes serve every test of a module: for
    tests that only read what they answer, so need no fresh ones."""
    launcher = _Launcher(tmp_path_factory.mktemp("module"))
    yield _sim_starter(launcher), _gateway_starter(launcher)
    launcher.stop()


@pytest.fixture
def start_pd(
    start_sim: Callable[..., SimHandle], faults: FaultInjection
) -> Callable[..., tuple[SimHandle, SimHandle]]:
    """A prefill and a decode simulator wired for NIXL, each with its own side channel."""

    def start(
        *, prefill_kv: str = NIXL, decode_kv: str = NIXL, flags: tuple[str, ...] = ()
    ) -> tuple[SimHandle, SimHandle]:
        prefill = start_sim(
            "--kv-transfer-config",
            prefill_kv,
            *faults.flags,
            *flags,
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port_block(2))},
        )
        decode = start_sim(
            "--kv-transfer-config",
            decode_kv,
            *faults.flags,
            *flags,
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port_block(2))},
        )
        return prefill, decode

    return start


@pytest.fixture
def start_gateway(tmp_path: Path) -> Iterator[Callable[..., SimHandle]]:
    """Start ``baton gateway`` with flags on a free port; stopped after the test."""
    launcher = _Launcher(tmp_path)
    yield _gateway_starter(launcher)
    launcher.stop()
