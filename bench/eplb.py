"""EPLB: balance recovered, what switches cost, decision time and the two-phase round trip.

1. Balance over ``STEPS`` decode steps with drift, on the simulator's calibrated routing
   (``sim.experts``: DEP32, 72 requests per GPU, 6 tokens per request; the draft averaged over
   seeds because its single layer is noisy), measured per step as vLLM logs it:

   - no EPLB (vLLM's contiguous placement) and uniform routing: the two ends of the gap;
   - vLLM's in-engine EPLB, as the simulator runs it (``--enable-eplb``): its default policy
     (``baton.core.vllm_eplb``) every 3,000 steps from the last 1,000, the new placement in
     force once its layers are copied (one per step: 43 steps for the target model);
   - Baton's EPLB service: ``eplb.decide`` every 500 steps from the last 500, experts kept where
     they are within a 0.005 balance tolerance, skipping predicted gains under 0.002, the switch
     landing ``SERVICE_DELAY`` steps after the boundary (report batching, staging one layer per
     step, the commit margin);
   - vLLM's policy at the service's cadence: what minimal moves buy at equal cadence;
   - Baton's vLLM plugin (plugin mode, how Baton runs with vLLM engines): vLLM's in-engine
     switch, the placement from the plugin's own code (``eplb.vllm_plugin.rebalance_window``:
     Baton's algorithm, experts kept where they are), at the study's cadence and at 500 / 500;

   each with 32 and with 0 redundant experts; the share of the gap to uniform recovered. The
   draft is the study's DSpark draft, which vLLM 0.33 leaves out of its in-engine EPLB
   (``baton.core.model.draft_balanced_in_engine``): in every configuration vLLM runs (its
   policy in-engine, Baton's plugin) it keeps its plain layout; Baton's service balances it.
   Every switch costs its copies (``baton.core.perf.switch_copy_seconds``: per layer, the most
   experts a rank receives over its NVLink), carried by the decode steps it overlaps; the mean
   decode step (``baton.core.perf.step_seconds`` at 72 requests per GPU, 6 tokens each, 128K
   context, from the target and draft balance of every 100 steps, plus the copies) turns balance
   and copies into throughput.
2. Experts moved and copy time per switch, Baton's algorithm against vLLM's policy, both with
   the placement in force as ``previous``.
3. Decision time (``decide``: algorithm and prediction) for 43 layers x 384 experts x 32 ranks.
4. Prepare -> Commit round trip at DEP32 on loopback: real gRPC against a ``baton sim`` with a
   32-rank group, the placement a real decision would send.

A plot of balance over steps with and without EPLB goes to ``docs/figures/eplb_balance.png``
(``bench/results/`` for a quick run).
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from baton.core.eplb_wire import decode_placement, encode_placement
from baton.core.experts import Placement, balance, moves
from baton.core.model import (
    DRAFT,
    EXPERT_BYTES,
    SPECULATIVE_METHOD,
    TARGET,
    MoEModel,
    draft_balanced_in_engine,
)
from baton.core.perf import RankBatch, step_seconds, switch_copy_seconds
from baton.core.profile import load_profile
from baton.core.vllm_eplb import vllm_rebalance
from eplb.algorithm import rebalance
from eplb.client import AgentClient
from eplb.decide import Outcome, Policy, decide
from eplb.vllm_plugin import rebalance_window
from eplb.window import Window
from rigs.processes import baton_command, free_port, stop_process, wait_healthy
from sim.experts import (
    DEP32_DECODE_TOKENS_PER_STEP,
    DRAFT_SKEW,
    TARGET_SKEW,
    UNIFORM_ROUTING,
    BalanceRun,
    EplbSchedule,
    ExpertPopularity,
    Rebalancer,
    RoutingSkew,
    sample_load,
    simulate_balance,
)

__all__ = ["run"]

STEPS = 9_000
NUM_RANKS = 32
PROFILE = load_profile()
SERVICE = Policy(window_size=500, step_interval=500)
# Report batching (100 steps) + staging, one layer per step + the commit margin (50 steps).
SERVICE_DELAY = 100 + TARGET.layers + 50
# The decode step the costs are weighed against: 72 requests per GPU, 1 + 5 tokens each.
_BATCH = RankBatch(72, 72 * 6, 72 * 6 * 128 * 1024)
_RESULTS = Path("bench/results")
_FIGURES = Path(__file__).resolve().parents[1] / "docs" / "figures"


def _service(load: np.ndarray, current: Placement, boundary: int) -> Placement | None:
    """Baton's EPLB service: ``eplb.decide`` on the window, kept when the gain is too small."""
    window = Window(boundary - SERVICE.window_size, boundary, SERVICE.window_size, load, 0.0)
    decision = decide(window, current, SERVICE, boundary)
    return decision.placement if decision.outcome is Outcome.REBALANCE else None


