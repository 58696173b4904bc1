"""The EPLB service's two-phase switch over the 8 servers of one DEP32 decode group.

Each server is its own ``baton sim`` process serving 4 of the 32 ranks (hybrid LB, as the
controller renders a decode pod per tray) with its own agent, over real gRPC. The service must
switch all of them at one step or none: a server refusing Prepare aborts the switch on every
server, and so does one killed (SIGKILL) or frozen (SIGSTOP: it holds its connections and never
answers, as a tray that drops off the network) when the service commits. And a service
started after one killed mid-switch finishes or aborts what it left, or brings a group already
split back to one placement.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from baton.core.eplb_wire import decode_placement, encode_placement
from baton.core.proto import eplb_agent_pb2 as pb
from eplb.client import AgentClient
from eplb.config import EplbServiceConfig, GroupSpec
from eplb.decide import Decision, Outcome, decide
from eplb.errors import AgentRejected, GroupMismatch
from eplb.metrics import EplbMetrics
from eplb.service import GroupRunner
from eplb.window import Window
from tests.helpers import SimHandle, free_port, keep_decoding

SERVERS, LOCAL_RANKS = 8, 4
WINDOW, INTERVAL = 100, 600


@dataclass(frozen=True)
class Server:
    handle: SimHandle
    agent: str  # host:port of its EPLB agent


def start_group(start_sim: Callable[..., SimHandle], servers: int) -> list[Server]:
    """The ``servers`` servers of one DP group of ``servers`` x 4 ranks, started together."""

    def start(index: int) -> Server:
        port = free_port()
        handle = start_sim(
            *("--data-parallel-size", str(servers * LOCAL_RANKS)),
            *("--data-parallel-size-local", str(LOCAL_RANKS)),
            *("--data-parallel-start-rank", str(index * LOCAL_RANKS), "--data-parallel-hybrid-lb"),
            *("--enable-expert-parallel", "--enable-eplb", "--eplb-config"),
            f'{{"num_redundant_experts":32,"window_size":{WINDOW},"step_interval":{INTERVAL}}}',
            *("--speculative-config", '{"method":"mtp","num_speculative_tokens":3}'),
            *("--eplb-agent-port", str(port), "--eplb-agent-insecure"),
            # Half speed: 8 engines stepping on a shared 2-core machine keep up.
            *("--time-scale", "2"),
        )
        return Server(handle, f"127.0.0.1:{port}")

    with ThreadPoolExecutor(2) as pool:  # 8 imports at once starve each other's start
        return list(pool.map(start, range(servers)))


@pytest.fixture
def group(start_sim: Callable[..., SimHandle]) -> Iterator[list[Server]]:
    """The 8 servers of one DEP32 group; a frozen one is thawed after."""
    servers = start_group(start_sim, SERVERS)
    yield servers
    for server in servers:
        if server.handle.process.poll() is None:
            server.handle.process.send_signal(signal.SIGCONT)


def runner_for(
    servers: list[Server], clients: list[AgentClient] | None = None, **overrides: object
) -> GroupRunner:
    agents = tuple(server.agent for server in servers)
    config = EplbServiceConfig(
        window_size=WINDOW,
        step_interval=INTERVAL,
        groups=(GroupSpec(name="cell-0", agents=agents),),
        **overrides,
    )
    return GroupRunner(
        config.groups[0],
        config,
        clients or [AgentClient(agent) for agent in agents],
        EplbMetrics(CollectorRegistry()),
    )


def skewed_decision(runner: GroupRunner) -> tuple[str, Decision]:
    track = runner.tracks["target"]
    rng = np.random.default_rng(0)
    load = np.rint(rng.lognormal(0.0, 1.0, size=(43, 384)) * 1e5).astype(np.int64)
    decision = decide(Window(0, WINDOW, WINDOW, load, 0.5), track.placement, runner.policy, 600)
    assert decision.outcome is Outcome.REBALANCE
    return "target", decision


def load_every_server(servers: list[Server]) -> None:
    for server in servers:
        keep_decoding(server.handle.url, requests=8, ranks=LOCAL_RANKS)


async def first_step_under(agent: str, model: str, version: int) -> int:
    """The first step an agent reports under placement ``version`` of ``model``."""
    client = AgentClient(agent)
    try:
        async for report in client.stream_load(10):
            if report.model == model and report.placement_version == version:
                return report.first_step
        raise AssertionError(f"{agent}: load stream ended")
    finally:
        await client.close()


async def state(agent: str) -> pb.PlacementState:
    client = AgentClient(agent)
    try:
        return await client.get_placement(5.0)
    finally:
        await client.close()


async def assert_never_switches(servers: list[Server], switch_id: str, past_step: int) -> None:
    """Nothing of ``switch_id`` is staged on any live server, and each one decodes past
    ``past_step`` (the step it was committed for) on the placement it had."""
    for server in servers:
        client = AgentClient(server.agent)
        with pytest.raises(AgentRejected, match="not staged"):
            await client.commit(switch_id, 0, 5.0)
        await client.close()
    for server in servers:
        for _ in range(600):
            placement = await state(server.agent)
            if placement.current_step > past_step:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"{server.agent} never reached step {past_step}")
        versions = {p.model: p.version for p in placement.placements}
        assert versions == {"target": 0, "draft": 0}, server.agent


async def close(runner: GroupRunner) -> None:
    for client in runner.clients:
        await client.close()


async def test_every_server_switches_at_the_one_agreed_step(group: list[Server]) -> None:
    load_every_server(group)
    runner = runner_for(group)
    await runner.sync()
    model, decision = skewed_decision(runner)
    watchers = [asyncio.create_task(first_step_under(s.agent, model, 1)) for s in group]
    await asyncio.sleep(0.5)  # every stream subscribed before anything can switch
    record = await runner.switch(model, decision)
    assert record.result == "committed" and record.apply_at_step is not None
    firsts = await asyncio.wait_for(asyncio.gather(*watchers), timeout=120)
    assert firsts == [record.apply_at_step] * SERVERS  # no rank switched alone, or early
    for server in group:
        in_force = {p.model: p for p in (await state(server.agent)).placements}
        assert in_force[model].version == 1 and in_force["draft"].version == 0
        assert decode_placement(in_force[model], 32, 384) == decision.placement
    await close(runner)


async def test_a_server_refusing_prepare_aborts_the_switch_on_all_eight(
    group: list[Server],
) -> None:
    runner = runner_for(group)
    await runner.sync()
    model, decision = skewed_decision(runner)
    # Server 5 still holds a committed switch whose Abort it never got: it refuses the next
    # Prepare (one only staged would be replaced).
    stray = AgentClient(group[5].agent)
    await stray.prepare("stray", [encode_placement(model, decision.placement, 1)], 30.0)
    await stray.commit("stray", 10**9, 30.0)
    record = await runner.switch(model, decision)
    assert record.result == "prepare_failed" and record.switch_id is not None
    load_every_server(group)
    await assert_never_switches(group, record.switch_id, past_step=runner.config.apply_margin_steps)
    await stray.abort("stray", "test over", 5.0)
    await stray.close()
    await close(runner)


class _LostAtCommit(AgentClient):
    """The agent of a server whose process gets ``signal`` just as the service commits to it."""

    def __init__(self, address: str, process: subprocess.Popen[bytes], sent: signal.Signals):
        super().__init__(address)
        self.process, self.sent = process, sent
        self.asked: int | None = None

    async def commit(self, switch_id: str, apply_at_step: int, deadline: float) -> int:
        self.asked = apply_at_step
        self.process.send_signal(self.sent)
        if self.sent is signal.SIGKILL:
            await asyncio.to_thread(self.process.wait)
        return await super().commit(switch_id, apply_at_step, deadline)


@pytest.mark.parametrize("sent", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
async def test_a_server_lost_at_commit_aborts_the_switch_on_every_other(
    group: list[Server], sent: signal.Signals
) -> None:
    load_every_server(group)
    lost = _LostAtCommit(group[3].agent, group[3].handle.process, sent)
    clients = [lost if i == 3 else AgentClient(s.agent) for i, s in enumerate(group)]
    # The defaults' proportions: a Commit deadline longer than the margin's steps take.
    runner = runner_for(group, clients, apply_margin_steps=10, commit_timeout_seconds=5.0)
    await runner.sync()
    model, decision = skewed_decision(runner)
    record = await runner.switch(model, decision)
    assert record.result == "commit_failed" and record.switch_id is not None
    assert lost.asked is not None
    live = [s for i, s in enumerate(group) if i != 3]
    await assert_never_switches(live, record.switch_id, past_step=lost.asked)
    await close(runner)


# ---- a service that stopped in the middle of a switch, and the one started after it


@pytest.fixture
def pair(start_sim: Callable[..., SimHandle]) -> list[Server]:
    """The 2 servers of a DEP8 group: the least that can be left half switched."""
    return start_group(start_sim, 2)


async def half_switch(servers: list[Server], committed: int, ahead: int) -> tuple[str, int]:
    """What a service killed during a switch leaves: every server prepared, the first
    ``committed`` committed for a step ``ahead`` steps past the furthest; the switch and step."""
    runner = runner_for(servers)
    await runner.sync()
    model, decision = skewed_decision(runner)
    switch_id = "killed-service-switch"
    message = encode_placement(model, decision.placement, 1)
    for client in runner.clients:
        await client.prepare(switch_id, [message], 60.0)
    step = max([(await state(s.agent)).current_step for s in servers]) + ahead
    for client in runner.clients[:committed]:
        await client.commit(switch_id, step, 10.0)
    await close(runner)
    return switch_id, step


async def sync_until_settled(servers: list[Server]) -> GroupRunner:
    """A new service's sync, retried as its runner retries, until the group is synced."""
    runner = runner_for(servers)
    for _ in range(240):
        try:
            await runner.sync()
            return runner
        except GroupMismatch:
            await asyncio.sleep(0.5)
    raise AssertionError("the group never settled")


