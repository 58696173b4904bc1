"""``baton bench chaos``: faults on a schedule under agentic load, and what must hold after.

One cell as separate processes (``rigs.chaos.ChaosStack``: DEP2 prefill instances, a decode
group of hybrid-LB servers with their EPLB agents, the EPLB service, two gateway replicas)
takes agentic sessions (``bench.workload``'s shape, smaller contexts) through both gateways
while faults from a seeded schedule hit it, several at a time:

- ``kill_prefill``, ``kill_gateway``: SIGKILL, restarted after the fault's duration;
- ``kill_decode``: SIGKILL of one decode server while it streams; the group goes with it and
  restarts whole, as the controller restarts a group;
- ``stall_decode``: SIGSTOP of a decode server for longer than the gateway's idle deadline,
  then SIGCONT;
- ``slow_prefill``, ``slow_decode``: the engine's steps ten times as long (``slow`` fault);
- ``kill_eplb_prepare``: SIGKILL of the EPLB service while its agents stage a switch;
- ``kill_eplb_commit``: SIGKILL of the EPLB service after it committed one agent of the group
  and not the other (the gRPC link to that agent holds its Commit, then fails it unsent).

Every request is checked as the client sees it: either it completed with exactly the tokens
the engine generates for its prompt and seed (the simulator's text is a function of both), once,
ending in ``[DONE]``; or it got a well-formed error (an OpenAI error body with a 4xx/5xx status,
or an SSE error event then ``[DONE]``, after a prefix of its tokens); or the gateway it was
talking to was killed under it (a reset connection: nothing can answer for a dead process). A
request past its deadline, with wrong, duplicated or missing tokens, or with a malformed error
is a violation. After the schedule: the time until every component serves again (the gateways
ready with every target healthy, the EPLB service following the group, a request through each
gateway answered), and the time until the EPLB service commits a rebalance again, the load
going on until it does; then nothing left in flight at the gateways or engines, no prefill KV held,
and every agent of the group on one placement with nothing pending; and no component logged
a traceback (a fault is expected, not a crash). Throughout: no rank
switched to a placement alone (an agent on a newer version while another is on the older one
with nothing committed to follow), except after ``kill_eplb_commit`` when the service stayed
down past the switch's step: the committed agent switches then, and nothing can stop it (two-
phase commit blocks on its coordinator). Such a split must be healed by the restarted service
within :data:`SPLIT_HEAL_S` of the fault's end; it is reported, not hidden.

``tests/chaos`` runs :data:`SHORT` (every fault once, overlapping); ``baton bench chaos`` runs
longer seeded schedules, and ``--soak MINUTES`` a long one at moderate load that also samples
the gateways' and the EPLB service's memory, with the controller's soak beside it
(``bench.controller_soak``); :func:`memory_lives` judges whether each process's memory is flat.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from baton.core.proto import eplb_agent_pb2 as pb
from baton.core.sim_tokenizer import render_chat, word_for
from bench.controller_soak import report as controller_report
from bench.controller_soak import run_controller_soak
from bench.workload import WorkloadShape, lane_sessions, new_messages
from eplb.client import AgentClient
from eplb.errors import AgentError
from rigs.chaos import KV_LEASE_S, ChaosStack, Component

__all__ = [
    "FAULT_KINDS",
    "SHORT",
    "ChaosReport",
    "Fault",
    "add_arguments",
    "random_schedule",
    "run",
    "run_chaos",
]

FAULT_KINDS = (
    "kill_prefill",
    "slow_prefill",
    "kill_gateway",
    "stall_decode",
    "slow_decode",
    "kill_eplb_prepare",
    "kill_eplb_commit",
    "kill_decode",
)
# Sessions of the chaos load: AgentX's shape (bench.workload) at a tenth of its contexts, so
# that a run of a few minutes sees many turns and every fault meets requests in each phase.
CHAOS_SHAPE = WorkloadShape(
    system_tokens_median=1_500,
    first_task_tokens_median=300,
    subagent_task_tokens_median=200,
    tool_result_tokens_median=200,
    output_tokens_median=40,
    think_s_median=0.5,
    tool_result_cap=2_000,
    output_cap=160,
    context_cap_range=(4_000, 10_000),
)
REQUEST_DEADLINE_S = 90.0  # wall seconds; the gateway's own deadlines end any request well before
RECOVERY_BOUND_S = 90.0  # wall seconds from the last fault's end to everything serving again
# wall seconds from a kill_eplb_commit's end (the service restarted) within which the split it
# may leave must be healed: a sync, then a reunifying switch at the engines' pace
SPLIT_HEAL_S = 30.0
SOAK_SEED = 7


@dataclass(frozen=True, slots=True)
class Fault:
    """At ``at_s`` wall seconds into the load, ``kind`` on the ``target``-th component of its
    role, lasting ``duration_s`` (the time down, stopped or slow)."""

    at_s: float
    kind: str
    target: int = 0
    duration_s: float = 5.0


# Every fault once in about two minutes, several overlapping: what tests/chaos runs.
# The EPLB kills come first: they wait for their phase, which needs the group's servers near
# one step count, and a stalled server falls hundreds of steps behind the other.
SHORT: tuple[Fault, ...] = (
    Fault(3, "kill_eplb_commit", 0, 2),
    Fault(8, "kill_prefill", 0, 4),
    Fault(10, "slow_prefill", 1, 10),
    Fault(16, "kill_gateway", 1, 4),
    Fault(25, "kill_eplb_prepare", 0, 2),
    Fault(36, "slow_decode", 0, 8),
    Fault(48, "stall_decode", 1, 12),  # past the gateway's 8 s idle deadline
    Fault(75, "kill_decode", 0, 5),
    Fault(78, "kill_gateway", 0, 3),
)


# Faults that kill a process whose memory the soak judges (the gateways, the EPLB service).
MEMORY_KILLS = ("kill_gateway", "kill_eplb_prepare", "kill_eplb_commit")


def random_schedule(
    seed: int, duration_s: float, mean_gap_s: float = 12.0, spare_after_s: float | None = None
) -> list[Fault]:
    """Faults at exponentially spread times over ``duration_s``, kinds and targets drawn from
    ``seed``: they overlap whenever a gap is shorter than the fault before it. From
    ``spare_after_s`` on, no fault kills a process whose memory is judged (another kind is
    drawn instead), so that each lives long enough for :func:`memory_lives`."""
    rng = random.Random(seed)
    spared = tuple(kind for kind in FAULT_KINDS if kind not in MEMORY_KILLS)
    faults, at = [], rng.uniform(5, mean_gap_s)
    while at < duration_s - 10:
        kind = rng.choice(FAULT_KINDS)
        if spare_after_s is not None and at >= spare_after_s and kind in MEMORY_KILLS:
            # drawn without the generator, so the rest of the schedule stays as it was
            kind = spared[FAULT_KINDS.index(kind) % len(spared)]
        duration = {"stall_decode": rng.uniform(9, 15), "slow_prefill": rng.uniform(5, 15)}.get(
            kind, rng.uniform(2, 6)
        )
        faults.append(Fault(round(at, 1), kind, rng.randrange(2), round(duration, 1)))
        at += rng.expovariate(1 / mean_gap_s)
    return faults


# ---- what the client sees


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it."""

    kind: str  # ok, error_status, sse_error, gateway_killed, or a violation (VIOLATIONS)
    gateway: int
    start: float
    end: float
    status: int | None = None
    tokens: int = 0
    detail: str = ""