def _plugin(load: np.ndarray, current: Placement, boundary: int) -> Placement:
    """Baton's plugin in a vLLM engine: its placement at every boundary vLLM calls it."""
    experts = current.num_logical_experts
    slots = current.phy2log.shape[1]

    def vllm_default() -> np.ndarray:
        return vllm_rebalance(load, NUM_RANKS, slots - experts, previous=current).phy2log

    placed = rebalance_window(load, slots, 1, 1, NUM_RANKS, current.phy2log, vllm_default)
    return Placement(placed.phy2log, NUM_RANKS, experts)


@dataclass(frozen=True, slots=True)
class Configuration:
    schedule: EplbSchedule | None  # None: no EPLB
    rebalancer: Rebalancer | None = None  # None: vLLM's in-engine policy
    # vLLM's own EPLB runs it (in-engine or Baton's plugin): the draft is balanced only where
    # vLLM registers it (draft_balanced_in_engine); Baton's service balances any model
    in_engine: bool = False


def _in_engine(redundant: int) -> EplbSchedule:
    return EplbSchedule(step_interval=3000, window_size=1000, num_redundant_experts=redundant)


def _service_cadence(redundant: int) -> EplbSchedule:
    return EplbSchedule(
        step_interval=SERVICE.step_interval,
        window_size=SERVICE.window_size,
        num_redundant_experts=redundant,
        switch_delay=SERVICE_DELAY,
    )


CONFIGURATIONS = {
    "no_eplb": Configuration(None),
    "vllm_32": Configuration(_in_engine(32), in_engine=True),
    "vllm_0": Configuration(_in_engine(0), in_engine=True),
    "service_32": Configuration(_service_cadence(32), _service),
    "service_0": Configuration(_service_cadence(0), _service),
    "vllm_policy_at_service_cadence_32": Configuration(_service_cadence(32)),
    "plugin_32": Configuration(_in_engine(32), _plugin, in_engine=True),
    "plugin_32_at_500": Configuration(
        EplbSchedule(step_interval=500, window_size=500, num_redundant_experts=32),
        _plugin,
        in_engine=True,
    ),
}
# The study's draft as vLLM 0.33 serves it: DSpark, whose V4.1 draft vLLM does not balance.
DRAFT_BALANCED_IN_ENGINE = draft_balanced_in_engine(SPECULATIVE_METHOD, DRAFT, TARGET)


def _simulate(
    model: MoEModel, skew: RoutingSkew, *, steps: int, seed: int, configuration: Configuration
) -> BalanceRun:
    return simulate_balance(
        model,
        skew,
        steps=steps,
        tokens_per_step=DEP32_DECODE_TOKENS_PER_STEP,
        seed=seed,
        num_ranks=NUM_RANKS,
        eplb=configuration.schedule,
        rebalancer=configuration.rebalancer,
    )


def _copy_seconds(run: BalanceRun) -> list[float]:
    """Each switch's copies, every layer's, end to end."""
    return [float(switch_copy_seconds(PROFILE, old, new).sum()) for old, new in run.switches]


