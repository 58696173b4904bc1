"""``baton gateway --workers 2`` in front of real ``baton sim`` engines, driven by the openai
client: both workers serve the one port, a scrape answered by either shows the whole gateway
(and matches docs/metrics.md), a worker that dies is replaced and leaves the live gauges, and
SIGTERM stops every process the gateway started."""

from __future__ import annotations

import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import psutil
import pytest
from openai.types import Completion

from tests.helpers import SimHandle, documented, eventually, served
from tests.integration.test_gateway import LONG, MODEL, Stack, start_engine

STREAMS = 16


@pytest.fixture
def stack(start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]) -> Stack:
    prefill = start_engine(start_sim)
    decode = start_engine(start_sim, "--data-parallel-size", "2")
    gateway = start_gateway(
        "--workers", "2", "--api-key", "k", f"--prefill={prefill.url}", f"--decode={decode.url}@0-1"
    )
    return Stack(gateway, [prefill], decode)


def workers(stack: Stack) -> list[psutil.Process]:
    """The gateway's worker processes: the children multiprocessing spawned (not its resource
    tracker)."""
    children = psutil.Process(stack.gateway.process.pid).children()
    return [child for child in children if "spawn_main" in " ".join(child.cmdline())]


def client_connections(worker: psutil.Process, port: int) -> int:
    """Client connections ``worker`` has accepted on the gateway's port and holds open: the held
    streams' (every other client here closes its connection when done)."""
    return sum(
        1
        for connection in worker.net_connections(kind="tcp")
        if connection.laddr and connection.laddr.port == port
        if connection.status == psutil.CONN_ESTABLISHED
    )


def open_stream(stack: Stack, index: int) -> openai.Stream[Completion]:
    """A stream longer than the test, on a connection of its own (a new client each: the kernel
    hashes each connection to a worker), past its first token."""
    stream = stack.client().completions.create(
        model=MODEL,
        prompt=f"{index} hold the line",
        stream=True,
        max_tokens=100_000,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    return stream


@pytest.fixture
def held(stack: Stack) -> Iterator[list[openai.Stream[Completion]]]:
    streams = [open_stream(stack, i) for i in range(STREAMS)]
    yield streams
    for stream in streams:
        stream.close()


def complete(stack: Stack, requests: int) -> None:
    """``requests`` non-streamed completions through prefill and decode, each on a connection of
    its own."""
    for i in range(requests):
        with stack.client() as client:
            answer = client.completions.create(model=MODEL, prompt=f"{i} {LONG}", max_tokens=2)
        assert answer.choices[0].text


def scrapes_agree(stack: Stack, name: str, value: float, **labels: str) -> bool:
    """Ten scrapes, each on a connection of its own so either worker answers, all read
    ``value``."""
    return all(stack.gateway_metric(name, **labels) == value for _ in range(10))


def test_both_workers_serve_and_any_scrape_counts_the_whole_gateway(
    stack: Stack, held: list[openai.Stream[Completion]]
) -> None:
    serving = workers(stack)
    assert len(serving) == 2
    port = stack.gateway.port
    assert all(client_connections(worker, port) > 0 for worker in serving), "a worker idles"
    in_flight = "baton_gateway_in_flight_requests"
    # each worker's own count, summed: the streams both hold, whichever worker is scraped
    eventually(lambda: scrapes_agree(stack, in_flight, STREAMS, role="decode"), timeout=30)
    complete(stack, 12)
    for stream in held:
        stream.close()
    requests = "baton_gateway_requests_total"
    eventually(lambda: scrapes_agree(stack, requests, STREAMS, outcome="client_disconnect"))
    assert scrapes_agree(stack, requests, 12, outcome="ok")
    assert scrapes_agree(stack, requests, 12 + STREAMS)
    eventually(lambda: scrapes_agree(stack, in_flight, 0), timeout=30)
    stack.assert_nothing_leaked()


def test_docs_metrics_lists_every_metric_two_workers_serve_with_its_type_and_labels(
    stack: Stack, held: list[openai.Stream[Completion]]
) -> None:
    """As tests/k8s/test_observability.py checks one gateway process, for the series the workers
    serve together: no ``pid`` label, every gauge aggregated, nothing missing."""
    complete(stack, 4)
    held[0].close()  # an abort, whose family exists only once counted
    gateway = {name: row for name, row in documented().items() if name.startswith("baton_gateway_")}

    def all_served() -> dict[str, tuple[str, set[str] | None]]:
        families = served(f"{stack.gateway.url}/metrics")
        return families if families.keys() == gateway.keys() else {}

    try:
        families = eventually(all_served, timeout=30)
    except TimeoutError:
        got = served(f"{stack.gateway.url}/metrics").keys()
        raise AssertionError(
            f"missing {gateway.keys() - got}, extra {got - gateway.keys()}"
        ) from None
    for name, (kind, labels) in families.items():
        assert gateway[name][0] == kind, f"{name}: served as a {kind}"
        assert labels == gateway[name][1], f"{name}: served with labels {labels}"


def test_a_worker_that_dies_is_replaced_and_its_requests_leave_the_live_gauges(
    stack: Stack, held: list[openai.Stream[Completion]]
) -> None:
    complete(stack, 10)
    victim, survivor = workers(stack)
    port = stack.gateway.port
    survivors_streams = client_connections(survivor, port)
    in_flight = "baton_gateway_in_flight_requests"
    eventually(lambda: scrapes_agree(stack, in_flight, STREAMS, role="decode"), timeout=30)

    victim.kill()

    def replaced() -> set[int]:
        pids = {worker.pid for worker in workers(stack)}
        return pids if len(pids) == 2 and victim.pid not in pids else set()

    assert survivor.pid in eventually(replaced)
    assert f"gateway worker {victim.pid} " in stack.gateway.log()
    # the dead worker's streams went with it: only the survivor's are in flight ...
    eventually(lambda: scrapes_agree(stack, in_flight, survivors_streams, role="decode"))
    # ... while what it counted stays counted
    assert scrapes_agree(stack, "baton_gateway_requests_total", 10, outcome="ok")
    complete(stack, 6)  # on both sockets again
    assert scrapes_agree(stack, "baton_gateway_requests_total", 16, outcome="ok")


def test_sigterm_stops_every_worker_and_removes_the_metrics_directory(stack: Stack) -> None:
    complete(stack, 2)
    process = stack.gateway.process
    started = psutil.Process(process.pid).children(recursive=True)
    assert len(workers(stack)) == 2
    metrics = Path(workers(stack)[0].environ()["PROMETHEUS_MULTIPROC_DIR"])
    assert any(metrics.glob("*.db"))

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    _, alive = psutil.wait_procs(started, timeout=10)
    assert not alive, f"left running: {alive}"
    assert not metrics.exists()


def test_a_gateway_killed_outright_takes_its_workers_with_it(stack: Stack) -> None:
    serving = workers(stack)
    metrics = Path(serving[0].environ()["PROMETHEUS_MULTIPROC_DIR"])
    stack.gateway.process.kill()
    stack.gateway.process.wait()
    _, alive = psutil.wait_procs(serving, timeout=10)
    assert not alive, f"left running: {alive}"
    shutil.rmtree(metrics)  # the one thing a parent killed outright leaves behind
