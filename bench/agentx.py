"""``baton bench agentx``: agentic sessions on a whole simulated rack, Baton against vllm-router.

The workload is ``bench.workload`` (AgentX-shaped, seeded). Each point of the sweep is one
router at one concurrency on a fresh ``baton up`` (one simulated GB300 NVL72 rack: a DEP32
decode group, 18 DEP2 prefill instances, the EPLB service; cold caches every time), so every
router meets the same engines and the same requests:

- ``baton``: Baton's gateway, as ``baton up`` starts it;
- ``vllm-router``: the vLLM project's router in P/D mode, ``cache_aware`` prefill and
  ``power_of_two`` decode, DP-aware (one decode target per DP rank, as Baton routes);
- ``round-robin``: vllm-router with ``round_robin`` for both.

The router under test is pinned to core 1 and the simulated engines to core 0; the EPLB
service and this load generator take what either leaves. The simulator runs ``--time-scale``
times slower than real time so that one core keeps a whole rack's timeline; every figure is in
simulated time, and the share of engine steps that ended late is reported (a point whose
simulator fell behind is marked).

Figures, each as AgentX defines it (the InferenceX aggregation code):

- throughput per GPU = (cached input + uncached input + output tokens) / duration / GPUs, with
  duration = last measured request's end - first one's start, GPUs = the prefill and decode
  engines' (the spare tray is not counted); output tokens per GPU alone; the split between
  cached and uncached input follows the engines' own count of prompt tokens computed;
- P90 per-user tokens/s = 1 / p90 of the requests' inter-token latency ((end - first token) /
  (output tokens - 1));
- TTFT p50 / p90 / p99;
- prefix reuse achieved (1 - prompt tokens the engines computed / prompt tokens sent, over every
  request of the run) against the workload's theoretical reuse;
- $/M tokens = $/GPU-hour / (throughput per GPU x 3600 / 1e6).

``--url`` runs the same workload against any OpenAI-compatible endpoint instead (real time; give
``--gpus`` for per-GPU figures; prefix reuse from the responses' ``cached_tokens``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Never

import aiohttp
import httpx
import orjson
import psutil
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from tqdm import tqdm

from bench.procstat import pin
from bench.workload import (
    SHAPE,
    Request,
    Session,
    WorkloadShape,
    lane_sessions,
    new_messages,
    requests_of,
    start_turn,
    theoretical_reuse,
)
from rigs.processes import (
    ProcessExited,
    baton_command,
    eventually,
    free_port,
    stop_process,
    wait_healthy,
)

__all__ = ["add_arguments", "run"]

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"
ROUTERS = ("baton", "vllm-router", "round-robin")
GPUS_PER_PREFILL = 2  # DEP2
GPUS_PER_DECODE_SERVER = 4  # one API server per tray
ROUTER_CORE, SIM_CORE = 1, 0
LATE_STEPS_LIMIT = 0.05  # a point whose engines ran more late steps than this did not keep time
STACK_START_S = 180  # for baton up to start a rack of engines and write its targets


@dataclass(frozen=True, slots=True)
class Settings:
    routers: tuple[str, ...]
    concurrency: tuple[int, ...]
    duration_s: float  # simulated seconds of measurement per point
    warmup_s: float  # simulated seconds before it: requests started then are not measured
    time_scale: float
    seed: int
    usd_per_gpu_hour: float
    url: str | None = None
    gpus: int | None = None
    # the EPLB comparison: Baton's gateway at one concurrency under each baton up EPLB mode
    eplb_modes: tuple[str, ...] = ()
    eplb_concurrency: int = 192
    eplb_duration_s: float = 45.0


@dataclass(slots=True)
class Record:
    """One request as the client saw it, in wall seconds from the point's start."""

    session: str
    turn: int
    warmup: bool
    start: float
    first: float | None = None
    end: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None
    # seconds between its chunks after the first, where asked for (a list to fill)
    gaps: list[float] | None = None


@dataclass(slots=True)
class _Load:
    """What the lanes of one point share."""

    url: str
    model: str
    time_scale: float
    stop_at: float  # wall time after which no lane sends a new turn
    started: float
    http: aiohttp.ClientSession
    records: list[Record] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    progress: tqdm[Never] | None = None


# ---- the load: lanes of sessions


async def _lane(load: _Load, seed: int, lane: int, shape: WorkloadShape) -> None:
    for number, session in enumerate(lane_sessions(seed, lane, shape)):
        start = start_turn(seed, lane, session) if number == 0 else 0
        if not await _session(load, session, start):
            return


async def _session(load: _Load, session: Session, start: int) -> bool:
    """Run ``session`` from turn ``start``; False once the point's time is up."""
    chat: list[dict[str, str]] = []
    if start:  # the warmup is the turn before: the conversation up to there
        for earlier in range(start):
            chat += new_messages(session, earlier)
    for request in requests_of(session, start):
        turn = session.turns[request.turn]
        if not request.warmup:
            chat += new_messages(session, request.turn)
            await asyncio.sleep(turn.think_s * load.time_scale)
        if time.perf_counter() >= load.stop_at:
            return False
        await _send(load, request, chat)
        if turn.subagents and not request.warmup:
            results = await asyncio.gather(*(_session(load, sub, 0) for sub in turn.subagents))
            if not all(results):
                return False
    return True