def _mean_step_ms(target: BalanceRun, draft: BalanceRun, steps: int) -> float:
    """The mean decode step at the bench's shape, from both models' balance and the copies.
    Step time is linear in 1 / balance, so 100-step means of balance give it to well within
    the sampling noise."""
    spans = steps // 100
    moe = [
        step_seconds(
            PROFILE,
            [_BATCH] * NUM_RANKS,
            num_speculative_tokens=5,
            target_balance=float(t.mean()),
            draft_balance=float(d.mean()),
        ).total_s
        for t, d in zip(
            np.array_split(target.series, spans), np.array_split(draft.series, spans), strict=True
        )
    ]
    copies = sum(_copy_seconds(target)) + sum(_copy_seconds(draft))
    return (float(np.mean(moe)) + copies / steps) * 1e3


def _balance_rows(
    steps: int, draft_seeds: int
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, np.ndarray]]]:
    """Balance and costs of every configuration for both models, and the series to plot."""
    rows: dict[str, dict[str, Any]] = {}
    series: dict[str, dict[str, np.ndarray]] = {}
    first_runs: dict[str, dict[str, BalanceRun]] = {}
    models = (
        ("target", TARGET, TARGET_SKEW, range(1)),
        ("draft", DRAFT, DRAFT_SKEW, range(draft_seeds)),
    )
    for name, model, skew, seeds in models:
        uniform = [
            _simulate(
                model,
                UNIFORM_ROUTING,
                steps=min(steps, 2000),
                seed=s,
                configuration=CONFIGURATIONS["no_eplb"],
            ).balance
            for s in seeds
        ]
        result: dict[str, Any] = {"uniform": float(np.mean(uniform))}
        series[name] = {}
        for label, chosen in CONFIGURATIONS.items():
            started = time.perf_counter()
            balanced = not (model is DRAFT and chosen.in_engine and not DRAFT_BALANCED_IN_ENGINE)
            configuration = chosen if balanced else CONFIGURATIONS["no_eplb"]
            runs = [
                _simulate(model, skew, steps=steps, seed=s, configuration=configuration)
                for s in seeds
            ]
            moved = [moves(old, new) for r in runs for old, new in r.switches]
            copied = [c for r in runs for c in _copy_seconds(r)]
            result[label] = {
                "balanced": balanced,
                "balance": float(np.mean([r.balance for r in runs])),
                "rebalances_per_run": float(np.mean([len(r.switches) for r in runs])),
                "skipped_per_run": float(np.mean([r.skipped for r in runs])),
                "experts_moved_per_rebalance": float(np.mean(moved)) if moved else 0.0,
                "copy_ms_per_rebalance": float(np.mean(copied)) * 1e3 if copied else 0.0,
                "seconds": time.perf_counter() - started,
            }
            series[name][label] = runs[0].series
            first_runs.setdefault(label, {})[name] = runs[0]
        none, ceiling = result["no_eplb"]["balance"], result["uniform"]
        for label in CONFIGURATIONS:
            if label != "no_eplb":
                entry = result[label]
                entry["gap_recovered"] = (entry["balance"] - none) / (ceiling - none)
        rows[name] = result
    rows["decode_step"] = {}
    for label, pair in first_runs.items():
        copies = sum(_copy_seconds(pair["target"])) + sum(_copy_seconds(pair["draft"]))
        step_ms = _mean_step_ms(pair["target"], pair["draft"], steps)
        rows["decode_step"][label] = {
            "mean_step_ms": step_ms,
            "copy_share": copies * 1e3 / (step_ms * steps),
        }
    baseline = rows["decode_step"]["no_eplb"]["mean_step_ms"]
    for entry in rows["decode_step"].values():
        entry["throughput_vs_no_eplb"] = baseline / entry["mean_step_ms"]
    return rows, series


