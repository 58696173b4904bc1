"""SIGTERM as vLLM 0.33 takes it (``--shutdown-timeout``: 0 aborts what is in flight, N > 0
lets it finish for up to N seconds), so that a test, ``baton up`` or a pod's termination sees
the stop a real engine gives."""

from __future__ import annotations

import contextlib
import json
import signal
from collections.abc import Callable, Iterator

import httpx

from tests.helpers import SimHandle

# Generous: the engine's own bound is what is checked, and aiohttp's default is 60 s.
EXIT_DEADLINE_S = 30


@contextlib.contextmanager
def stream_tokens(url: str, max_tokens: int) -> Iterator[Iterator[str]]:
    """The ``data:`` lines of a streamed completion, as they come."""
    with (
        httpx.Client(timeout=300) as client,
        client.stream(
            "POST",
            f"{url}/v1/completions",
            json={"prompt": "x", "max_tokens": max_tokens, "ignore_eos": True, "stream": True},
        ) as response,
    ):
        assert response.status_code == 200
        yield (line for line in response.iter_lines() if line.startswith("data: "))


def test_sigterm_aborts_requests_in_flight_by_default(start_sim: Callable[..., SimHandle]) -> None:
    sim = start_sim()
    with stream_tokens(sim.url, 1_000_000) as lines:
        assert next(lines) != "data: [DONE]"
        sim.process.send_signal(signal.SIGTERM)
        assert sim.process.wait(timeout=EXIT_DEADLINE_S) == 0
        try:
            rest = list(lines)
        except httpx.HTTPError:  # the connection closed mid-stream
            rest = []
    assert "data: [DONE]" not in rest


def test_a_shutdown_timeout_lets_requests_in_flight_finish(
    start_sim: Callable[..., SimHandle],
) -> None:
    sim = start_sim("--shutdown-timeout", "600")
    with stream_tokens(sim.url, 300) as lines:
        first = next(lines)
        sim.process.send_signal(signal.SIGTERM)
        rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in [first, *rest[:-1]]]
    assert sum(len(chunk["choices"][0]["text"]) for chunk in chunks) == 300 * 4
    assert sim.process.wait(timeout=EXIT_DEADLINE_S) == 0