async def _send(load: _Load, request: Request, chat: list[dict[str, str]]) -> None:
    turn = request.session.turns[request.turn]
    body = {
        "model": load.model,
        "messages": chat,
        "max_tokens": 1 if request.warmup else turn.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    record = Record(
        request.session.name, request.turn, request.warmup, time.perf_counter() - load.started
    )
    headers = {"Content-Type": "application/json", "X-Session-ID": request.session.name}
    if request.session.parent:
        headers["X-Parent-Session-ID"] = request.session.parent
    load.records.append(record)
    load.requests.append(request)
    url = f"{load.url}/v1/chat/completions"
    answered = await stream_into(record, load.http, url, body, headers, load.started)
    if answered and load.progress is not None and not record.warmup:
        load.progress.update(1)


async def stream_into(
    record: Record,
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    started: float,
) -> bool:
    """Send a streamed chat or text completion and fill ``record`` (wall seconds since
    ``started``) from its chunks and usage, and its ``gaps`` where it has a list for them;
    whether it ended with tokens (else ``record.error`` says why)."""
    last: float | None = None
    try:
        async with http.post(url, data=orjson.dumps(body), headers=headers) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}"
                await response.read()
                return False
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                choices = chunk.get("choices") or []
                if choices and (
                    choices[0].get("text") or (choices[0].get("delta") or {}).get("content")
                ):
                    now = time.perf_counter() - started
                    if record.first is None:
                        record.first = now
                    elif record.gaps is not None and last is not None:
                        record.gaps.append(now - last)
                    last = now
                usage = chunk.get("usage")
                if usage:
                    record.prompt_tokens = usage.get("prompt_tokens") or 0
                    record.output_tokens = usage.get("completion_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_tokens = details.get("cached_tokens")
    except (aiohttp.ClientError, TimeoutError) as exc:
        record.error = type(exc).__name__
        return False
    record.end = time.perf_counter() - started
    if record.first is None or not record.output_tokens:
        record.error = "no tokens"
        return False
    return True


async def drive_sessions(
    url: str,
    model: str,
    settings: Settings,
    concurrency: int,
    label: str,
    balance_of: str | None = None,
    shape: WorkloadShape = SHAPE,
) -> tuple[list[Record], list[Request], float, list[dict[str, float]]]:
    """Run ``concurrency`` lanes of ``shape``'s sessions for the warmup and the measurement;
    drain what is in flight. With ``balance_of`` (a decode API server) the decode group's
    expert balance is sampled every simulated second: the mean of each model's steps since the
    last sample."""
    scale = settings.time_scale
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=300 * scale)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        started = time.perf_counter()
        load = _Load(
            url,
            model,
            scale,
            started + (settings.warmup_s + settings.duration_s) * scale,
            started,
            http,
        )
        load.progress = tqdm(desc=label, unit=" req", leave=False, file=sys.stderr)
        timeline: list[dict[str, float]] = []
        sampler = (
            asyncio.create_task(_sample_balance(http, balance_of, load, timeline))
            if balance_of
            else None
        )
        try:
            lanes = [
                asyncio.create_task(_lane(load, settings.seed, i, shape))
                for i in range(concurrency)
            ]
            # In flight at the end: drained, within a bound (a stuck request must not hang).
            drain_s = 120 * scale
            done, pending = await asyncio.wait(
                lanes, timeout=(settings.warmup_s + settings.duration_s) * scale + drain_s
            )
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for task in done:
                task.result()
        finally:
            load.progress.close()
            if sampler is not None:
                sampler.cancel()
                await asyncio.gather(sampler, return_exceptions=True)
    return load.records, load.requests, time.perf_counter() - started, timeline


async def _sample_balance(
    http: aiohttp.ClientSession, url: str, load: _Load, timeline: list[dict[str, float]]
) -> None:
    last: dict[str, tuple[float, float]] = {}
    while True:
        await asyncio.sleep(load.time_scale)  # one simulated second
        async with http.get(f"{url}/metrics") as response:
            text = await response.text()
        now: dict[str, list[float]] = {}
        for family in text_string_to_metric_families(text):
            if family.name != "baton:sim_expert_balance":
                continue
            for sample in family.samples:
                model = sample.labels["moe_model"]
                kind = sample.name.rsplit("_", 1)[1]  # sum or count
                now.setdefault(model, [0.0, 0.0])[kind == "count"] = sample.value
        point = {"t_s": (time.perf_counter() - load.started) / load.time_scale}
        for model, (total, steps) in now.items():
            before = last.get(model, (0.0, 0.0))
            if steps > before[1]:
                point[model] = (total - before[0]) / (steps - before[1])
            last[model] = (total, steps)
        point["steps"] = max((steps for _, steps in now.values()), default=0.0)
        timeline.append(point)