VIOLATIONS = (
    "hang",
    "wrong_tokens",
    "duplicate",
    "malformed_error",
    "no_done",
    "transport_error",
)


def expected_text(messages: Sequence[dict[str, str]], seed: int, tokens: int) -> str:
    """What the simulator generates for this chat and seed: its words are a function of the
    rendered prompt's digest, the seed and the position (``baton.core.sim_tokenizer.word_for``)."""
    digest = hashlib.blake2b(render_chat(messages, True), digest_size=16).digest()
    return "".join(word_for(seed, digest, index) for index in range(tokens))


def _well_formed_error(payload: Any) -> bool:
    error = payload.get("error") if isinstance(payload, dict) else None
    return (
        isinstance(error, dict)
        and isinstance(error.get("message"), str)
        and bool(error["message"])
        and isinstance(error.get("type"), str)
    )


def classify_stream(lines: Sequence[bytes], expected: str, max_tokens: int) -> tuple[str, int, str]:
    """A 200 stream's outcome, tokens and detail from its SSE lines."""
    text: list[str] = []
    usage_chunks, done, error = 0, 0, None
    after_done = False
    for line in lines:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if after_done:
            return "duplicate", len("".join(text)) // 4, "events after [DONE]"
        if data == b"[DONE]":
            done += 1
            after_done = True
            continue
        payload = json.loads(data)
        if "error" in payload:
            if not _well_formed_error(payload):
                return "malformed_error", len("".join(text)) // 4, data.decode()[:200]
            error = payload["error"]
            continue
        if error is not None:
            return "duplicate", len("".join(text)) // 4, "tokens after an error event"
        text.extend(
            (choice.get("delta") or {}).get("content") or ""
            for choice in payload.get("choices") or []
        )
        if payload.get("usage"):
            usage_chunks += 1
    got = "".join(text)
    tokens = len(got) // 4
    if not done:
        return "no_done", tokens, "stream ended without [DONE]"
    if not expected.startswith(got):
        return "wrong_tokens", tokens, f"got {got[:40]!r}..., expected {expected[:40]!r}..."
    if error is not None:
        return "sse_error", tokens, str(error.get("message"))[:200]
    if usage_chunks > 1:
        return "duplicate", tokens, f"{usage_chunks} usage chunks"
    if got != expected:
        return "wrong_tokens", tokens, f"{tokens} of {max_tokens} tokens, no error"
    return "ok", tokens, ""


