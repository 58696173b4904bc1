"""An engine whose ``/metrics`` answers oddly never takes the gateway down: it is told once in the
log and its load is unknown, at start and later."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from router.prober import METRICS_PAGE_BYTES
from tests.helpers import SimHandle, eventually, free_port

MODELS = b'{"object":"list","data":[{"id":"odd","object":"model","max_model_len":4096}]}'
Metrics = Callable[[], tuple[int, bytes]]


class OddEngine:
    """An engine that is healthy and serves ``odd`` but answers ``/metrics`` with ``metrics``;
    ``scrapes`` counts the calls to it."""

    def __init__(self, metrics: Metrics) -> None:
        self.scrapes = 0
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, body = {"/health": (200, b""), "/v1/models": (200, MODELS)}.get(
                    self.path, (404, b"")
                )
                if self.path == "/metrics":
                    engine.scrapes += 1
                    status, body = metrics()
                self.send_response(status)
                if self.path == "/v1/models":
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        # the gateway hangs up on a page it will not read whole: no traceback for that
        self.server.handle_error = lambda request, client_address: None  # type: ignore[method-assign]
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def slow() -> tuple[int, bytes]:
    time.sleep(3)  # past the gateway's 1 s scrape timeout
    return 200, b""


CASES: dict[str, Metrics] = {
    "a 404 in plain text": lambda: (404, b"404: Not Found"),
    "HTML with a 200": lambda: (200, b"<html><body>metrics live elsewhere</body></html>"),
    "JSON": lambda: (200, b'{"requests": 3}'),
    "a page too large": lambda: (200, b"# " + b"x" * (METRICS_PAGE_BYTES + 10) + b"\n"),
    "no answer in time": slow,
}


@pytest.fixture(params=list(CASES))
def engine(request: pytest.FixtureRequest) -> Iterator[OddEngine]:
    odd = OddEngine(CASES[request.param])
    yield odd
    odd.server.shutdown()


def test_the_gateway_starts_and_stays_ready_beside_an_engine_with_odd_metrics(
    engine: OddEngine, start_gateway: Callable[..., SimHandle]
) -> None:
    gateway = start_gateway(f"--prefill={engine.url}", f"--decode={engine.url}")
    eventually(lambda: httpx.get(f"{gateway.url}/ready", timeout=5).status_code == 200, 60)
    eventually(lambda: engine.scrapes >= 4, 60)  # load syncs every 0.5 s, and at start
    assert httpx.get(f"{gateway.url}/ready", timeout=5).status_code == 200
    assert gateway.process.poll() is None
    assert gateway.log().count("its load is unknown") == 1  # told once
    assert "Traceback" not in gateway.log()