# ---- figures


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile of ``values`` (NaN for none)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def summarize(
    records: Sequence[Record],
    theoretical_reuse: float,
    *,
    time_scale: float,
    warmup_s: float,
    gpus: int | None,
    computed_prompt_tokens: float | None,
    usd_per_gpu_hour: float,
) -> dict[str, Any]:
    """One point's figures (simulated seconds) from its records, the workload's theoretical
    prefix reuse and the engines' count of prompt tokens computed (None: take the responses'
    ``cached_tokens``)."""
    measured = [
        r for r in records if not r.warmup and r.start >= warmup_s * time_scale and r.error is None
    ]
    failed = [r for r in records if r.error is not None]
    figures: dict[str, Any] = {
        "requests": len(measured),
        "errors": len(failed),
        "error_kinds": sorted({r.error for r in failed if r.error}),
    }
    sent = [r for r in records if r.end is not None and r.error is None]
    prompt_sent = sum(r.prompt_tokens for r in sent)
    figures["prefix_reuse_theoretical"] = theoretical_reuse
    if computed_prompt_tokens is not None and prompt_sent:
        figures["prefix_reuse_achieved"] = 1 - computed_prompt_tokens / prompt_sent
    else:
        reported = [r.cached_tokens for r in sent if r.cached_tokens is not None]
        figures["prefix_reuse_achieved"] = (
            sum(reported) / prompt_sent if reported and len(reported) == len(sent) else None
        )
    if not measured:
        return figures
    assert all(r.end is not None and r.first is not None for r in measured)
    duration = (max(r.end or 0.0 for r in measured) - min(r.start for r in measured)) / time_scale
    ttft = [((r.first or 0.0) - r.start) / time_scale * 1000 for r in measured]
    itl = [
        ((r.end or 0.0) - (r.first or 0.0)) / (r.output_tokens - 1) / time_scale
        for r in measured
        if r.output_tokens > 1
    ]
    prompt = sum(r.prompt_tokens for r in measured)
    output = sum(r.output_tokens for r in measured)
    reuse = figures["prefix_reuse_achieved"]
    cached = prompt * reuse if reuse is not None else math.nan
    figures |= {
        "duration_s": duration,
        "input_tokens": prompt,
        "output_tokens": output,
        "ttft_ms": {
            "p50": percentile(ttft, 50),
            "p90": percentile(ttft, 90),
            "p99": percentile(ttft, 99),
        },
        "itl_p90_ms": percentile(itl, 90) * 1000,
        "p90_tokens_per_s_per_user": 1 / percentile(itl, 90),
        "tokens_per_s": (prompt + output) / duration,
    }
    if gpus:
        per_gpu = (prompt + output) / duration / gpus
        figures |= {
            "gpus": gpus,
            "tokens_per_s_per_gpu": per_gpu,
            "cached_input_per_s_per_gpu": cached / duration / gpus,
            "uncached_input_per_s_per_gpu": (prompt - cached) / duration / gpus,
            "output_per_s_per_gpu": output / duration / gpus,
            "usd_per_million_tokens": usd_per_gpu_hour / (per_gpu * 3600 / 1e6),
        }
    return figures


def reuse_lost(
    records: Sequence[Record], requests: Sequence[Request], *, warmup_wall_s: float
) -> dict[str, float] | None:
    """Where the point computed again what the workload let it reuse, as shares of the prompt
    tokens sent, from each response's ``cached_tokens``: a subagent's first turn (the parent's
    system prompt), a turn that found less than half its history cached (a spill, or evicted
    KV) started during the warmup (``warmup_wall_s``) or after, and the rest. Only where every
    response reports the prefill engine's count, as Baton's gateway does (vllm-router passes
    on decode's, where every pulled token counts as cached): None otherwise."""
    sent = [(r, q) for r, q in zip(records, requests, strict=True) if r.end and not r.error]
    if not sent or any(r.cached_tokens is None for r, _ in sent):
        return None
    lost = dict.fromkeys(
        ("subagent_first_turn", "history_during_warmup", "history_after_warmup", "other"), 0.0
    )
    for record, request in sent:
        short = max(0, request.cached_prefix_tokens - (record.cached_tokens or 0))
        if request.turn == 0 and request.session.subagent:
            lost["subagent_first_turn"] += short
        elif short > request.cached_prefix_tokens / 2:
            phase = "during" if record.start < warmup_wall_s else "after"
            lost[f"history_{phase}_warmup"] += short
        else:
            lost["other"] += short
    total = sum(r.prompt_tokens for r, _ in sent)
    return {cause: tokens / total for cause, tokens in lost.items()}


# ---- the stack and the routers


@dataclass(frozen=True, slots=True)
class _Stack:
    process: subprocess.Popen[bytes]
    gateway: str
    prefill: tuple[str, ...]
    decode: tuple[str, ...]

    @property
    def gpus(self) -> int:
        return GPUS_PER_PREFILL * len(self.prefill) + GPUS_PER_DECODE_SERVER * len(self.decode)

    @property
    def engines(self) -> tuple[str, ...]:
        return (*self.prefill, *self.decode)