def _moves_and_time(repeats: int) -> dict[str, float]:
    """Moves and copy time per switch on drifted DEP32 target load, Baton's algorithm against
    vLLM's policy (both from the placement in force); decision and algorithm time."""
    rng = np.random.default_rng(7)
    popularity = ExpertPopularity(TARGET, TARGET_SKEW, rng)
    tokens = DEP32_DECODE_TOKENS_PER_STEP

    def window_load() -> np.ndarray:
        load: np.ndarray = sample_load(
            popularity.probabilities(), tokens, TARGET.top_k, rng, steps=SERVICE.window_size
        ).sum(axis=0)
        return load

    current = vllm_rebalance(window_load(), NUM_RANKS, 32)
    baton_moves, vllm_moves, baton_copy, vllm_copy, balance_loss = [], [], [], [], []
    decide_s, algorithm_s, vllm_s = [], [], []
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
        started = time.perf_counter()
        theirs = vllm_rebalance(load, NUM_RANKS, 32, previous=current)
        vllm_s.append(time.perf_counter() - started)
        baton_moves.append(moves(current, kept))
        vllm_moves.append(moves(current, theirs))
        baton_copy.append(float(switch_copy_seconds(PROFILE, current, kept).sum()))
        vllm_copy.append(float(switch_copy_seconds(PROFILE, current, theirs).sum()))
        balance_loss.append(balance(load, theirs) - balance(load, kept))
        current = kept
    return {
        "experts_moved_baton": float(np.mean(baton_moves)),
        "experts_moved_vllm_policy": float(np.mean(vllm_moves)),
        "moved_share": float(np.sum(baton_moves) / np.sum(vllm_moves)),
        "slots_moved_share_vllm_policy": float(np.mean(vllm_moves)) / (TARGET.layers * 416),
        "bytes_moved_baton": float(np.mean(baton_moves)) * EXPERT_BYTES,
        "bytes_moved_vllm_policy": float(np.mean(vllm_moves)) * EXPERT_BYTES,
        "copy_ms_baton": float(np.mean(baton_copy)) * 1e3,
        "copy_ms_vllm_policy": float(np.mean(vllm_copy)) * 1e3,
        "max_window_balance_given_up": float(np.max(balance_loss)),
        "algorithm_ms_median": statistics.median(algorithm_s) * 1e3,
        "algorithm_ms_max": max(algorithm_s) * 1e3,
        "vllm_policy_ms_median": statistics.median(vllm_s) * 1e3,
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
    command = baton_command(
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
        "--eplb-agent-insecure",  # a loopback benchmark: no token to hand around
        "--speculative-config",
        '{"method": "mtp", "num_speculative_tokens": 3}',
        "--log-level",
        "warning",
    )
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


def _plot(
    series: dict[str, dict[str, np.ndarray]],
    rows: dict[str, dict[str, Any]],
    steps: int,
    directory: Path,
) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    labels = {
        "no_eplb": "no EPLB (contiguous)",
        "vllm_32": "vLLM in-engine: every 3000 from last 1000",
        "service_32": "Baton's service: every 500 from last 500, minimal moves",
    }
    for axis, name in zip(axes, ("target", "draft"), strict=True):
        for key, label in labels.items():
            # A 100-step moving average shows the trend under the per-step sampling noise.
            smooth = np.convolve(series[name][key], np.ones(100) / 100, mode="valid")
            x = np.arange(len(smooth)) + 50
            axis.plot(x, smooth, label=label, linewidth=1)
        axis.axhline(rows[name]["uniform"], color="grey", linestyle="--", label="uniform routing")
        axis.set_title(f"{name} (DEP32, 32 redundant experts)")
        axis.set_xlabel("decode step")
        axis.set_xlim(0, steps)
    axes[0].set_ylabel("balance (mean / max rank load, per step)")
    axes[0].legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "eplb_balance.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return str(path)


_LABELS = {
    "no_eplb": "no EPLB",
    "vllm_32": "vLLM in-engine, 32 redundant",
    "vllm_0": "vLLM in-engine, 0 redundant",
    "service_32": "Baton's service, 32 redundant",
    "service_0": "Baton's service, 0 redundant",
    "vllm_policy_at_service_cadence_32": "vLLM's policy, service cadence",
    "plugin_32": "Baton's plugin in vLLM, 32 red.",
    "plugin_32_at_500": "Baton's plugin, every 500/500",
}


def _print(result: dict[str, Any]) -> None:
    print(f"EPLB over {result['steps']} decode steps (balance per step, vLLM's measure)")
    print(
        f"{'configuration':<32}{'target':>8}{'recov.':>8}{'draft':>8}{'recov.':>8}"
        f"{'moved':>7}{'copy ms':>9}{'step ms':>9}{'copying':>9}{'tput':>7}"
    )
    rows = result["balance"]
    for name, label in _LABELS.items():
        target, draft = rows["target"][name], rows["draft"][name]
        step = rows["decode_step"][name]
        recovered = (
            (f"{target['gap_recovered']:>8.1%}", f"{draft['gap_recovered']:>8.1%}")
            if "gap_recovered" in target
            else ("", "")
        )
        if not draft["balanced"]:
            recovered = (recovered[0], f"{'off*':>8}")
        copy_ms = target["copy_ms_per_rebalance"] + draft["copy_ms_per_rebalance"]
        print(
            f"{label:<32}{target['balance']:>8.4f}{recovered[0]:>8}{draft['balance']:>8.4f}"
            f"{recovered[1]:>8}{target['experts_moved_per_rebalance']:>7.0f}{copy_ms:>9.2f}"
            f"{step['mean_step_ms']:>9.2f}{step['copy_share']:>9.3%}"
            f"{step['throughput_vs_no_eplb']:>7.3f}"
        )
    uniform = rows["target"]["uniform"], rows["draft"]["uniform"]
    print(f"{'uniform routing':<32}{uniform[0]:>8.4f}{'':>8}{uniform[1]:>8.4f}")
    print(
        f"* vLLM 0.33 does not balance a {SPECULATIVE_METHOD} draft whose experts are not the "
        "target's: it keeps its plain layout (Baton's service balances it through its agents)"
    )
    moves_ = result["moves_and_time"]
    print(
        f"per switch (target): Baton moves {moves_['experts_moved_baton']:.0f} experts, vLLM's "
        f"policy {moves_['experts_moved_vllm_policy']:.0f} "
        f"({moves_['slots_moved_share_vllm_policy']:.0%}"
        f" of the slots); Baton {moves_['moved_share']:.1%} of vLLM's; copies "
        f"{moves_['copy_ms_baton']:.2f} ms vs {moves_['copy_ms_vllm_policy']:.2f} ms; balance "
        f"given up at most {moves_['max_window_balance_given_up']:.4f}"
    )
    print(
        f"algorithm {moves_['algorithm_ms_median']:.1f} ms median ({moves_['algorithm_ms_max']:.1f}"
        f" max; vLLM's policy {moves_['vllm_policy_ms_median']:.1f} ms), decision "
        f"{moves_['decision_ms_median']:.1f} ms median"
    )
    trip = result["round_trip"]
    print(
        f"Prepare -> Commit round trip at DEP32 (loopback): {trip['median_ms']:.1f} ms median, "
        f"{trip['p90_ms']:.1f} ms p90"
    )


def run(quick: bool = False) -> dict[str, Any]:
    steps = 3000 if quick else STEPS
    rows, series = _balance_rows(steps, draft_seeds=2 if quick else 8)
    result = {
        "steps": steps,
        "balance": rows,
        "moves_and_time": _moves_and_time(3 if quick else 12),
        "round_trip": _round_trip(5 if quick else 30),
    }
    # a full run's plot is the docs' (docs/figures); a quick run's stays with its results
    result["plot"] = _plot(series, rows, steps, _RESULTS if quick else _FIGURES)
    _print(result)
    return result