# ---- the load


@dataclass(slots=True)
class _Load:
    stack: ChaosStack
    model: str
    stop_at: float
    started: float
    http: aiohttp.ClientSession
    seed: int
    outcomes: list[Outcome] = field(default_factory=list)
    kills: dict[int, list[float]] = field(default_factory=dict)  # gateway -> kill times

    def now(self) -> float:
        return time.monotonic() - self.started


async def _lane(load: _Load, lane: int) -> None:
    for number, session in enumerate(lane_sessions(load.seed, lane, CHAOS_SHAPE)):
        chat: list[dict[str, str]] = []
        for turn_index, turn in enumerate(session.turns):
            chat += new_messages(session, turn_index)
            if turn_index:
                await asyncio.sleep(turn.think_s * load.stack.time_scale)
            if time.monotonic() >= load.stop_at:
                return
            seed = int.from_bytes(
                hashlib.blake2b(f"{session.name}/{turn_index}".encode(), digest_size=7).digest(),
                "little",
            )
            await _request(load, lane + number + turn_index, chat, seed, turn.output_tokens)


async def _request(
    load: _Load, pick: int, messages: list[dict[str, str]], seed: int, max_tokens: int
) -> None:
    """One streamed chat completion through a gateway; a gateway refusing the connection (down)
    is skipped for the next, as a Service routes only to live endpoints."""
    body = {
        "model": load.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "seed": seed,
    }
    gateways = load.stack.gateways
    start = load.now()
    for attempt in range(2 * len(gateways)):
        index = (pick + attempt) % len(gateways)
        gateway = gateways[index]
        try:
            outcome = await asyncio.wait_for(
                _stream(load, index, gateway, body, messages), REQUEST_DEADLINE_S
            )
        except aiohttp.ClientConnectorError:
            await asyncio.sleep(0.2)
            continue
        except TimeoutError:
            outcome = Outcome("hang", index, start, load.now(), detail="past the deadline")
        outcome.start = start
        load.outcomes.append(outcome)
        return
    load.outcomes.append(Outcome("error_status", -1, start, load.now(), detail="no gateway up"))


async def _stream(
    load: _Load,
    index: int,
    gateway: Component,
    body: dict[str, Any],
    messages: list[dict[str, str]],
) -> Outcome:
    start = load.now()
    try:
        async with load.http.post(f"{gateway.url}/v1/chat/completions", json=body) as response:
            if response.status != 200:
                raw = await response.read()
                try:
                    payload = json.loads(raw)
                except ValueError:
                    payload = None
                kind = "error_status" if _well_formed_error(payload) else "malformed_error"
                return Outcome(
                    kind, index, start, load.now(), response.status, detail=raw[:200].decode()
                )
            lines = [line async for line in response.content]
    except aiohttp.ClientConnectorError:
        raise
    except (aiohttp.ClientError, ConnectionError) as exc:
        end = load.now()
        killed = any(start <= at <= end for at in load.kills.get(index, []))
        kind = "gateway_killed" if killed else "transport_error"
        return Outcome(kind, index, start, end, detail=f"{type(exc).__name__}: {exc}"[:200])
    expected = expected_text(messages, body["seed"], body["max_tokens"])
    kind, tokens, detail = classify_stream(lines, expected, body["max_tokens"])
    return Outcome(kind, index, start, load.now(), 200, tokens, detail)


# ---- the faults


@dataclass(slots=True)
class AppliedFault:
    fault: Fault
    started_s: float | None = None
    ended_s: float | None = None
    note: str = ""


async def _agent_states(
    stack: ChaosStack, addresses: Sequence[str] | None = None, deadline: float = 1.0
) -> list[pb.PlacementState | None]:
    """Each agent's GetPlacement (None for one that does not answer within ``deadline``)."""
    token = stack.agent_token.read_text()

    async def one(address: str) -> pb.PlacementState | None:
        client = AgentClient(address, token=token)
        try:
            return await client.get_placement(deadline)
        except AgentError:
            return None
        finally:
            await client.close()

    return list(await asyncio.gather(*(one(a) for a in addresses or stack.agents)))


