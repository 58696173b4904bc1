"""Starting, watching and stopping local processes on loopback: baton up, benchmarks, tests."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx

__all__ = [
    "EplbReportsService",
    "ProcessExited",
    "baton_command",
    "busy_host",
    "eplb_reports_service",
    "eventually",
    "free_port",
    "free_port_block",
    "keep_decoding",
    "kv_events_on_free_ports",
    "process_running",
    "reserve_ports",
    "stop_pid",
    "stop_process",
    "wait_healthy",
]

# Ports handed out in this process: blocks chosen one after another must not overlap even though
# each check closes its sockets before the server binds them.
_HANDED_OUT: set[int] = set()
_RANDOM = random.Random(os.getpid())
T = TypeVar("T")
_ROOT = Path(__file__).resolve().parents[1]  # where `python -m baton.cli` finds Baton


def baton_command(*arguments: str) -> list[str]:
    """``baton ARGUMENTS`` as this interpreter runs it, console script installed or not."""
    return [sys.executable, "-m", "baton.cli", *arguments]


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_block(count: int = 1) -> int:
    """The first of ``count`` consecutive free loopback ports, none handed out before.

    Ports come from below the kernel's ephemeral range, so the client side of earlier
    connections (thousands in TIME_WAIT after a test run) never collides with a server port.
    """
    top = _ephemeral_start() - count
    for _ in range(1000):
        base = _RANDOM.randrange(10_000, top)
        block = range(base, base + count)
        if _HANDED_OUT.intersection(block):
            continue
        sockets = []
        try:
            for port in block:
                sock = socket.socket()
                sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        _HANDED_OUT.update(block)
        return base
    raise RuntimeError(f"no block of {count} free ports below {top + count}")


def free_port() -> int:
    return free_port_block(1)


def reserve_ports(*ports: int | None) -> None:
    """Never hand out these ports: a caller named them (``--port``) and its server binds them
    later, so a check that binds them now would find them free."""
    _HANDED_OUT.update(port for port in ports if port is not None)


class ProcessExited(RuntimeError):
    """A process being waited on has exited: no point in waiting longer."""


def eventually(check: Callable[[], T], timeout: float = 20.0, interval: float = 0.05) -> T:
    """Poll ``check`` until it returns a truthy value (returned) or raise with its last error;
    a :class:`ProcessExited` from ``check`` ends the wait at once."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except ProcessExited:
            raise
        except Exception as exc:
            last = exc
        time.sleep(interval)
    raise TimeoutError(f"condition not met within {timeout}s (last error: {last!r})")


def wait_healthy(
    url: str, process: subprocess.Popen[bytes], log_path: Path | None = None, timeout: float = 120
) -> None:
    """Wait for ``url``/health to answer 200; fail at once if the process exits. The deadline
    is generous: on a busy host a gateway once took more than 30 s to listen."""

    def healthy() -> bool:
        if process.poll() is not None:
            output = log_path.read_text() if log_path is not None else ""
            raise ProcessExited(f"process exited with {process.returncode}:\n{output}")
        return httpx.get(f"{url}/health", timeout=1).status_code == 200

    eventually(healthy, timeout=timeout)