@contextmanager
def stack(
    directory: Path, time_scale: float, eplb: str, extra: Sequence[str] = ()
) -> Iterator[_Stack]:
    """A fresh ``baton up`` (one rack, ``--eplb-mode eplb``, ``extra`` flags) and where its
    engines are, from the targets file it writes for Prometheus."""
    port, targets = free_port(), directory / "targets.json"
    targets.unlink(missing_ok=True)
    log_path = directory / "baton-up.log"
    log = log_path.open("ab")
    process = subprocess.Popen(
        baton_command(
            "up",
            "--port",
            str(port),
            "--time-scale",
            str(time_scale),
            "--prometheus-targets",
            str(targets),
            "--eplb-mode",
            eplb,
            *extra,
        ),
        stdout=log,
        stderr=log,
    )
    try:

        def started() -> bool:
            if process.poll() is not None:
                raise ProcessExited(
                    f"baton up exited with {process.returncode}; {log_path} ends:\n"
                    + log_path.read_text(errors="replace")[-3000:]
                )
            return targets.exists()

        try:
            eventually(started, timeout=STACK_START_S, interval=0.5)
        except TimeoutError:
            raise TimeoutError(
                f"baton up wrote no {targets} in {STACK_START_S} s; {log_path} ends:\n"
                + log_path.read_text(errors="replace")[-3000:]
            ) from None
        groups = json.loads(targets.read_text())
        urls: dict[str, list[str]] = {"prefill": [], "decode": []}
        for group in groups:
            role = group["labels"].get("role")
            if role in urls:
                urls[role] += [f"http://{target}" for target in group["targets"]]
        for child in psutil.Process(process.pid).children(recursive=True):
            command = child.cmdline()
            if "gateway" in command:
                pin(child.pid, ROUTER_CORE)  # idle while another router is measured
            elif "sim" in command:
                pin(child.pid, SIM_CORE)
        yield _Stack(
            process, f"http://127.0.0.1:{port}", tuple(urls["prefill"]), tuple(urls["decode"])
        )
    finally:
        stop_process(process)
        log.close()


@contextmanager
def router(name: str, rack: _Stack, directory: Path) -> Iterator[str]:
    """The URL of router ``name`` in front of ``rack``'s engines."""
    if name == "baton":
        yield rack.gateway
        return
    with vllm_router(name, rack.prefill, rack.decode, directory, GPUS_PER_DECODE_SERVER) as url:
        yield url


@contextmanager
def vllm_router(
    name: str,
    prefill: Sequence[str],
    decode: Sequence[str],
    directory: Path,
    dp_size: int,
    core: int = ROUTER_CORE,
) -> Iterator[str]:
    """vllm-router in P/D mode on one core: ``cache_aware`` prefill and ``power_of_two``
    decode (``name`` vllm-router) or ``round_robin`` for both (round-robin); its URL."""
    port = free_port()
    binary = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    policies = (
        ["--prefill-policy", "cache_aware", "--decode-policy", "power_of_two"]
        if name == "vllm-router"
        else ["--policy", "round_robin"]
    )
    command = [
        binary,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--vllm-pd-disaggregation",
        *[arg for url in prefill for arg in ("--prefill", url)],
        *[arg for url in decode for arg in ("--decode", url)],
        *policies,
        "--intra-node-data-parallel-size",
        str(dp_size),
        "--api-key",
        "unused",  # vllm-router wants one for DP-aware routing; the engines check none
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "warning",
    ]
    log = (directory / f"{name}.log").open("ab")
    process = subprocess.Popen(command, stdout=log, stderr=log)
    pin(process.pid, core)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout=120)
        yield url
    finally:
        stop_process(process)
        log.close()


