"""Offline runs of a DP group on a virtual clock: no sockets, no sleeping.

The same scheduler, performance model and expert routing as the served engine, stepped as fast
as the host allows. Calibration tests and benchmarks use it to measure the study's figures in
simulated time (prefill throughput at high concurrency, DP imbalance in mirror/lag replays).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sim.config import EngineConfig
from sim.engine import DPGroup, VirtualClock
from sim.request import SimRequest

__all__ = ["OfflineResult", "run_closed_loop", "run_open_loop"]


@dataclass(frozen=True, slots=True)
class OfflineResult:
    seconds: float  # simulated time from the first arrival to the last finish
    requests: int
    computed_prompt_tokens: int  # prompt tokens prefilled (cache hits excluded)
    generated_tokens: int
    steps: int


def _group(config: EngineConfig) -> tuple[DPGroup, VirtualClock]:
    clock = VirtualClock()
    return DPGroup(config, clock, range(config.data_parallel_size)), clock


def _result(
    group: DPGroup, clock: VirtualClock, finished: list[SimRequest], steps: int
) -> OfflineResult:
    computed = sum(r.prompt_tokens - r.cached_tokens for r in finished)
    generated = sum(r.output_tokens for r in finished)
    return OfflineResult(clock.time, len(finished), computed, generated, steps)


def run_open_loop(
    config: EngineConfig, arrivals: Iterable[tuple[float, int | None, SimRequest]]
) -> OfflineResult:
    """Submit each request at its arrival time (to the given DP rank, or vLLM's least-loaded
    choice when None) and step until all have finished."""
    group, clock = _group(config)
    finished: list[SimRequest] = []
    group.on_finished.append(finished.append)
    pending = sorted(arrivals, key=lambda item: item[0])
    pending.reverse()
    steps = 0
    while pending or group.has_work:
        while pending and pending[-1][0] <= clock.time:
            _, rank, request = pending.pop()
            request.arrival = clock.time
            group.submit(
                request, rank if rank is not None else group.least_loaded_rank(group.ranks)
            )
        if not group.has_work:
            clock.time = pending[-1][0]
            continue
        clock.time += group.begin_step(clock.time)
        group.end_step(clock.time)
        steps += 1
    return _result(group, clock, finished, steps)


def run_closed_loop(
    config: EngineConfig, next_request: Callable[[int], SimRequest | None], concurrency: int
) -> OfflineResult:
    """Keep ``concurrency`` requests in flight; ``next_request(i)`` gives the i-th, or None to
    stop. Every request goes to vLLM's least-loaded rank."""
    group, clock = _group(config)
    finished: list[SimRequest] = []
    group.on_finished.append(finished.append)
    issued = 0
    in_flight: list[int] = []
    steps = 0

    def issue() -> bool:
        nonlocal issued
        request = next_request(issued)
        if request is None:
            return False
        issued += 1
        request.arrival = clock.time
        group.submit(request, group.least_loaded_rank(group.ranks))
        heapq.heappush(in_flight, issued)
        return True

    while len(in_flight) < concurrency and issue():
        pass
    while group.has_work:
        clock.time += group.begin_step(clock.time)
        done_before = len(finished)
        group.end_step(clock.time)
        steps += 1
        for _ in range(len(finished) - done_before):
            heapq.heappop(in_flight)
            issue()
    return _result(group, clock, finished, steps)