async def in_force(servers: list[Server]) -> list[tuple[int, bytes]]:
    return [
        next(
            (p.version, p.phy2log) for p in (await state(s.agent)).placements if p.model == "target"
        )
        for s in servers
    ]


async def test_a_switch_left_prepared_by_a_killed_service_is_aborted_by_the_next(
    pair: list[Server],
) -> None:
    load_every_server(pair)
    switch_id, step = await half_switch(pair, committed=0, ahead=50)
    runner = await sync_until_settled(pair)
    assert [list((await state(s.agent)).pending) for s in pair] == [[], []]
    recovered = runner.metrics.switches_recovered.labels("cell-0", "aborted")._value.get()
    assert recovered == 1
    await assert_never_switches(pair, switch_id, past_step=step)
    await close(runner)


async def test_a_switch_committed_on_one_server_only_is_finished_on_the_other(
    pair: list[Server],
) -> None:
    load_every_server(pair)
    _, step = await half_switch(pair, committed=1, ahead=400)
    runner = await sync_until_settled(pair)  # waits until the switch has taken effect
    first, second = await in_force(pair)
    assert first == second and first[0] == 1  # both switched, to the same placement
    assert runner.metrics.switches_recovered.labels("cell-0", "committed")._value.get() == 1
    assert min([(await state(s.agent)).current_step for s in pair]) >= step
    await close(runner)