def engine_counters(rack: _Stack) -> dict[str, float]:
    """Prompt tokens the engines computed (every rank of every engine; ``decode_computed``, the
    decode engines' share), the decode engines' inter-token latency (``decode_itl_s`` over
    ``decode_itl_count``: their steps as the engines timed them, whatever relayed them), and
    the simulator's timeline counters of every DP group (each prefill instance is one; the
    decode group's servers each show the whole group's, so one of them is read)."""
    counted = ("computed", "decode_computed", "decode_itl_s", "decode_itl_count")
    totals = dict.fromkeys((*counted, "steps", "late_steps", "lag_s"), 0.0)
    timelines = {*rack.prefill, rack.decode[0]}
    for url in rack.engines:
        decode = url in rack.decode
        text = httpx.get(f"{url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:prompt_tokens_by_source_total":
                    if sample.labels.get("source") == "local_compute":
                        totals["computed"] += sample.value
                        if decode:
                            totals["decode_computed"] += sample.value
                elif decode and sample.name == "vllm:inter_token_latency_seconds_sum":
                    totals["decode_itl_s"] += sample.value
                elif decode and sample.name == "vllm:inter_token_latency_seconds_count":
                    totals["decode_itl_count"] += sample.value
                elif url in timelines and sample.name == "baton:sim_steps_total":
                    totals["steps"] += sample.value
                elif url in timelines and sample.name == "baton:sim_late_steps_total":
                    totals["late_steps"] += sample.value
                elif url in timelines and sample.name == "baton:sim_lag_seconds_total":
                    totals["lag_s"] += sample.value
    return totals


def _gateway_counter(
    gateway: str, sample_name: str, label: str, values: tuple[str, ...]
) -> dict[str, float]:
    """A counter of Baton's gateway summed by one label, each of ``values`` present."""
    totals = dict.fromkeys(values, 0.0)
    for sample in _gateway_samples(gateway, sample_name):
        totals[sample.labels[label]] += sample.value
    return totals


def _gateway_samples(gateway: str, sample_name: str) -> Iterator[Sample]:
    """The samples of one name Baton's gateway exports now."""
    for family in text_string_to_metric_families(httpx.get(f"{gateway}/metrics", timeout=10).text):
        yield from (sample for sample in family.samples if sample.name == sample_name)


def gateway_affinity(gateway: str) -> dict[str, float]:
    """Baton's prefill choices that followed the affinity key (hit) or spilled (miss)."""
    return _gateway_counter(gateway, "baton_gateway_affinity_total", "result", ("hit", "miss"))


def gateway_kv_events(gateway: str) -> dict[str, float]:
    """Batches of the engines' KV events Baton's gateway read, by outcome (``applied``,
    ``undecodable``): whether its prefix index heard from the engines at all."""
    return _gateway_counter(
        gateway, "baton_gateway_kv_event_batches_total", "outcome", ("applied", "undecodable")
    )


def gateway_first_tokens(gateway: str) -> float:
    """Streams whose first token Baton's gateway sent from their prefill leg."""
    samples = _gateway_samples(gateway, "baton_gateway_first_tokens_from_prefill_total")
    return sum(sample.value for sample in samples)


def gateway_not_reused(gateway: str) -> dict[str, float]:
    """Prompt tokens Baton's gateway had sent a prefill rank before and saw computed again, by
    cause (``routed_away``, ``absent``): its own record of where reuse went."""
    return _gateway_counter(
        gateway,
        "baton_gateway_prompt_tokens_not_reused_total",
        "cause",
        ("routed_away", "absent"),
    )


def served_model(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])


def _point(
    settings: Settings, name: str, concurrency: int, directory: Path, eplb: str = "agent"
) -> dict[str, Any]:
    label = f"{name} c={concurrency}" + (f" EPLB {eplb}" if eplb != "agent" else "")
    with (
        stack(directory, settings.time_scale, eplb) as rack,
        router(name, rack, directory) as url,
    ):
        records, requests, wall_s, timeline = asyncio.run(
            drive_sessions(
                url, served_model(url), settings, concurrency, label, balance_of=rack.decode[0]
            )
        )
        counters = engine_counters(rack)
        affinity = gateway_affinity(rack.gateway) if name == "baton" else None
        gpus = rack.gpus
    figures = summarize(
        records,
        theoretical_reuse(requests),
        time_scale=settings.time_scale,
        warmup_s=settings.warmup_s,
        gpus=gpus,
        computed_prompt_tokens=counters["computed"],
        usd_per_gpu_hour=settings.usd_per_gpu_hour,
    )
    late = counters["late_steps"] / counters["steps"] if counters["steps"] else 0.0
    measured = [p for p in timeline if p["t_s"] >= settings.warmup_s]
    return {
        "router": name,
        "concurrency": concurrency,
        "eplb": eplb,
        "wall_s": wall_s,
        "balance": {
            model: statistics.mean(p[model] for p in measured if model in p)
            for model in ("target", "draft")
            if any(model in p for p in measured)
        },
        "balance_timeline": timeline,
        "late_steps": late,
        # wall ms a late step ended late, on average: small against the step is harmless
        "late_step_lag_ms": counters["lag_s"] / counters["late_steps"] * 1000
        if counters["late_steps"]
        else 0.0,
        "kept_time": late <= LATE_STEPS_LIMIT,
        "affinity": affinity,
        "reuse_lost": reuse_lost(
            records, requests, warmup_wall_s=settings.warmup_s * settings.time_scale
        )
        if name == "baton"
        else None,
        **figures,
    }


def _external(settings: Settings, concurrency: int) -> dict[str, Any]:
    assert settings.url is not None
    url = settings.url.rstrip("/").removesuffix("/v1")
    records, requests, wall_s, _ = asyncio.run(
        drive_sessions(url, served_model(url), settings, concurrency, f"{url} c={concurrency}")
    )
    figures = summarize(
        records,
        theoretical_reuse(requests),
        time_scale=1.0,
        warmup_s=settings.warmup_s,
        gpus=settings.gpus,
        computed_prompt_tokens=None,
        usd_per_gpu_hour=settings.usd_per_gpu_hour,
    )
    return {"router": url, "concurrency": concurrency, "wall_s": wall_s, **figures}


