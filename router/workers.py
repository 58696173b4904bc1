"""``baton gateway --workers N``: N processes serving one port, each a whole gateway.

One gateway process is one core. With ``--workers N`` the parent binds N listening sockets on the
port, each with SO_REUSEPORT, and spawns a worker per socket; a worker runs what ``baton gateway``
runs alone (the app, the bounded-header protocol, the settings and pool it was given) on its
socket. The kernel hashes each new connection to one socket, so connections spread evenly over
the workers. On one shared socket the worker that wakes first accepts every connection waiting
(100 of 128 connections opened at once went to one of two uvicorn workers), and a stream stays on
the connection it came on. The parent keeps every socket listening: connections hashed to a
worker that is starting or being replaced wait in its queue.

The parent supervises as uvicorn's supervisor does: a worker that exits is logged and replaced
on its socket; one that could not start (exit code 3, uvicorn's: its lifespan failed) stops the
gateway with that code, as every other would fail alike; SIGTERM or SIGINT stop every worker
gracefully (each ends its streams, as one gateway process does) before the parent exits. A parent
that ends otherwise (SIGKILL) takes its workers with it: each gets SIGTERM from the kernel.

Metrics: the parent makes an empty directory of its own and names it to the workers as
``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode: each worker keeps its series
in files there, and a scrape answered by any worker reads them all). It marks each worker that
exits dead, so its live gauges leave the sums while its counters stay in the totals, and removes
the directory when it exits.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import wait
from multiprocessing.context import SpawnProcess
from types import FrameType
from typing import Any

import uvicorn
from prometheus_client import multiprocess

from router.app import create_gateway
from router.metrics import GatewayMetrics
from router.server import gateway_http_protocol
from router.settings import GatewayConfig, GatewaySettings

__all__ = ["LOG_FORMAT", "STARTUP_FAILURE", "serve_workers", "tune_gc", "uvicorn_options"]

log = logging.getLogger("baton.gateway.workers")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
STARTUP_FAILURE = 3  # uvicorn's exit code for a server that could not start
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
_BACKLOG = 2048  # uvicorn's default
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_spawn = multiprocessing.get_context("spawn")


def tune_gc() -> None:
    """The cyclic GC took ~5% of the gateway's CPU under load (perf), rescanning long-lived
    objects for cycles the relay never makes: freeze what startup built, and collect the young
    generation less often than CPython's 700 allocations, but not so rarely that the cycles
    every request leaves (uvicorn's protocol and events, aiohttp's probe responses) pile up:
    at 50,000 a lightly loaded gateway's RSS climbed for a quarter of an hour."""
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


def uvicorn_options(settings: GatewaySettings) -> dict[str, Any]:
    """How ``baton gateway`` runs uvicorn, alone or in each worker."""
    return {
        "loop": "uvloop",
        "http": gateway_http_protocol(settings),
        "timeout_keep_alive": settings.keep_alive_timeout_s,
        "log_level": "warning",
        "access_log": False,
    }


def serve_workers(config: GatewayConfig, host: str, port: int, workers: int, log_level: str) -> int:
    """Serve on ``host:port`` with ``workers`` worker processes until SIGTERM or SIGINT; the
    exit status (module docstring)."""
    try:
        sockets = [_listen(host, port)]
        port = sockets[0].getsockname()[1]  # the one the kernel chose for port 0
        sockets += [_listen(host, port) for _ in range(workers - 1)]
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", host, port, exc.strerror)
        return STARTUP_FAILURE
    log.info("serving on %s:%d with %d workers", host, port, workers)
    with tempfile.TemporaryDirectory(prefix="baton-gateway-metrics-") as metrics_dir:
        # prometheus_client reads it where it is imported: in each worker, spawned afresh
        os.environ[METRICS_DIR_ENV] = metrics_dir
        serve = partial(_serve, config, log_level, os.getpid())
        return _Supervisor(serve, sockets, metrics_dir).run()


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(_BACKLOG)  # at once: connections hashed here wait for a worker still starting
    return sock


def _serve(config: GatewayConfig, log_level: str, parent: int, sock: socket.socket) -> None:
    """One worker, in its spawned process: nothing of the parent's setup carries over."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent ended before the kernel was told
        os.kill(os.getpid(), signal.SIGTERM)
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    tune_gc()
    app = create_gateway(config, GatewayMetrics(multiprocess=True))
    server = uvicorn.Server(uvicorn.Config(app, **uvicorn_options(config.settings)))
    server.run(sockets=[sock])
    if not server.started:  # uvicorn before 0.50 returned without an exit code of its own
        sys.exit(STARTUP_FAILURE)


class _Supervisor:
    def __init__(
        self,
        serve: Callable[[socket.socket], None],
        sockets: list[socket.socket],
        metrics_dir: str,
    ) -> None:
        self.serve = serve
        self.sockets = sockets
        self.metrics_dir = metrics_dir
        self.stopping = False

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)
        workers = [self._start(sock) for sock in self.sockets]
        status = 0
        while not self.stopping:
            ended = wait([worker.sentinel for worker in workers], timeout=0.5)
            for index, worker in enumerate(workers):
                if worker.sentinel not in ended or self.stopping:
                    continue
                worker.join()
                self._gone(worker)
                if worker.exitcode == STARTUP_FAILURE:
                    log.error("gateway worker %d could not start; stopping", worker.pid)
                    status, self.stopping = STARTUP_FAILURE, True
                    continue
                log.error(
                    "gateway worker %d %s; starting another on its socket",
                    worker.pid,
                    _ended(worker.exitcode),
                )
                workers[index] = self._start(self.sockets[index])
        for sock in self.sockets:
            sock.close()  # the workers' copies stop listening as they stop
        for worker in workers:
            if worker.exitcode is None:
                worker.terminate()  # SIGTERM: uvicorn's graceful shutdown
        for worker in workers:
            worker.join()
            self._gone(worker)
        return status

    def _start(self, sock: socket.socket) -> SpawnProcess:
        worker = _spawn.Process(target=self.serve, args=(sock,), name="baton-gateway-worker")
        worker.start()
        return worker

    def _gone(self, worker: SpawnProcess) -> None:
        assert worker.pid is not None
        multiprocess.mark_process_dead(worker.pid, self.metrics_dir)

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True


def _ended(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"