async def _until(check: Callable[[], Awaitable[bool]], within: float, every: float) -> bool:
    """Poll ``check`` every ``every`` seconds for up to ``within``: whether it came true."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(every)
    return False


async def _apply(load: _Load, applied: AppliedFault) -> None:
    stack, fault = load.stack, applied.fault
    await asyncio.sleep(max(0.0, fault.at_s - load.now()))
    applied.started_s = load.now()
    kind, hold = fault.kind, fault.duration_s
    if kind in ("kill_prefill", "kill_gateway"):
        component = (stack.prefill if kind == "kill_prefill" else stack.gateways)[fault.target]
        if kind == "kill_gateway":
            load.kills.setdefault(fault.target, []).append(load.now())
        component.kill()
        if kind == "kill_gateway":
            load.kills[fault.target].append(load.now())
        await asyncio.sleep(hold)
        component.start()
        await asyncio.to_thread(component.wait_ready, 120)
    elif kind == "kill_decode":
        victim = stack.decode[fault.target]

        async def streaming() -> bool:
            running = await asyncio.to_thread(_scrape_sum, victim.url, "vllm:num_requests_running")
            return running > 0

        if not await _until(streaming, 30, 0.2):
            applied.note = "no stream was running on it"
        victim.kill()  # mid-stream; the rest of the group is lost with it
        for component in stack.decode:
            component.kill()
        await asyncio.sleep(hold)
        await asyncio.to_thread(stack.restart_decode_group)
        for component in stack.decode:
            await asyncio.to_thread(component.wait_ready, 120)
    elif kind == "stall_decode":
        component = stack.decode[fault.target]
        component.freeze()
        await asyncio.sleep(hold)
        component.thaw()
    elif kind in ("slow_prefill", "slow_decode"):
        component = (stack.prefill if kind == "slow_prefill" else stack.decode)[fault.target]
        seconds = hold / stack.time_scale  # the fault lasts simulated seconds
        await asyncio.to_thread(
            stack.faults.inject, component.url or "", action="slow", factor=10, seconds=seconds
        )
        await asyncio.sleep(hold)
    elif kind == "kill_eplb_prepare":
        await _kill_eplb_in_prepare(load, applied)
    elif kind == "kill_eplb_commit":
        await _kill_eplb_in_commit(load, applied)
    else:
        raise ValueError(f"unknown fault kind {kind!r}; choose from {FAULT_KINDS}")
    applied.ended_s = load.now()


async def _kill_eplb_in_prepare(load: _Load, applied: AppliedFault) -> None:
    stack = load.stack

    async def staging() -> bool:
        states = await _agent_states(stack)
        return any(s is not None and any(not p.committed for p in s.pending) for s in states)

    if await _until(staging, 90, 0.02):
        stack.eplb.kill()
        applied.note = "killed while its agents staged a switch"
    else:
        applied.note = "no switch was staged within 90 s; killed anyway"
        stack.eplb.kill()
    await asyncio.sleep(applied.fault.duration_s)
    stack.eplb.start()


async def _kill_eplb_in_commit(load: _Load, applied: AppliedFault) -> None:
    """Hold the Commits on the link to the last agent; once the first agent has accepted the
    Commit of a switch whose Commit to the last agent the link holds, kill the service; then
    fail the held Commit unsent, as a partition that heals with its connections reset. What is
    killed is always a switch committed on one agent only: the links see each Commit, so no
    poll races it."""
    stack = load.stack
    first, last = stack.links[0], stack.links[-1]

    async def one_side_committed() -> bool:
        return bool(first.committed() & last.held())

    last.hold_commits()
    try:
        cut = await _until(one_side_committed, 90, 0.01)
        if cut:
            stack.eplb.kill()
    finally:
        last.drop()
    if not cut:
        applied.note = "no switch reached its Commit within 90 s; not applied"
        return
    applied.note = "killed with one agent committed and the other not"
    await asyncio.sleep(applied.fault.duration_s)
    stack.eplb.start()


@dataclass(frozen=True, slots=True)
class Split:
    """A sample in which an agent was on an older version of a model than another, with no
    committed switch pending to follow it."""

    t_s: float
    model: str
    versions: list[tuple[int, bool]]

    def __str__(self) -> str:
        return f"{self.t_s:.1f}s {self.model}: versions {sorted(self.versions)}"


def excused_by_commit_kill(split: Split, applied: Sequence[AppliedFault]) -> bool:
    """Whether ``split`` is one a service killed during Commit may leave: seen after such a
    kill began and within :data:`SPLIT_HEAL_S` of the service's restart."""
    return any(
        a.fault.kind == "kill_eplb_commit"
        and a.note.startswith("killed")
        and a.started_s is not None
        and a.ended_s is not None
        and a.started_s <= split.t_s <= a.ended_s + SPLIT_HEAL_S
        for a in applied
    )


async def _watch_placements(load: _Load, splits: list[Split]) -> None:
    """Every half second: an agent on a newer version of a model while another is on an older
    one with no committed switch pending is a split."""
    while True:
        await asyncio.sleep(0.5)
        states = [s for s in await _agent_states(load.stack) if s is not None]
        if len(states) < 2:
            continue
        versions: dict[str, list[tuple[int, bool]]] = {}
        for state in states:
            committed = {p.model for p in state.pending if p.committed}
            for placement in state.placements:
                versions.setdefault(placement.model, []).append(
                    (placement.version, placement.model in committed)
                )
        for model, seen in versions.items():
            newest = max(version for version, _ in seen)
            if any(version < newest and not following for version, following in seen):
                splits.append(Split(round(load.now(), 1), model, seen))