def sweep(settings: Settings) -> list[dict[str, Any]]:
    """Every point: per concurrency, each router in turn (interleaved, so the machine's drift
    hits them alike)."""
    points = []
    with tempfile.TemporaryDirectory(prefix="baton-bench-agentx-") as tmp:
        for concurrency in settings.concurrency:
            if settings.url is not None:
                points.append(_external(settings, concurrency))
                continue
            for router in settings.routers:
                point = _point(settings, router, concurrency, Path(tmp))
                print(_row(point), file=sys.stderr)
                points.append(point)
    return points


def eplb_comparison(settings: Settings) -> list[dict[str, Any]]:
    """Baton's gateway at ``eplb_concurrency`` under each EPLB mode: the service (agent), the
    engines' own vLLM policy, none; long enough for vLLM's first rebalance at step 3,000."""
    longer = replace(settings, duration_s=settings.eplb_duration_s)
    points = []
    with tempfile.TemporaryDirectory(prefix="baton-bench-agentx-eplb-") as tmp:
        for mode in settings.eplb_modes:
            point = _point(longer, "baton", settings.eplb_concurrency, Path(tmp), eplb=mode)
            print(_eplb_row(point), file=sys.stderr)
            points.append(point)
    return points


def _eplb_row(point: dict[str, Any]) -> str:
    balance = point.get("balance", {})
    steps = max((p.get("steps", 0.0) for p in point.get("balance_timeline", [])), default=0.0)
    return (
        f"| {EPLB_NAMES.get(point['eplb'], point['eplb'])} "
        f"| {fmt(balance.get('target'), '.3f')} / {fmt(balance.get('draft'), '.3f')} "
        f"| {steps:,.0f} | {fmt(point.get('tokens_per_s_per_gpu'), ',.0f')} "
        f"| {fmt(point.get('output_per_s_per_gpu'), ',.0f')} "
        f"| {fmt(point.get('p90_tokens_per_s_per_user'), '.1f')} "
        f"| {point['errors']} | {fmt(point.get('late_steps', math.nan) * 100, '.1f')}% |"
    )


EPLB_NAMES = {
    "agent": "Baton's EPLB service (minimal moves, 500 / 500)",
    "vllm": "vLLM's in-engine EPLB (3,000 / 1,000)",
    "off": "no EPLB",
}
EPLB_HEADER = (
    "| EPLB | mean balance, target / draft | decode steps | tokens/s/GPU | output/s/GPU "
    "| P90 tok/s/user | errors | late steps |\n|---|---|---|---|---|---|---|---|"
)


# ---- report


def fmt(value: float | None, spec: str) -> str:
    """``value`` formatted by ``spec``; ``-`` for none or NaN."""
    return (
        "-"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else format(value, spec)
    )


def _row(point: dict[str, Any]) -> str:
    ttft = point.get("ttft_ms", {})
    reuse = point.get("prefix_reuse_achieved")
    return (
        f"| {point['router']} | {point['concurrency']} | {point['requests']} "
        f"| {fmt(point.get('tokens_per_s_per_gpu'), ',.0f')} "
        f"| {fmt(point.get('output_per_s_per_gpu'), ',.0f')} "
        f"| {fmt(point.get('p90_tokens_per_s_per_user'), '.1f')} "
        f"| {fmt(ttft.get('p50'), ',.0f')} / {fmt(ttft.get('p90'), ',.0f')} / "
        f"{fmt(ttft.get('p99'), ',.0f')} "
        f"| {fmt(reuse * 100 if reuse is not None else None, '.1f')}% of "
        f"{point['prefix_reuse_theoretical'] * 100:.1f}% "
        f"| {fmt(point.get('usd_per_million_tokens'), '.4f')} "
        f"| {point['errors']} "
        f"| {fmt(point.get('late_steps', math.nan) * 100, '.1f')}% |"
    )


