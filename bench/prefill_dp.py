"""``baton bench prefill-dp``: what DP imbalance costs a DEP prefill instance (the study's way).

The DeepSeek-V4-on-GB300 study replayed identical requests on every DP rank of a prefill
instance, once all ranks at the same time ("mirror") and once with rank r starting r x 5 s later
("lag"): wide-EP ranks step in lockstep, so in each step the busiest rank sets the pace and the
others wait. It measured DEP2 138.7K tokens/s mirrored against 130.5K lagged (-5.9%) and DEP4
267.6K against 231.1K (-13.6%): the wider instance loses more, one reason prefill runs on DEP2.

Here one ``baton sim`` engine (``--data-parallel-size`` 2 or 4, expert parallel) takes, on each
rank (``X-data-parallel-rank``), 8 (full steps) or 2 (a light load) closed-loop lanes of
prefill-only requests (``max_tokens`` 1) walking the agentic sessions of ``bench.workload`` (the
same sessions on every rank, so mirrored ranks get identical batches). Throughput is the
engine's own count of prompt tokens computed
(``vllm:prompt_tokens_by_source_total{source="local_compute"}``), sampled as the replay runs,
over the window in which every rank of the lagged replay is busy (from the last rank's start to
the end), the same window for both replays; per GPU and in simulated seconds. With several
``--seeds`` each seed walks other sessions, and the lag cost is judged on their mean: one seed's
window of a hundred lagged steps cannot tell the simulator's model from its sample.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench.procstat import pin
from bench.workload import lane_sessions, new_messages
from rigs.processes import baton_command, free_port, stop_process, wait_healthy

__all__ = ["add_arguments", "counter_at", "direction", "run", "window_rate"]

LAG_S = 5.0  # the study's lag between consecutive ranks
LANES = 8  # closed-loop lanes per rank: enough to keep a rank's 8,192-token steps full
LANES_SWEEP = (2, LANES)  # and a light load, where a rank's step is not always full
STUDY = {2: (138.7e3, 130.5e3), 4: (267.6e3, 231.1e3)}  # DEP width -> (mirror, lag) tokens/s
SEED = 2026


@dataclass(frozen=True, slots=True)
class Replay:
    ranks: int
    mode: str  # mirror | lag
    lanes: int  # per rank
    duration_s: float  # simulated seconds each rank runs
    time_scale: float
    seed: int


async def _lane(
    http: aiohttp.ClientSession,
    url: str,
    rank: int,
    lane: int,
    replay: Replay,
    begin: float,
    stop: float,
) -> None:
    await asyncio.sleep(max(0.0, begin - time.perf_counter()))
    for session in lane_sessions(replay.seed, lane):
        chat: list[dict[str, str]] = []
        for turn in range(len(session.turns)):
            if time.perf_counter() >= stop:
                return
            chat += new_messages(session, turn)
            body = {"model": "dsv4", "messages": chat, "max_tokens": 1}
            async with http.post(
                f"{url}/v1/chat/completions",
                data=orjson.dumps(body),
                headers={"Content-Type": "application/json", "X-data-parallel-rank": str(rank)},
            ) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"rank {rank}: HTTP {response.status}")


async def _counters(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Prompt tokens the engine computed, and its steps and late steps (did it keep time?)."""
    async with http.get(f"{url}/metrics") as response:
        text = await response.text()
    counters = {"computed": 0.0, "steps": 0.0, "late_steps": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:prompt_tokens_by_source_total":
                if sample.labels.get("source") == "local_compute":
                    counters["computed"] += sample.value
            elif sample.name == "baton:sim_steps_total":
                counters["steps"] = sample.value
            elif sample.name == "baton:sim_late_steps_total":
                counters["late_steps"] = sample.value
    return counters


async def _replay(url: str, replay: Replay) -> dict[str, Any]:
    scale = replay.time_scale
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_read=120 * scale),
        connector=aiohttp.TCPConnector(limit=0),
    ) as http:
        started = time.perf_counter()
        samples: list[tuple[float, float]] = []
        offsets = [r * LAG_S if replay.mode == "lag" else 0.0 for r in range(replay.ranks)]
        lanes = [
            asyncio.create_task(
                _lane(
                    http,
                    url,
                    rank,
                    lane,
                    replay,
                    started + offsets[rank] * scale,
                    started + (offsets[rank] + replay.duration_s) * scale,
                )
            )
            for rank in range(replay.ranks)
            for lane in range(replay.lanes)
        ]
        running = asyncio.gather(*lanes)
        while not running.done():
            counters = await _counters(http, url)
            samples.append(((time.perf_counter() - started) / scale, counters["computed"]))
            await asyncio.wait({running}, timeout=0.25 * scale)
        await running
        counters = await _counters(http, url)
    # Every rank of the lagged replay is busy from the last one's start to the first one's end.
    window = ((replay.ranks - 1) * LAG_S, replay.duration_s)
    return {
        "samples": samples,
        "window_s": window,
        "steps": counters["steps"],
        "late_steps": counters["late_steps"],
        **window_rate(samples, window, replay.ranks),
    }


def counter_at(samples: list[tuple[float, float]], t: float) -> float:
    """The counter at simulated time ``t``, interpolated between samples."""
    for (t0, v0), (t1, v1) in itertools.pairwise(samples):
        if t0 <= t <= t1:
            return v0 + (v1 - v0) * ((t - t0) / (t1 - t0) if t1 > t0 else 0.0)
    return samples[-1][1] if t > samples[-1][0] else samples[0][1]