# ---- after the schedule


def _scrape_sum(url: str | None, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def _at_start(stack: ChaosStack) -> tuple[str, dict[str, float]]:
    """The served model's name and the targets healthy before any fault, by role."""
    gateway = stack.gateways[0].url
    model = str(httpx.get(f"{gateway}/v1/models", timeout=10).json()["data"][0]["id"])
    healthy = {
        role: _scrape_sum(gateway, "baton_gateway_healthy_targets", role=role)
        for role in ("prefill", "decode")
    }
    return model, healthy


def _serving(stack: ChaosStack, healthy: dict[str, float]) -> bool:
    """Every component up, every target healthy in every gateway, the EPLB service synced."""
    if not all(component.alive and not component.frozen for component in stack.components):
        return False
    if not stack.gateways_ready():
        return False
    for gateway in stack.gateways:
        for role, count in healthy.items():
            if _scrape_sum(gateway.url, "baton_gateway_healthy_targets", role=role) < count:
                return False
    return _scrape_sum(stack.eplb_metrics, "baton_eplb_group_synced", group="cell-0") == 1


def _probe(stack: ChaosStack, model: str) -> bool:
    """A request through each gateway answered (a long prompt: prefill, then decode)."""
    for gateway in stack.gateways:
        reply = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            json={
                "model": model,
                "messages": [{"role": "user", "content": "probe " * 400}],
                "max_tokens": 4,
            },
            timeout=30,
        )
        if reply.status_code != 200:
            return False
    return True


def _leaks(stack: ChaosStack) -> dict[str, float]:
    leaks = {}
    for gateway in stack.gateways:
        leaks[f"{gateway.name} in flight"] = _scrape_sum(
            gateway.url, "baton_gateway_in_flight_requests"
        )
    for engine in stack.engines:
        leaks[f"{engine.name} requests"] = _scrape_sum(
            engine.url, "vllm:num_requests_running"
        ) + _scrape_sum(engine.url, "vllm:num_requests_waiting")
    for engine in stack.prefill:
        leaks[f"{engine.name} held KV blocks"] = _scrape_sum(engine.url, "baton:sim_kv_held_blocks")
    return leaks


def placements_agree(states: Sequence[pb.PlacementState]) -> dict[str, Any]:
    """Whether no rank of the group can go on to switch alone: per model, agents on one
    version share one placement, and an agent on an older version holds a committed switch
    of that model to follow (an idle engine applies it only when it steps again); a staged
    switch is staged on every agent (the next service aborts it); a committed switch is
    committed for one step, and an agent without it is past it (on a newer version than its
    holders)."""
    versions: dict[str, dict[int, set[bytes]]] = {}
    for state in states:
        for placement in state.placements:
            versions.setdefault(placement.model, {}).setdefault(placement.version, set()).add(
                placement.phy2log
            )
    problems = [
        f"{model} version {version}: {len(forms)} placements"
        for model, by_version in versions.items()
        for version, forms in by_version.items()
        if len(forms) > 1
    ]

    def version(state: pb.PlacementState, model: str) -> int:
        return next((p.version for p in state.placements if p.model == model), -1)

    newest = {model: max(by_version) for model, by_version in versions.items()}
    for index, state in enumerate(states):
        following = {p.model for p in state.pending if p.committed}
        problems += [
            f"agent {index} {model}: version {version(state, model)} of {top}, nothing to follow"
            for model, top in newest.items()
            if version(state, model) < top and model not in following
        ]
    held: dict[str, list[tuple[int, pb.PendingSwitch]]] = {}
    for index, state in enumerate(states):
        for pending in state.pending:
            held.setdefault(pending.switch_id, []).append((index, pending))
    for switch_id, holders in held.items():
        committed = {p.committed for _, p in holders}
        if committed == {False}:
            if len(holders) != len(states):
                problems.append(f"{switch_id}: staged on {len(holders)} of {len(states)} agents")
            continue
        if len(committed) > 1 or len({p.apply_at_step for _, p in holders}) > 1:
            problems.append(f"{switch_id}: held in different forms")
            continue
        model = holders[0][1].model
        holding = {index for index, _ in holders}
        past = max(version(states[index], model) for index in holding)
        problems += [
            f"{switch_id}: agent {index} neither holds it nor is past it"
            for index in range(len(states))
            if index not in holding and version(states[index], model) <= past
        ]
    return {
        "agreed": not problems,
        "problems": problems,
        "versions": {model: sorted(by_version) for model, by_version in versions.items()},
        "pending": {
            switch_id: sorted((p.committed, p.apply_at_step) for _, p in holders)
            for switch_id, holders in held.items()
        },
    }


async def _final_placements(stack: ChaosStack) -> dict[str, Any]:
    states = await _agent_states(stack, deadline=5.0)
    if any(state is None for state in states):
        return {"agreed": False, "problems": ["an agent did not answer"]}
    return placements_agree([state for state in states if state is not None])