HEADER = (
    "| router | sessions | requests | tokens/s/GPU | output/s/GPU | P90 tok/s/user "
    "| TTFT p50 / p90 / p99 ms | prefix reuse (theoretical) | $/M tokens | errors "
    "| late steps |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def compare(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Baton against each other router at each concurrency: throughput per GPU and P90 per-user
    rate as ratios, and Baton's reuse as a share of the theoretical."""
    by = {(p["router"], p["concurrency"]): p for p in points}
    rows = []
    for (router, concurrency), point in by.items():
        baton = by.get(("baton", concurrency))
        if router == "baton" or baton is None or "tokens_per_s_per_gpu" not in point:
            continue
        if "tokens_per_s_per_gpu" not in baton:
            continue
        rows.append(
            {
                "concurrency": concurrency,
                "against": router,
                "throughput_per_gpu_ratio": baton["tokens_per_s_per_gpu"]
                / point["tokens_per_s_per_gpu"],
                "p90_per_user_ratio": baton["p90_tokens_per_s_per_user"]
                / point["p90_tokens_per_s_per_user"],
                "baton_reuse_of_theoretical": baton["prefix_reuse_achieved"]
                / baton["prefix_reuse_theoretical"],
            }
        )
    return rows


def plot(points: Sequence[dict[str, Any]], path: Path) -> None:
    """Throughput per GPU against P90 per-user tokens/s (the study's first figure), TTFT by
    concurrency and prefix reuse by router, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routers = list(dict.fromkeys(p["router"] for p in points))
    levels = sorted({p["concurrency"] for p in points})
    fig, (frontier, ttft, reuse) = plt.subplots(1, 3, figsize=(16, 4.8))
    for router in routers:
        mine = sorted(
            (p for p in points if p["router"] == router and "tokens_per_s_per_gpu" in p),
            key=lambda p: p["concurrency"],
        )
        xs = [p["p90_tokens_per_s_per_user"] for p in mine]
        ys = [p["tokens_per_s_per_gpu"] for p in mine]
        frontier.plot(xs, ys, marker="o", label=router)
        for x, y, p in zip(xs, ys, mine, strict=True):
            frontier.annotate(
                f"c={p['concurrency']}",
                (x, y),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
        cs = [p["concurrency"] for p in mine]
        line = ttft.plot(cs, [p["ttft_ms"]["p50"] for p in mine], marker="o", label=f"{router} p50")
        ttft.plot(
            cs,
            [p["ttft_ms"]["p90"] for p in mine],
            marker="x",
            linestyle="--",
            color=line[0].get_color(),
            label=f"{router} p90",
        )
    frontier.set(
        xlabel="P90 tokens/s per user",
        ylabel="tokens/s per GPU (cached + uncached + output)",
        title="Throughput per GPU against interactivity",
    )
    frontier.legend(fontsize=8)
    ttft.set(
        xlabel="concurrent sessions",
        ylabel="TTFT (ms)",
        xscale="log",
        yscale="log",
        title="Time to first token",
    )
    ttft.legend(fontsize=7)
    width = 0.8 / max(1, len(routers))
    for index, router in enumerate(routers):
        values = [
            next(
                (
                    p.get("prefix_reuse_achieved") or 0.0
                    for p in points
                    if p["router"] == router and p["concurrency"] == c
                ),
                0.0,
            )
            * 100
            for c in levels
        ]
        reuse.bar([i + index * width for i in range(len(levels))], values, width, label=router)
    theoretical = statistics.mean(p["prefix_reuse_theoretical"] for p in points) * 100
    reuse.axhline(
        theoretical, color="black", linestyle=":", label=f"theoretical {theoretical:.1f}%"
    )
    reuse.set_xticks(
        [i + width * (len(routers) - 1) / 2 for i in range(len(levels))], [str(c) for c in levels]
    )
    reuse.set(
        xlabel="concurrent sessions",
        ylabel="prefix reuse achieved (%)",
        ylim=(0, 100),
        title="Prompt tokens served from cache",
    )
    reuse.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_eplb(points: Sequence[dict[str, Any]], path: Path) -> None:
    """Each EPLB mode's expert balance over time (target and draft), and its throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (target, draft, rate) = plt.subplots(
        1, 3, figsize=(16, 4.6), gridspec_kw={"width_ratios": [2, 2, 1]}
    )
    for point in points:
        name = EPLB_NAMES.get(point["eplb"], point["eplb"])
        for axis, model in ((target, "target"), (draft, "draft")):
            timeline = [p for p in point["balance_timeline"] if model in p]
            axis.plot([p["t_s"] for p in timeline], [p[model] for p in timeline], label=name)
    for axis, model in ((target, "target"), (draft, "draft")):
        axis.set(
            xlabel="simulated seconds",
            ylabel="expert balance per step (mean / max)",
            ylim=(0, 1),
            title=f"{model} model",
        )
        axis.legend(fontsize=7, loc="lower right")
    names = [point["eplb"] for point in points]
    rate.bar(names, [point.get("tokens_per_s_per_gpu", 0.0) for point in points])
    rate.set(ylabel="tokens/s per GPU", title="Throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("agentx")
    group.add_argument("--url", help="an OpenAI-compatible endpoint instead of the simulated rack")
    group.add_argument("--gpus", type=int, help="GPUs behind --url (for per-GPU figures)")
    group.add_argument(
        "--routers",
        help=f"routers to compare, comma-separated (default: {','.join(ROUTERS)})",
    )
    group.add_argument(
        "--concurrency",
        help="concurrent sessions, comma-separated: the sweep (default: 16,64,192; quick: 16)",
    )
    group.add_argument(
        "--duration",
        type=float,
        help="simulated seconds measured per point, after the warmup (default 40; quick 15)",
    )
    group.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="simulated seconds before it (default 10; quick 5)",
    )
    group.add_argument(
        "--time-scale",
        type=float,
        help="wall seconds per simulated second (default 4; quick 2)",
    )
    group.add_argument("--seed", type=int, help="the workload's seed (default 2026)")
    group.add_argument(
        "--eplb-modes",
        help="EPLB modes to compare with Baton's gateway, comma-separated, '' for none "
        "(agent, vllm, off; default: all three; quick: none)",
    )
    group.add_argument(
        "--eplb-concurrency",
        type=int,
        help="sessions of the EPLB comparison (default: the sweep's largest)",
    )
    group.add_argument(
        "--eplb-duration",
        type=float,
        help="simulated seconds measured per EPLB mode (default 45: vLLM's policy first "
        "rebalances at decode step 3,000)",
    )
    group.add_argument(
        "--usd-per-gpu-hour",
        type=float,
        help="GPU price for $/M tokens (default 3.00, an assumption, not a quote)",
    )


