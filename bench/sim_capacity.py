"""The simulator's capacity on one core at time scale 1.

A ``baton sim`` process (one DP rank, ``--max-num-seqs`` large enough for every stream) is
pinned to core 0; a load generator on core 1 keeps N streams open (``max_tokens`` 256,
``ignore_eos``), counting SSE events without parsing them. For each N: tokens/s emitted, the
simulator's CPU time per emitted token (from /proc), its share of the core, and inter-token
latency measured on the wire against the model's step time.

Two runs, side by side:
- the calibrated profile: the largest N at which the simulator stays under 90% of its core and
  within 10% of the modelled step time is the number of streams it sustains in real time;
- the ``instant`` profile (steps of about 10 us): what one core can emit at most, the ceiling
  any benchmark in front of the simulator must stay well below.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import time
from typing import TypedDict

import aiohttp

from baton.core.perf import RankBatch, step_seconds
from baton.core.profile import DEFAULT_PROFILE, load_profile
from bench.procstat import cpu_seconds, pin
from rigs.processes import baton_command, free_port, stop_process, wait_healthy

__all__ = ["run"]

MAX_TOKENS = 256


class _Measured(TypedDict):
    streams: int
    seconds: float
    tokens: int
    sse_events: int
    tokens_per_s: float
    sim_cpu_us_per_token: float
    sim_core_share: float
    itl_p50_ms: float


class _Row(_Measured):
    profile: str
    modelled_step_ms: float
    sustained: bool


async def _stream(session: aiohttp.ClientSession, url: str, gaps: list[float]) -> int:
    body = {"prompt": "capacity", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    events = 0
    last = None
    async with session.post(f"{url}/v1/completions", json=body) as response:
        async for line in response.content:
            if line.startswith(b"data: {"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                events += 1
    return events


async def _load(url: str, streams: int) -> tuple[float, int, list[float]]:
    gaps: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.perf_counter()
        events = await asyncio.gather(*(_stream(session, url, gaps) for _ in range(streams)))
        return time.perf_counter() - started, sum(events), gaps


def _measure(url: str, pid: int, streams: int) -> _Measured:
    before = cpu_seconds(pid)
    elapsed, events, gaps = asyncio.run(_load(url, streams))
    cpu = cpu_seconds(pid) - before
    tokens = streams * MAX_TOKENS
    return {
        "streams": streams,
        "seconds": elapsed,
        "tokens": tokens,
        "sse_events": events,
        "tokens_per_s": tokens / elapsed,
        "sim_cpu_us_per_token": cpu / tokens * 1e6,
        "sim_core_share": cpu / elapsed,
        "itl_p50_ms": statistics.median(gaps) * 1000,
    }


def _modelled_step_ms(profile: str, streams: int) -> float:
    batch = RankBatch(streams, streams, streams * 200.0)
    return step_seconds(load_profile(profile), [batch]).total_s * 1000


def _run_profile(profile: str, counts: list[int]) -> list[_Row]:
    port = free_port()
    command = baton_command(
        "sim",
        "--port",
        str(port),
        "--profile",
        profile,
        "--max-num-seqs",
        "8192",
        "--log-level",
        "warning",
    )
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    rows: list[_Row] = []
    try:
        pin(process.pid, 0)
        pin(os.getpid(), 1)
        wait_healthy(url, process)
        for streams in counts:
            measured = _measure(url, process.pid, streams)
            modelled = _modelled_step_ms(profile, streams)
            rows.append(
                {
                    "profile": profile,
                    **measured,
                    "modelled_step_ms": modelled,
                    "sustained": (
                        measured["sim_core_share"] < 0.9
                        and measured["itl_p50_ms"] <= 1.1 * modelled
                    ),
                }
            )
    finally:
        stop_process(process)
    return rows


def run(quick: bool = False) -> dict[str, object]:
    counts = [64, 256] if quick else [64, 256, 1024, 2048, 4096]
    calibrated = DEFAULT_PROFILE.removesuffix(".yaml")
    rows = _run_profile(calibrated, counts) + _run_profile("instant", counts)
    header = (
        "profile",
        "streams",
        "tok/s",
        "CPU us/tok",
        "core",
        "ITL p50 ms",
        "step ms",
        "sustained",
    )
    print("  ".join(f"{name:>11}" for name in header))
    for row in rows:
        cells = (
            "calibrated" if row["profile"] == calibrated else row["profile"],
            f"{row['streams']}",
            f"{row['tokens_per_s']:.0f}",
            f"{row['sim_cpu_us_per_token']:.1f}",
            f"{row['sim_core_share']:.0%}",
            f"{row['itl_p50_ms']:.2f}",
            f"{row['modelled_step_ms']:.2f}",
            "yes" if row["sustained"] else "no",
        )
        print("  ".join(f"{cell:>11}" for cell in cells))
    sustained = [r["streams"] for r in rows if r["profile"] == calibrated and r["sustained"]]
    ceiling = max(r["tokens_per_s"] for r in rows if r["profile"] == "instant")
    print(
        f"sustained in real time: {max(sustained, default=0)} streams; "
        f"ceiling on one core: {ceiling:.0f} tokens/s",
        flush=True,
    )
    return {
        "benchmark": "sim",
        "time_scale": 1.0,
        "max_tokens": MAX_TOKENS,
        "rows": rows,
        "max_sustained_streams": max(sustained, default=0),
        "max_tokens_per_s_one_core": ceiling,
    }