# What the EPLB service's log says it did, over every process of the run (a restarted service's
# metrics start from zero; its log is appended to).
EPLB_LOG_LINES = {
    "committed_rebalances": "committed for step",
    "aborted": "aborted on every agent: left staged by an earlier EPLB service",
    "committed": "was committed on some agents only",
    "reunified": "are on another placement than",
    "restored": "in force before they restarted (version",
}


def _eplb_switches(stack: ChaosStack) -> dict[str, int]:
    text = stack.eplb.log_path.read_text(errors="replace")
    return {name: text.count(needle) for name, needle in EPLB_LOG_LINES.items()}


def _rebalances_committed_since(stack: ChaosStack, wall_s: float) -> int:
    """Rebalances the EPLB service's log says it committed at or after ``wall_s`` (epoch
    seconds; the log stamps local time to the millisecond)."""
    needle = EPLB_LOG_LINES["committed_rebalances"]
    count = 0
    for line in stack.eplb.log_path.read_text(errors="replace").splitlines():
        if needle not in line:
            continue
        try:
            stamped = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except ValueError:
            continue
        count += stamped >= wall_s
    return count


async def _rebalanced(load: _Load, since: float) -> float | None:
    """Seconds from ``since`` (monotonic) until the EPLB service commits a rebalance, the load
    kept on until then so that the engines step (None: not within the recovery bound and a
    minute more). A rack has recovered when its experts are balanced again, not only when it
    answers; how many steps that takes after a restart depends on the engines' pace, which a
    busy host slows."""
    deadline = since + RECOVERY_BOUND_S + 60
    since_wall = time.time() - (time.monotonic() - since)
    planned, load.stop_at = load.stop_at, deadline
    try:
        while time.monotonic() < deadline:
            if await asyncio.to_thread(_rebalances_committed_since, load.stack, since_wall):
                return max(0.0, time.monotonic() - since)
            await asyncio.sleep(1)
        return None
    finally:
        load.stop_at = max(planned, time.monotonic())


def _rss_mib(components: Sequence[Component]) -> dict[str, Any]:
    """Each live component's RSS in MiB, and under ``pids`` the process it was measured in (a
    restarted component is a new process, whose memory starts again)."""
    sizes, pids = {}, {}
    for component in components:
        if component.alive and component.process is not None:
            try:
                sizes[component.name] = psutil.Process(component.process.pid).memory_info().rss
            except psutil.Error:
                continue
            pids[component.name] = component.process.pid
    return {name: size / 2**20 for name, size in sizes.items()} | {"pids": pids}


# A process's first minutes, while its caches and pools fill; and how far its RSS may move
# after them and still be flat: the median of its last MEMORY_WINDOW_S within MEMORY_MARGIN of
# the median of its first MEMORY_WINDOW_S after warm-up (medians, as a process's RSS swings with
# what it holds at the moment: load windows, streams in flight).
WARM_UP_S = 300.0
MEMORY_WINDOW_S = 300.0
MEMORY_MARGIN = 0.10