def option_picker(args: argparse.Namespace, quick: bool) -> Callable[[str, Any, Any], Any]:
    """``pick(name, full, short)``: the option as given, else its full or quick run's default
    (``baton bench all`` gives no options: every one is a default)."""
    given = vars(args)

    def pick(name: str, full: Any, short: Any) -> Any:
        value = given.get(name)
        return (short if quick else full) if value is None else value

    return pick


def _settings(args: argparse.Namespace, quick: bool) -> Settings:
    """The run's settings from the command line (``baton bench all`` gives none: defaults)."""
    given = vars(args)
    pick = option_picker(args, quick)

    text = pick("concurrency", "16,64,192", "16")
    try:
        concurrency = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(
            f"baton bench agentx: --concurrency {text!r}: give integers like 16,64"
        ) from None
    if min(concurrency) < 1:
        raise SystemExit(f"baton bench agentx: --concurrency {text!r}: each must be at least 1")
    routers = tuple(
        r for r in pick("routers", ",".join(ROUTERS), ",".join(ROUTERS)).split(",") if r
    )
    unknown = sorted(set(routers) - set(ROUTERS))
    if unknown or not routers:
        raise SystemExit(
            f"baton bench agentx: --routers: unknown {unknown}; choose from {list(ROUTERS)}"
        )
    url = given.get("url")
    eplb_modes = tuple(m for m in pick("eplb_modes", ",".join(EPLB_NAMES), "").split(",") if m)
    unknown = sorted(set(eplb_modes) - set(EPLB_NAMES))
    if unknown:
        raise SystemExit(
            f"baton bench agentx: --eplb-modes: unknown {unknown}; choose from {list(EPLB_NAMES)}"
        )
    return Settings(
        routers=routers,
        concurrency=concurrency,
        duration_s=float(pick("duration", 40.0, 15.0)),
        warmup_s=float(pick("warmup", 10.0, 5.0)),
        time_scale=1.0 if url else float(pick("time_scale", 4.0, 2.0)),
        seed=int(pick("seed", 2026, 2026)),
        usd_per_gpu_hour=float(pick("usd_per_gpu_hour", 3.0, 3.0)),
        url=url,
        gpus=given.get("gpus"),
        eplb_modes=eplb_modes,
        eplb_concurrency=int(pick("eplb_concurrency", max(concurrency), max(concurrency))),
        eplb_duration_s=float(pick("eplb_duration", 45.0, 45.0)),
    )


def run(quick: bool = False, args: argparse.Namespace | None = None) -> dict[str, object]:
    settings = _settings(args or argparse.Namespace(), quick)
    started = time.time()
    points = sweep(settings)
    eplb = eplb_comparison(settings) if settings.url is None else []
    result: dict[str, object] = {
        "benchmark": "agentx",
        "settings": asdict(settings),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "points": points,
        "comparison": compare(points),
        "eplb": eplb,
        "targets": {"throughput_per_gpu_ratio_min": 1.15, "reuse_of_theoretical_min": 0.9},
    }
    print(HEADER)
    for point in points:
        print(_row(point))
    if eplb:
        print(EPLB_HEADER)
        for point in eplb:
            print(_eplb_row(point))
    for row in result["comparison"]:  # type: ignore[attr-defined]
        print(
            f"c={row['concurrency']}: Baton / {row['against']}: throughput per GPU "
            f"{row['throughput_per_gpu_ratio']:.2f}x, "
            f"P90 per-user {row['p90_per_user_ratio']:.2f}x; "
            f"Baton's reuse {row['baton_reuse_of_theoretical']:.1%} of the theoretical"
        )
    if not quick and settings.url is None:  # the docs' plots, beside the JSON baton bench saves
        directory = plots_directory(args)
        plot(points, directory / "agentx.png")
        if eplb:
            plot_eplb(eplb, directory / "agentx_eplb.png")
        print(f"wrote {directory}/agentx*.png", file=sys.stderr)
    return result


def plots_directory(args: argparse.Namespace | None) -> Path:
    """Where a full run draws its plots: beside its JSON (``baton bench --out``, else
    docs/figures)."""
    directory = Path(getattr(args, "out", None) or FIGURES)
    directory.mkdir(parents=True, exist_ok=True)
    return directory
