"""The gateway's garbage-collector tuning (``router.workers.tune_gc``): young collections rare
enough to stay cheap under load, and the reference cycles every request leaves still freed soon.

Each request leaves cycles only the cyclic collector frees (uvicorn's protocol and the events it
refers to, aiohttp's responses to health and load probes). In the chaos soak at 6 sessions a
gateway left about 3,000 such objects a minute; with young collections every 50,000 allocations
they piled up for a quarter of an hour, and the gateway's RSS climbed 0.5-0.8 MiB a minute for
as long as it lived. A ``gc.collect()`` every minute held the same gateway at a flat 83 MiB.
"""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Iterator

import pytest

from router.workers import tune_gc

# Unreachable objects waiting for a collection, at most: about 4 MiB at the 200 bytes an object
# the soak's climb implies (10 MiB over the 50,000 objects of one young generation).
BACKLOG_LIMIT = 20_000
IN_FLIGHT = 100  # requests whose cycles are still in use


class _Leftover:
    """One object of a request's cycle; counts how many exist."""

    __slots__ = ("peer",)
    existing = 0

    def __init__(self) -> None:
        type(self).existing += 1
        self.peer: _Leftover | None = None

    def __del__(self) -> None:
        type(self).existing -= 1


@pytest.fixture
def tuned() -> Iterator[None]:
    threshold = gc.get_threshold()
    gc.collect()
    tune_gc()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)
    gc.collect()


def test_request_cycles_are_collected_before_a_backlog_builds(tuned: None) -> None:
    in_flight: deque[_Leftover] = deque()
    backlog = 0
    for request in range(300_000):
        protocol, event = _Leftover(), _Leftover()
        protocol.peer, event.peer = event, protocol
        in_flight.append(protocol)
        if len(in_flight) > IN_FLIGHT:
            in_flight.popleft()  # the request is over: its cycle is garbage now
        if request % 500 == 0:
            backlog = max(backlog, _Leftover.existing - 2 * len(in_flight))
    assert backlog <= BACKLOG_LIMIT