def memory_lives(samples: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per component, its longest-lived process in ``samples`` (``{"t_s", name: MiB, ...,
    "pids": {name: pid}}``): its RSS at start and peak; and where it lived past warm-up by two
    windows, the medians after warm-up and at its end, the growth between them per minute, and
    whether that is flat within the margin."""
    lives: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for sample in samples:
        for name, pid in sample.get("pids", {}).items():
            lives.setdefault((name, pid), []).append((sample["t_s"], sample[name]))
    found: dict[str, dict[str, Any]] = {}
    for (name, pid), points in lives.items():
        lived = points[-1][0] - points[0][0]
        if name in found and found[name]["lived_s"] >= lived:
            continue
        life: dict[str, Any] = {
            "pid": pid,
            "lived_s": lived,
            "start_mib": round(points[0][1], 1),
            "peak_mib": round(max(size for _, size in points), 1),
        }
        settled_at = points[0][0] + WARM_UP_S
        if points[-1][0] - settled_at >= 2 * MEMORY_WINDOW_S:
            first = [v for t, v in points if settled_at <= t < settled_at + MEMORY_WINDOW_S]
            last = [v for t, v in points if t > points[-1][0] - MEMORY_WINDOW_S]
            base, end = statistics.median(first), statistics.median(last)
            minutes = (points[-1][0] - settled_at - MEMORY_WINDOW_S) / 60
            life |= {
                "after_warm_up_mib": round(base, 1),
                "end_mib": round(end, 1),
                "mib_per_min": round((end - base) / minutes, 3),
                "flat": end <= base * (1 + MEMORY_MARGIN),
            }
        found[name] = life
    return dict(sorted(found.items()))


# ---- one run


@dataclass(slots=True)
class ChaosReport:
    seed: int
    lanes: int
    load_s: float
    faults: list[dict[str, Any]]
    outcomes: dict[str, int]
    violations: list[dict[str, Any]]
    ranks_switched_alone: list[str]
    # splits left by the service killed during Commit, healed within SPLIT_HEAL_S
    healed_splits: list[str]
    recovery_s: float | None
    # from the last fault's end to the EPLB service's next committed rebalance
    rebalanced_s: float | None
    leaks: dict[str, float]
    placements: dict[str, Any]
    eplb_switches: dict[str, int]
    tracebacks: dict[str, int]
    memory_mib: list[dict[str, Any]] = field(default_factory=list)

    @property
    def held(self) -> bool:
        """Every invariant held."""
        return (
            not self.violations
            and not self.ranks_switched_alone
            and self.recovery_s is not None
            and self.recovery_s <= RECOVERY_BOUND_S
            and not any(self.leaks.values())
            and bool(self.placements.get("agreed"))
            and not self.tracebacks
        )


async def _sample_memory(stack: ChaosStack, load: _Load, samples: list[dict[str, Any]]) -> None:
    while True:
        samples.append({"t_s": round(load.now(), 1), **_rss_mib([*stack.gateways, stack.eplb])})
        await asyncio.sleep(30)


async def _recovery(
    stack: ChaosStack, model: str, healthy: dict[str, float], since: float
) -> float | None:
    """Seconds from ``since`` (monotonic) until everything serves and answers (None: not
    within the bound and a minute more)."""
    deadline = since + RECOVERY_BOUND_S + 60
    while time.monotonic() < deadline:
        try:
            if await asyncio.to_thread(_serving, stack, healthy) and await asyncio.to_thread(
                _probe, stack, model
            ):
                return max(0.0, time.monotonic() - since)
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)
    return None


async def run_chaos(
    stack: ChaosStack,
    schedule: Sequence[Fault],
    *,
    lanes: int,
    load_s: float,
    seed: int = 2026,
    sample_memory: bool = False,
) -> ChaosReport:
    """Load for ``load_s`` wall seconds with ``schedule``'s faults, then the checks (module
    doc). ``stack`` is started and left running."""
    model, healthy = await asyncio.to_thread(_at_start, stack)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0, force_close=True)
    ) as http:
        started = time.monotonic()
        load = _Load(stack, model, started + load_s, started, http, seed)
        applied = [AppliedFault(fault) for fault in schedule]
        splits: list[Split] = []
        memory: list[dict[str, Any]] = []
        helpers = [asyncio.create_task(_watch_placements(load, splits))]
        if sample_memory:
            helpers.append(asyncio.create_task(_sample_memory(stack, load, memory)))
        faults = [asyncio.create_task(_apply(load, one)) for one in applied]
        lanes_done = asyncio.ensure_future(
            asyncio.gather(*(_lane(load, lane) for lane in range(lanes)))
        )
        await asyncio.gather(*faults)
        # measured under the load still running, as a rack recovers under its users
        last_end = max((a.ended_s or 0.0 for a in applied), default=0.0)
        recovery = await _recovery(stack, model, healthy, started + last_end)
        rebalanced = await _rebalanced(load, started + last_end)
        await asyncio.wait_for(
            lanes_done, max(0.0, load.stop_at - time.monotonic()) + REQUEST_DEADLINE_S + 60
        )
        for helper in helpers:
            helper.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
    # what a killed decode side never pulled is freed when its lease runs out
    leaks: dict[str, float] = {}
    leak_deadline = time.monotonic() + 2 * KV_LEASE_S * stack.time_scale + 10
    while time.monotonic() < leak_deadline:
        leaks = await asyncio.to_thread(_leaks, stack)
        if not any(leaks.values()):
            break
        await asyncio.sleep(1)
    switches = _eplb_switches(stack)
    tracebacks = {
        component.name: count
        for component in stack.components
        if (count := component.log_path.read_text(errors="replace").count("Traceback"))
    }
    outcomes = Counter(o.kind for o in load.outcomes)
    return ChaosReport(
        seed=seed,
        lanes=lanes,
        load_s=load_s,
        faults=[
            asdict(a.fault) | {"started_s": a.started_s, "ended_s": a.ended_s, "note": a.note}
            for a in applied
        ],
        outcomes=dict(sorted(outcomes.items())),
        violations=[asdict(o) for o in load.outcomes if o.kind in VIOLATIONS],
        ranks_switched_alone=[str(s) for s in splits if not excused_by_commit_kill(s, applied)],
        healed_splits=[str(s) for s in splits if excused_by_commit_kill(s, applied)],
        recovery_s=recovery,
        rebalanced_s=rebalanced,
        leaks={name: value for name, value in leaks.items() if value},
        placements=await _final_placements(stack),
        eplb_switches=switches,
        tracebacks=tracebacks,
        memory_mib=memory,
    )


# ---- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("chaos")
    group.add_argument("--seeds", help="schedules to run, comma-separated seeds (default 1,2,3)")
    group.add_argument("--minutes", type=float, help="load per schedule (default 5)")
    group.add_argument("--lanes", type=int, help="concurrent sessions (default 8)")
    group.add_argument(
        "--soak",
        type=float,
        default=None,
        help="instead: one schedule of this many minutes at moderate load, and the controller "
        "under Kubernetes faults beside it, sampling memory",
    )


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def _print(report: ChaosReport) -> None:
    applied = sum(1 for f in report.faults if "not applied" not in f["note"])
    print(
        f"seed {report.seed}: {len(report.faults)} faults ({applied} applied), "
        f"{sum(report.outcomes.values())} requests {report.outcomes}; "
        f"violations {len(report.violations)}, ranks switched alone "
        f"{len(report.ranks_switched_alone)} (healed splits {len(report.healed_splits)}), recovery "
        f"{_seconds(report.recovery_s)}, "
        f"rebalanced after {_seconds(report.rebalanced_s)}, "
        f"leaks {report.leaks or 'none'}, placements agreed {report.placements.get('agreed')}; "
        f"EPLB {report.eplb_switches}; held: {report.held}"
    )


def _run_one(
    seed: int, schedule: Sequence[Fault], load_s: float, lanes: int, *, soak: bool = False
) -> ChaosReport:
    with tempfile.TemporaryDirectory(prefix="baton-chaos-") as tmp:
        stack = ChaosStack(Path(tmp))
        try:
            stack.start()
            report = asyncio.run(
                run_chaos(
                    stack, schedule, lanes=lanes, load_s=load_s, seed=seed, sample_memory=soak
                )
            )
        finally:
            stack.stop()
    _print(report)
    return report


def _print_memory(lives: Mapping[str, Mapping[str, Any]]) -> None:
    for name, life in lives.items():
        trend = (
            f"{life['after_warm_up_mib']:.0f} MiB after warm-up, {life['end_mib']:.0f} at the "
            f"end ({life['mib_per_min']:+.2f} MiB/min), flat: {life['flat']}"
            if "flat" in life
            else "too short-lived to judge"
        )
        print(
            f"{name} (pid {life['pid']}, {life['lived_s'] / 60:.0f} min): RSS "
            f"{life['start_mib']:.0f} MiB at start, peak {life['peak_mib']:.0f}; {trend}",
            file=sys.stderr,
        )


def _soak(minutes: float) -> dict[str, object]:
    """The loopback cell under a long schedule at moderate load, and beside it the controller
    under Kubernetes faults on a control plane of its own (``bench.controller_soak``)."""
    with (
        tempfile.TemporaryDirectory(prefix="baton-soak-k8s-") as k8s,
        ThreadPoolExecutor(1) as pool,
    ):
        controller = pool.submit(run_controller_soak, Path(k8s), minutes, SOAK_SEED)
        # the last warm-up and two windows free of kills: every judged process lives through them
        judged_s = WARM_UP_S + 2 * MEMORY_WINDOW_S
        report = _run_one(
            SOAK_SEED,
            random_schedule(
                SOAK_SEED, minutes * 60, mean_gap_s=60.0, spare_after_s=minutes * 60 - judged_s
            ),
            minutes * 60,
            6,
            soak=True,
        )
        cluster = controller.result()
    lives = memory_lives(report.memory_mib) | memory_lives(cluster.memory_mib)
    print(
        f"controller: {len(cluster.faults)} faults "
        f"{dict(Counter(f.kind for f in cluster.faults))}, recoveries up to "
        f"{max((f.recovery_s or 0.0 for f in cluster.faults), default=0.0):.1f} s, partial "
        f"groups {len(cluster.partial_groups)}; held: {cluster.held}"
    )
    _print_memory(lives)
    return {
        "benchmark": "chaos-soak",
        "soak_minutes": minutes,
        "memory_margin": MEMORY_MARGIN,
        "warm_up_s": WARM_UP_S,
        "reports": [asdict(report) | {"held": report.held}],
        "controller": controller_report(cluster),
        "memory": lives,
    }


def run(quick: bool = False, args: argparse.Namespace | None = None) -> dict[str, object]:
    given = vars(args) if args is not None else {}
    if given.get("soak"):
        return _soak(float(given["soak"]))
    if quick:
        plan = [(2026, list(SHORT), 100.0, 8)]
    else:
        seeds = [int(s) for s in (given.get("seeds") or "1,2,3").split(",")]
        minutes = given.get("minutes") or 5.0
        lanes = given.get("lanes") or 8
        plan = [(s, random_schedule(s, minutes * 60), minutes * 60, lanes) for s in seeds]
    reports = [_run_one(*planned) for planned in plan]
    return {
        "benchmark": "chaos",
        "soak_minutes": None,
        "reports": [asdict(report) | {"held": report.held} for report in reports],
    }
