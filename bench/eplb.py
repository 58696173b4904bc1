"""EPLB: balance recovered, experts moved, decision time and the two-phase round trip.

1. Balance over ``STEPS`` decode steps with drift, on the simulator's calibrated routing
   (``sim.experts``: DEP32, 72 requests per GPU, 6 tokens per request; the draft averaged over
   seeds because its single layer is noisy), measured per step as vLLM logs it:

   - no EPLB (vLLM's contiguous placement) and uniform routing: the two ends of the gap;
   - the study's cadence: from scratch every 3,000 steps from the last 1,000, switching at once
     (vLLM's in-engine EPLB);
   - the service: ``eplb.decide`` every 500 steps from the last 500, experts kept
     where they are within a 0.005 balance tolerance, skipping predicted gains under 0.002, the
     switch landing 150 steps after the boundary (100 steps of report batching + the 50-step
     commit margin);
   - the same cadence rebuilt from scratch, to compare moves and balance;

   each with 32 and with 0 redundant experts; the share of the gap to uniform recovered.
2. Experts moved per rebalance with and without ``previous`` (and bytes at 22 MB per expert).
3. Decision time (``decide``: algorithm and prediction) for 43 layers x 384 experts x 32 ranks.
4. Prepare -> Commit round trip at DEP32 on loopback: real gRPC against a ``baton sim`` with a
   32-rank group, the placement a real decision would send.

A plot of balance over steps with and without EPLB goes to ``bench/results/eplb_balance.png``.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from baton.core.eplb_wire import decode_placement, encode_placement
from baton.core.experts import Placement, balance, balance_per_step, moves
from baton.core.model import DRAFT, TARGET, MoEModel
from eplb.algorithm import rebalance
from eplb.client import AgentClient
from eplb.decide import Outcome, Policy, decide
from eplb.window import Window
from rigs.processes import free_port, stop_process, wait_healthy
from sim.experts import (
    DEP32_DECODE_TOKENS_PER_STEP,
    DRAFT_SKEW,
    TARGET_SKEW,
    UNIFORM_ROUTING,
    ExpertPopularity,
    RoutingSkew,
    sample_load,
)

__all__ = ["run"]

STEPS = 9_000
NUM_RANKS = 32
EXPERT_BYTES = 2.2e7
STUDY = Policy(window_size=1000, step_interval=3000, min_gain=0.0, keep_previous=False)
SERVICE = Policy(window_size=500, step_interval=500)
SERVICE_SCRATCH = Policy(window_size=500, step_interval=500, min_gain=0.0, keep_previous=False)
SERVICE_DELAY = 150  # report batching (100 steps) + apply margin (50 steps)
_BLOCK = 10  # steps sampled at once; popularity drifts once per block
_RESULTS = Path("bench/results")


@dataclass(frozen=True, slots=True)
class Run:
    """One simulated run: mean per-step balance, its series per block, and the rebalances."""

    balance: float
    series: np.ndarray
    moved: tuple[int, ...]
    skipped: int


def _simulate(
    model: MoEModel,
    skew: RoutingSkew,
    *,
    steps: int,
    seed: int,
    policy: Policy | None,
    num_redundant: int,
    delay: int,
) -> Run:
    """Per-step balance under ``policy`` (None: contiguous placement, no EPLB).

    The run starts in steady state: one window is recorded first and the placement is built
    from scratch from it at step 0; then at every boundary ``decide`` runs on the window just
    before it, and a rebalance takes effect ``delay`` steps later.
    """
    drift_rng, routing_rng = np.random.default_rng(seed).spawn(2)
    popularity = ExpertPopularity(model, skew, drift_rng)
    tokens = DEP32_DECODE_TOKENS_PER_STEP
    if policy is None:
        placement = Placement.contiguous(model.layers, model.experts, NUM_RANKS)
    else:
        warm = sample_load(
            popularity.probabilities(), tokens, model.top_k, routing_rng, steps=policy.window_size
        ).sum(axis=0)
        popularity.advance(policy.window_size)
        placement = rebalance(warm, NUM_RANKS, num_redundant)
    window = np.zeros((model.layers, model.experts), dtype=np.int64)
    pending: tuple[int, Placement] | None = None
    series, moved, skipped = [], [], 0
    for step in range(0, steps, _BLOCK):
        if pending is not None and step >= pending[0]:
            placement, pending = pending[1], None
        loads = sample_load(
            popularity.probabilities(), tokens, model.top_k, routing_rng, steps=_BLOCK
        )
        series.append(float(balance_per_step(loads, placement).mean()))
        popularity.advance(_BLOCK)
        if policy is None:
            continue
        end = step + _BLOCK
        boundary = ((end - 1) // policy.step_interval + 1) * policy.step_interval
        if end > boundary - policy.window_size:
            window += loads.sum(axis=0)
        if end % policy.step_interval == 0:
            span = Window(end - policy.window_size, end, policy.window_size, window.copy(), 0.0)
            decision = decide(span, placement, policy, end)
            window[:] = 0
            if decision.outcome is Outcome.REBALANCE:
                moved.append(decision.moved_experts)
                if delay:
                    pending = (end + delay, decision.placement)
                else:
                    placement = decision.placement
            else:
                skipped += 1
    return Run(float(np.mean(series)), np.array(series), tuple(moved), skipped)


def _balance_rows(steps: int, draft_seeds: int) -> tuple[dict, dict]:
    """Balance of every configuration for both models, and the series to plot."""
    rows: dict[str, dict] = {}
    series: dict[str, dict[str, np.ndarray]] = {}
    models = (
        ("target", TARGET, TARGET_SKEW, range(1)),
        ("draft", DRAFT, DRAFT_SKEW, range(draft_seeds)),
    )
    configurations = {
        "no_eplb": (None, 0, 0),
        "study_32": (STUDY, 32, 0),
        "study_0": (STUDY, 0, 0),
        "service_32": (SERVICE, 32, SERVICE_DELAY),
        "service_0": (SERVICE, 0, SERVICE_DELAY),
        "service_cadence_from_scratch_32": (SERVICE_SCRATCH, 32, SERVICE_DELAY),
    }
    for name, model, skew, seeds in models:
        uniform = [
            _simulate(
                model,
                UNIFORM_ROUTING,
                steps=min(steps, 2000),
                seed=s,
                policy=None,
                num_redundant=0,
                delay=0,
            ).balance
            for s in seeds
        ]
        result: dict[str, object] = {"uniform": float(np.mean(uniform))}
        series[name] = {}
        for label, (policy, redundant, delay) in configurations.items():
            started = time.perf_counter()
            runs = [
                _simulate(
                    model,
                    skew,
                    steps=steps,
                    seed=s,
                    policy=policy,
                    num_redundant=redundant,
                    delay=delay,
                )
                for s in seeds
            ]
            moved = [m for r in runs for m in r.moved]
            result[label] = {
                "balance": float(np.mean([r.balance for r in runs])),
                "rebalances_per_run": float(np.mean([len(r.moved) for r in runs])),
                "skipped_per_run": float(np.mean([r.skipped for r in runs])),
                "experts_moved_per_rebalance": float(np.mean(moved)) if moved else 0.0,
                "seconds": time.perf_counter() - started,
            }
            series[name][label] = runs[0].series
        none, ceiling = result["no_eplb"]["balance"], result["uniform"]  # type: ignore[index]
        for label in configurations:
            if label != "no_eplb":
                entry = result[label]
                entry["gap_recovered"] = (entry["balance"] - none) / (ceiling - none)  # type: ignore[index]
        rows[name] = result
    return rows, series


def _moves_and_time(repeats: int) -> dict[str, float]:
    """Moves with and without ``previous`` on drifted DEP32 target load; decision time."""
    rng = np.random.default_rng(7)
    popularity = ExpertPopularity(TARGET, TARGET_SKEW, rng)
    tokens = DEP32_DECODE_TOKENS_PER_STEP

    def window_load() -> np.ndarray:
        return sample_load(
            popularity.probabilities(), tokens, TARGET.top_k, rng, steps=SERVICE.window_size
        ).sum(axis=0)

    current = rebalance(window_load(), NUM_RANKS, 32)
    kept_moves, fresh_moves, balance_loss, decide_s, algorithm_s = [], [], [], [], []
    for index in range(repeats):
        popularity.advance(SERVICE.step_interval)
        load = window_load()
        span = Window(0, SERVICE.window_size, SERVICE.window_size, load, 0.0)
        started = time.perf_counter()
        decide(span, current, SERVICE, SERVICE.step_interval * (index + 1))
        decide_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        kept = rebalance(load, NUM_RANKS, 32, previous=current)
        algorithm_s.append(time.perf_counter() - started)
        fresh = rebalance(load, NUM_RANKS, 32)
        kept_moves.append(moves(current, kept))
        fresh_moves.append(moves(current, fresh))
        balance_loss.append(balance(load, fresh) - balance(load, kept))
        current = kept
    return {
        "experts_moved_with_previous": float(np.mean(kept_moves)),
        "experts_moved_from_scratch": float(np.mean(fresh_moves)),
        "moved_share": float(np.sum(kept_moves) / np.sum(fresh_moves)),
        "bytes_moved_with_previous": float(np.mean(kept_moves)) * EXPERT_BYTES,
        "bytes_moved_from_scratch": float(np.mean(fresh_moves)) * EXPERT_BYTES,
        "max_window_balance_given_up": float(np.max(balance_loss)),
        "algorithm_ms_median": statistics.median(algorithm_s) * 1e3,
        "algorithm_ms_max": max(algorithm_s) * 1e3,
        "decision_ms_median": statistics.median(decide_s) * 1e3,
        "decision_ms_max": max(decide_s) * 1e3,
    }


async def _round_trips(agent: str, count: int) -> list[float]:
    client = AgentClient(agent)
    try:
        state = await client.get_placement(5.0)
        current = {p.model: p for p in state.placements}["target"]
        # Switches from the engine's initial placement: staging copies more than a steady-state
        # switch would, so the round trip is an upper bound.
        base = decode_placement(current, NUM_RANKS, TARGET.experts)
        rng = np.random.default_rng(3)
        popularity = ExpertPopularity(TARGET, TARGET_SKEW, rng)
        seconds = []
        for index in range(count):
            popularity.advance(500)
            new_load = sample_load(
                popularity.probabilities(), DEP32_DECODE_TOKENS_PER_STEP, 6, rng, steps=500
            ).sum(axis=0)
            target = rebalance(new_load, NUM_RANKS, 32, previous=base)
            switch = f"bench-{index}"
            message = encode_placement("target", target, current.version + 1)
            started = time.perf_counter()
            prepared = await client.prepare(switch, [message], 10.0)
            await client.commit(switch, prepared.current_step + 50, 2.0)
            seconds.append(time.perf_counter() - started)
            # The idle engine never reaches the step: drop the switch so the next one can stage.
            await client.abort(switch, "benchmark", 2.0)
        return seconds
    finally:
        await client.close()


def _round_trip(count: int) -> dict[str, float]:
    port, agent_port = free_port(), free_port()
    command = [
        sys.executable,
        "-m",
        "baton.cli",
        "sim",
        "--port",
        str(port),
        "--data-parallel-size",
        "32",
        "--enable-expert-parallel",
        "--enable-eplb",
        "--eplb-config",
        '{"num_redundant_experts": 32}',
        "--eplb-agent-port",
        str(agent_port),
        "--speculative-config",
        '{"method": "mtp", "num_speculative_tokens": 3}',
        "--log-level",
        "warning",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process)
        seconds = asyncio.run(_round_trips(f"127.0.0.1:{agent_port}", count))
    finally:
        stop_process(process)
    ordered = sorted(seconds)
    return {
        "count": count,
        "median_ms": statistics.median(seconds) * 1e3,
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
        "max_ms": ordered[-1] * 1e3,
    }


def _plot(series: dict[str, dict[str, np.ndarray]], rows: dict, steps: int) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    labels = {
        "no_eplb": "no EPLB (contiguous)",
        "study_32": "from scratch every 3000 from last 1000",
        "service_32": "service: every 500 from last 500, minimal moves",
    }
    for axis, name in zip(axes, ("target", "draft"), strict=True):
        for key, label in labels.items():
            # A 100-step moving average shows the trend under the per-step sampling noise.
            smooth = np.convolve(series[name][key], np.ones(10) / 10, mode="valid")
            x = (np.arange(len(smooth)) + 5) * _BLOCK
            axis.plot(x, smooth, label=label, linewidth=1)
        axis.axhline(rows[name]["uniform"], color="grey", linestyle="--", label="uniform routing")
        axis.set_title(f"{name} (DEP32, 32 redundant experts)")
        axis.set_xlabel("decode step")
        axis.set_xlim(0, steps)
    axes[0].set_ylabel("balance (mean / max rank load, per step)")
    axes[0].legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    _RESULTS.mkdir(parents=True, exist_ok=True)
    path = _RESULTS / "eplb_balance.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return str(path)


def _print(result: dict) -> None:
    print(f"EPLB balance over {result['steps']} steps (per-step, vLLM's measure)")
    print(f"{'configuration':<34}{'target':>9}{'recov.':>8}{'draft':>9}{'recov.':>8}{'moved':>8}")
    for name, label in (
        ("no_eplb", "no EPLB"),
        ("study_32", "study cadence, 32 redundant"),
        ("study_0", "study cadence, 0 redundant"),
        ("service_32", "service, 32 redundant"),
        ("service_0", "service, 0 redundant"),
        ("service_cadence_from_scratch_32", "service cadence from scratch, 32"),
    ):
        target, draft = result["balance"]["target"][name], result["balance"]["draft"][name]
        recovered = (
            (f"{target['gap_recovered']:>8.1%}", f"{draft['gap_recovered']:>8.1%}")
            if "gap_recovered" in target
            else ("", "")
        )
        print(
            f"{label:<34}{target['balance']:>9.4f}{recovered[0]:>8}{draft['balance']:>9.4f}"
            f"{recovered[1]:>8}{target['experts_moved_per_rebalance']:>8.0f}"
        )
    print(
        f"{'uniform routing':<34}{result['balance']['target']['uniform']:>9.4f}{'':>8}"
        f"{result['balance']['draft']['uniform']:>9.4f}"
    )
    moves_ = result["moves_and_time"]
    print(
        f"moves per rebalance (target): {moves_['experts_moved_with_previous']:.0f} with previous"
        f" vs {moves_['experts_moved_from_scratch']:.0f} from scratch "
        f"({moves_['moved_share']:.1%}), window balance given up at most "
        f"{moves_['max_window_balance_given_up']:.4f}"
    )
    print(
        f"algorithm {moves_['algorithm_ms_median']:.1f} ms median ({moves_['algorithm_ms_max']:.1f}"
        f" max), decision {moves_['decision_ms_median']:.1f} ms median"
    )
    trip = result["round_trip"]
    print(
        f"Prepare -> Commit round trip at DEP32 (loopback): {trip['median_ms']:.1f} ms median, "
        f"{trip['p90_ms']:.1f} ms p90"
    )


def run(quick: bool = False) -> dict:
    steps = 3000 if quick else STEPS
    rows, series = _balance_rows(steps, draft_seeds=2 if quick else 8)
    result = {
        "steps": steps,
        "balance": rows,
        "moves_and_time": _moves_and_time(3 if quick else 12),
        "round_trip": _round_trip(5 if quick else 30),
    }
    result["plot"] = _plot(series, rows, steps)
    _print(result)
    return result