def stop_process(*processes: subprocess.Popen[bytes]) -> None:
    """SIGTERM to every one of ``processes`` at once, then SIGKILL to any still running 10 s
    later: stopping several costs one wait, not one each."""
    running = [process for process in processes if process.poll() is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def process_running(pid: int, executable: str) -> bool:
    """Whether ``pid`` is a live process started from ``executable``: a pid recorded in a file
    may since have been reused by another program, which must never be signalled."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read().split(b"\0")
    except OSError:
        return False
    # An exited process not yet reaped (a zombie) has an empty command line.
    return argv[0].decode(errors="replace") == executable


def stop_pid(pid: int, executable: str, timeout: float = 10) -> None:
    """Stop a process this one did not start (so cannot wait for): SIGTERM, then SIGKILL if it
    has not exited within ``timeout``. Nothing happens unless ``process_running`` holds."""
    if not process_running(pid, executable):
        return
    with contextlib.suppress(ProcessLookupError):  # it may exit between check and signal
        os.kill(pid, signal.SIGTERM)
    try:
        eventually(lambda: not process_running(pid, executable), timeout=timeout, interval=0.1)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        eventually(lambda: not process_running(pid, executable), timeout=timeout, interval=0.1)


@contextlib.contextmanager
def busy_host(per_core: int) -> Iterator[None]:
    """``per_core`` CPU-bound processes per core while the block runs: the shared, busy node a
    gateway and its engines meet in production, and a busy CI machine."""
    processes = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(per_core * (os.cpu_count() or 1))
    ]
    try:
        yield
    finally:
        stop_process(*processes)


def keep_decoding(
    url: str,
    requests: int = 64,
    max_tokens: int = 200_000,
    ranks: int = 32,
    *,
    until: threading.Event | None = None,
) -> None:
    """``requests`` long decodes spread over a server's ``ranks`` (local) ranks, in daemon
    threads; with ``until``, each sends its next one as one ends, until the event is set (a
    load that lasts longer than one request's ``max_tokens``)."""

    def run(index: int) -> None:
        while True:
            # The test stops the simulator under these requests when it ends.
            try:
                httpx.post(
                    f"{url}/v1/completions",
                    headers={"X-data-parallel-rank": str(index % ranks)},
                    json={"prompt": "load", "max_tokens": max_tokens, "ignore_eos": True},
                    timeout=600,
                )
            except httpx.HTTPError:
                if until is None or until.wait(1.0):
                    return
            if until is None or until.is_set():
                return

    for index in range(requests):
        threading.Thread(target=run, args=(index,), daemon=True).start()


def kv_events_on_free_ports(argv: list[str]) -> str | None:
    """An engine's ``--kv-events-config`` endpoint moved, in ``argv``, to free ports (a pod's
    port is its own; on one host, engines would share it), still a wildcard so that the
    engine binds it as vLLM does: where DP rank 0 publishes on loopback (rank r on its port +
    r), or None where the engine publishes no events."""
    flags = [at + 1 for at, arg in enumerate(argv[:-1]) if arg == "--kv-events-config"]
    if not flags or not json.loads(argv[flags[-1]]).get("enable_kv_cache_events"):
        return None  # vLLM takes the last of a flag given twice
    port = free_port_block(8)  # up to 8 DP ranks a pod
    for at in flags:
        config = {**json.loads(argv[at]), "endpoint": f"tcp://*:{port}"}
        argv[at] = json.dumps(config, separators=(",", ":"))
    return f"tcp://127.0.0.1:{port}"


@dataclass(frozen=True)
class EplbReportsService:
    """A running ``baton eplb`` taking engines' window reports."""

    url: str  # the report endpoint
    metrics: str
    log_path: Path


@contextlib.contextmanager
def eplb_reports_service(
    directory: Path, config: str, token: str | None = None
) -> Iterator[EplbReportsService]:
    """``baton eplb --report-port`` with ``config`` as its file (and ``token`` required of the
    reports), once healthy; stopped after, and it must exit cleanly (its log says why not)."""
    config_path = directory / "eplb.yaml"
    config_path.write_text(config)
    flags = []
    if token is not None:
        (directory / "token").write_text(token + "\n")
        flags = ["--token-file", str(directory / "token")]
    port, metrics_port = free_port(), free_port()
    log_path = directory / "eplb.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                *baton_command("eplb", "--config", str(config_path)),
                *("--report-port", str(port), "--metrics-port", str(metrics_port), *flags),
            ],
            cwd=_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, log_path)
        yield EplbReportsService(url, f"http://127.0.0.1:{metrics_port}", log_path)
    finally:
        stop_process(process)
    if process.returncode != 0:
        raise ProcessExited(f"baton eplb exited with {process.returncode}:\n{log_path.read_text()}")