async def test_a_group_already_split_is_brought_back_to_one_placement(pair: list[Server]) -> None:
    """The service stayed down past the step: the committed server switched alone."""
    load_every_server(pair)
    await half_switch(pair, committed=1, ahead=30)
    for _ in range(600):
        if (await in_force(pair))[0][0] == 1:
            break
        await asyncio.sleep(0.1)
    first, second = await in_force(pair)
    assert first[0] == 1 and second[0] == 0 and first[1] != second[1]  # split
    runner = await sync_until_settled(pair)
    first, second = await in_force(pair)
    assert first == second
    assert runner.metrics.switches_recovered.labels("cell-0", "reunified")._value.get() >= 1
    await close(runner)


async def test_servers_at_different_steps_when_the_service_subscribes_still_make_windows(
    pair: list[Server],
) -> None:
    """A service that starts (or restarts) while one server has run more steps than the other
    (which a stalled server leaves) must still complete windows and decide."""
    keep_decoding(pair[0].handle.url, requests=8, ranks=LOCAL_RANKS)
    for _ in range(300):  # server 0 runs ahead on its own
        if (await state(pair[0].agent)).current_step > 150:
            break
        await asyncio.sleep(0.1)
    keep_decoding(pair[1].handle.url, requests=8, ranks=LOCAL_RANKS)
    runner = runner_for(pair)
    running = asyncio.create_task(runner.run())
    try:
        for _ in range(600):
            if runner.records:
                break
            await asyncio.sleep(0.1)
        assert runner.records, "no window completed: no decision was made"
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await close(runner)