def window_rate(
    samples: list[tuple[float, float]], window: tuple[float, float], gpus: int
) -> dict[str, float]:
    begin, end = window
    per_s = (counter_at(samples, end) - counter_at(samples, begin)) / (end - begin)
    return {"computed_tokens_per_s": per_s, "computed_tokens_per_s_per_gpu": per_s / gpus}


def _engine(ranks: int, time_scale: float, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = baton_command(
        "sim",
        "--port",
        str(port),
        "--served-model-name",
        "dsv4",
        "--data-parallel-size",
        str(ranks),
        "--enable-expert-parallel",
        "--time-scale",
        str(time_scale),
        "--log-level",
        "warning",
    )
    handle = log.open("ab")
    process = subprocess.Popen(command, stdout=handle, stderr=handle)
    pin(process.pid, 0)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process, timeout=60)
    return process, url


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prefill-dp")
    group.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[SEED],
        help=f"workload seeds, each replayed on every instance and load (default: {SEED})",
    )


def _replay_on_fresh_engine(replay: Replay, logs: Path) -> dict[str, Any]:
    """A fresh engine per replay: empty prefix caches, and its ranks in step again."""
    name = f"dep{replay.ranks}-{replay.mode}-{replay.lanes}-{replay.seed}.log"
    process, url = _engine(replay.ranks, replay.time_scale, logs / name)
    try:
        return asyncio.run(_replay(url, replay))
    finally:
        stop_process(process)


def run(quick: bool = False, args: argparse.Namespace | None = None) -> dict[str, object]:
    duration, scale = (20.0, 4.0) if quick else (25.0, 4.0)  # the lag window needs > 15 s
    seeds: list[int] = [SEED] if args is None else args.seeds
    rows = []
    with tempfile.TemporaryDirectory(prefix="baton-bench-prefill-dp-") as tmp:
        for lanes in (LANES,) if quick else LANES_SWEEP:
            for ranks in (2, 4):
                by_seed = {
                    seed: {
                        mode: _replay_on_fresh_engine(
                            Replay(ranks, mode, lanes, duration, scale, seed), Path(tmp)
                        )
                        for mode in ("mirror", "lag")
                    }
                    for seed in seeds
                }
                rows.append(_row(ranks, lanes, by_seed))
    print(
        "| instance | lanes per rank | mirror tokens/s (per GPU) | lag tokens/s (per GPU) "
        "| lag cost, mean (per seed) | study | late steps |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        gpus = row["dep"]
        per_seed = ", ".join(f"{cost:.1%}" for cost in row["lag_cost_by_seed"].values())
        print(
            f"| DEP{gpus} | {row['lanes_per_rank']} | {row['mirror_tokens_per_s']:,.0f} "
            f"({row['mirror_tokens_per_s'] / gpus:,.0f}) | {row['lag_tokens_per_s']:,.0f} "
            f"({row['lag_tokens_per_s'] / gpus:,.0f}) | {row['lag_cost']:.1%} ({per_seed}) "
            f"| {row['study_lag_cost']:.1%} | {row['late_steps']:.1%} |"
        )
    return {
        "benchmark": "prefill-dp",
        "duration_s": duration,
        "time_scale": scale,
        "seeds": seeds,
        "rows": rows,
        **direction(rows),
    }


def direction(rows: list[dict[str, Any]]) -> dict[str, object]:
    """Whether the wider instance loses more to the lag (the study's direction) at every load.

    Judged on the mean lag cost over seeds; beside it, at each load, how many seeds alone show it.
    """
    by = {(row["dep"], row["lanes_per_rank"]): row for row in rows}
    loads = sorted({lanes for (dep, lanes) in by if dep == 4 and (2, lanes) in by})
    return {
        "direction_reproduced": all(by[4, n]["lag_cost"] > by[2, n]["lag_cost"] for n in loads),
        "seeds_reproducing_direction": {
            str(n): sum(
                cost > by[2, n]["lag_cost_by_seed"][seed]
                for seed, cost in by[4, n]["lag_cost_by_seed"].items()
            )
            for n in loads
        },
    }


def _lag_costs(by_seed: dict[int, dict[str, dict[str, Any]]]) -> dict[int, float]:
    """Each seed's throughput lost to the lag: 1 - lagged / mirrored tokens computed per second."""
    return {
        seed: 1
        - figures["lag"]["computed_tokens_per_s"] / figures["mirror"]["computed_tokens_per_s"]
        for seed, figures in by_seed.items()
    }


def _row(ranks: int, lanes: int, by_seed: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    mirror = statistics.mean(f["mirror"]["computed_tokens_per_s"] for f in by_seed.values())
    lag = statistics.mean(f["lag"]["computed_tokens_per_s"] for f in by_seed.values())
    costs = _lag_costs(by_seed)
    study_mirror, study_lag = STUDY[ranks]
    replays = [replay for figures in by_seed.values() for replay in figures.values()]
    steps = sum(replay["steps"] for replay in replays)
    return {
        "dep": ranks,
        "lanes_per_rank": lanes,
        "mirror_tokens_per_s": mirror,
        "lag_tokens_per_s": lag,
        "lag_cost": statistics.mean(costs.values()),
        "lag_cost_by_seed": costs,
        "study_lag_cost": 1 - study_lag / study_mirror,
        "late_steps": sum(replay["late_steps"] for replay in replays) / steps if steps else 0.0,
        "window_s": next(iter(by_seed.values()))["lag"]["window_s"],
        "replays": {str(seed): figures for seed, figures in by_seed.items()},
    }
