"""The EPLB service against a simulated DEP32 decode group over real gRPC.

One module-wide run (a ``baton sim`` DEP32 group under decode load, the service in-process on
its own event loop) backs the cadence and prediction tests; the failure tests start their own
simulator. Windows of 100 steps every 300 steps keep the run short.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from baton.core.eplb_wire import decode_placement
from baton.core.experts import Placement
from baton.core.proto import eplb_agent_pb2 as pb
from eplb.client import AgentClient
from eplb.config import EplbServiceConfig, GroupSpec
from eplb.decide import Decision, Outcome, decide
from eplb.errors import AgentRejected, AgentUnauthenticated, AgentUnavailable
from eplb.metrics import EplbMetrics
from eplb.service import EplbService, GroupRunner, SwitchRecord
from eplb.window import Window
from rigs.faults import FaultInjection
from tests.helpers import (
    ROOT,
    SimHandle,
    baton_command,
    eventually,
    free_port,
    keep_decoding,
    stop_process,
    wait_healthy,
)

TOKEN = "group-secret"
WINDOW, INTERVAL = 100, 300
DEP32_FLAGS = (
    "--data-parallel-size",
    "32",
    "--enable-expert-parallel",
    "--enable-eplb",
    "--eplb-config",
    f'{{"num_redundant_experts":32,"window_size":{WINDOW},"step_interval":{INTERVAL}}}',
    "--speculative-config",
    '{"method":"mtp","num_speculative_tokens":3}',
)


def service_config(agent: str, **overrides: object) -> EplbServiceConfig:
    return EplbServiceConfig(
        window_size=WINDOW,
        step_interval=INTERVAL,
        apply_margin_steps=20,
        groups=(GroupSpec(name="cell-0", agents=(agent,)),),
        **overrides,
    )


def runner_for(agent: str, token: str | None = TOKEN, **overrides: object) -> GroupRunner:
    config = service_config(agent, **overrides)
    return GroupRunner(
        config.groups[0],
        config,
        [AgentClient(agent, token=token)],
        EplbMetrics(CollectorRegistry()),
    )


@dataclass
class Rebalancing:
    records: list[SwitchRecord]
    achieved: dict[str, float]
    placements: dict[str, pb.Placement]


def _placements(agent: str) -> dict[str, pb.Placement]:
    async def read() -> dict[str, pb.Placement]:
        client = AgentClient(agent, token=TOKEN)
        try:
            return {p.model: p for p in (await client.get_placement(5.0)).placements}
        finally:
            await client.close()

    return asyncio.run(read())


@pytest.fixture(scope="module")
def rebalancing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rebalancing]:
    """A DEP32 group under load and the service running on it until both models have
    committed switches with measured outcomes and several decided boundaries, one of them
    kept as noise."""
    folder = tmp_path_factory.mktemp("eplb")
    token_file = folder / "token"
    token_file.write_text(TOKEN + "\n")
    port, agent_port = free_port(), free_port()
    log_path = folder / "sim.log"
    process = subprocess.Popen(
        [
            *baton_command("sim", "--port", str(port), *DEP32_FLAGS),
            *("--eplb-agent-port", str(agent_port), "--eplb-agent-token-file", str(token_file)),
        ],
        cwd=ROOT,
        stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
        env=dict(os.environ),
    )
    agent = f"127.0.0.1:{agent_port}"
    runner = runner_for(agent)
    loop = asyncio.new_event_loop()
    stop = loop.create_future()

    async def serve() -> None:
        task = asyncio.create_task(runner.run())
        await stop
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for client in runner.clients:
            await client.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)

    def stop_service() -> None:
        if not stop.done():
            loop.call_soon_threadsafe(stop.set_result, None)
        thread.join(timeout=10)

    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, log_path)
        thread.start()
        keep_decoding(f"http://127.0.0.1:{port}")

        def done() -> bool:
            measured = {r.model for r in runner.records if r.switch_id in runner.achieved} == {
                "target",
                "draft",
            }
            decided = all(
                sum(r.model == m for r in runner.records) >= 3 for m in ("target", "draft")
            )
            # which boundary is the first to be noise is chance: wait for one, not a count
            kept = any(r.result == Outcome.GAIN_TOO_SMALL for r in runner.records)
            return measured and decided and kept

        eventually(done, timeout=120, interval=0.2)
        stop_service()
        committed = {
            model: sum(r.model == model and r.result == "committed" for r in runner.records)
            for model in ("target", "draft")
        }

        def switched() -> dict[str, pb.Placement] | None:
            placements = _placements(agent)
            applied = all(placements[m].version == n for m, n in committed.items())
            return placements if applied else None

        # The last commits name a step a little ahead: decode goes on until it is reached.
        placements = eventually(switched, timeout=30, interval=0.2)
        assert placements is not None  # eventually returns only a truthy reading
        yield Rebalancing(list(runner.records), dict(runner.achieved), placements)
    finally:
        if thread.is_alive():
            stop_service()
        stop_process(process)


def test_rebalances_land_on_interval_boundaries_using_the_last_window(
    rebalancing: Rebalancing,
) -> None:
    committed = [r for r in rebalancing.records if r.result == "committed"]
    assert {r.model for r in committed} == {"target", "draft"}
    for record in rebalancing.records:
        boundary = record.decision.boundary
        assert boundary % INTERVAL == 0
        assert (record.decision.window_first, record.decision.window_end) == (
            boundary - WINDOW,
            boundary,
        )
    for record in committed:
        assert record.apply_at_step is not None and record.apply_at_step > record.decision.boundary


def test_target_and_draft_are_rebalanced_independently(rebalancing: Rebalancing) -> None:
    for model, experts in (("target", 384), ("draft", 128)):
        committed = [r for r in rebalancing.records if r.model == model and r.result == "committed"]
        assert committed
        assert all(r.switch_id is not None and model in r.switch_id for r in committed)
        in_force = rebalancing.placements[model]
        # Each model's version counts only its own switches, and the last one is in force.
        assert in_force.version == len(committed)
        assert decode_placement(in_force, 32, experts) == committed[-1].decision.placement


def test_a_boundary_whose_predicted_gain_is_noise_is_skipped(rebalancing: Rebalancing) -> None:
    # After the first switch the routing barely drifts in a few hundred steps, so later
    # boundaries are mostly sampling noise: the service decides them and keeps the placement.
    outcomes = {r.result for r in rebalancing.records}
    assert Outcome.GAIN_TOO_SMALL in outcomes


@pytest.mark.parametrize(
    ("model", "noise"),
    # 64 requests x 4 tokens over 100 steps route ~4,800 picks per rank and layer; the peak of
    # 32 such Poisson counts moves by ~2-3% per layer between windows. The target averages 43
    # layers; the draft's single layer of 128 experts (top-3) is noisier.
    [pytest.param("target", 0.02, id="target"), pytest.param("draft", 0.05, id="draft")],
)
def test_balance_after_a_switch_matches_the_prediction_within_sampling_noise(
    rebalancing: Rebalancing, model: str, noise: float
) -> None:
    measured = [
        r for r in rebalancing.records if r.model == model and r.switch_id in rebalancing.achieved
    ]
    assert measured
    for record in measured:
        assert record.switch_id is not None  # measured: in ``achieved``
        achieved = rebalancing.achieved[record.switch_id]
        assert abs(achieved - record.decision.balance_after) <= noise
        assert achieved > record.decision.balance_before or record.decision.balance_before > 0.9


# Failure paths: each test starts its own simulator.


def skewed_decision(runner: GroupRunner) -> tuple[str, Decision]:
    track = runner.tracks["target"]
    rng = np.random.default_rng(0)
    load = np.rint(rng.lognormal(0.0, 1.0, size=(43, 384)) * 1e5).astype(np.int64)
    decision = decide(Window(0, WINDOW, WINDOW, load, 0.5), track.placement, runner.policy, 300)
    assert decision.outcome is Outcome.REBALANCE
    return "target", decision


async def version_of(agent: str, model: str) -> int:
    client = AgentClient(agent, token=TOKEN)
    try:
        state = await client.get_placement(5.0)
        return {p.model: p.version for p in state.placements}[model]
    finally:
        await client.close()


@pytest.fixture
def guarded_sim(
    start_sim: Callable[..., SimHandle], faults: FaultInjection, tmp_path: Path
) -> tuple[SimHandle, str]:
    """A DEP32 group whose agent wants ``TOKEN``; returns (handle, agent address)."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    agent_port = free_port()
    sim = start_sim(
        *DEP32_FLAGS,
        "--eplb-agent-port",
        str(agent_port),
        "--eplb-agent-token-file",
        str(token_file),
        *faults.flags,
    )
    return sim, f"127.0.0.1:{agent_port}"


async def test_a_rank_killed_during_prepare_aborts_everywhere_and_nothing_switches(
    guarded_sim: tuple[SimHandle, str], faults: FaultInjection
) -> None:
    sim, agent = guarded_sim
    runner = runner_for(agent)
    await runner.sync()
    model, decision = skewed_decision(runner)
    async with httpx.AsyncClient(headers=faults.headers) as http:
        # A stalled rank cannot stage weights: the Prepare waits for it...
        stall = {"action": "stall", "rank": 5, "seconds": 60}
        assert (await http.post(f"{sim.url}/sim/faults", json=stall)).status_code == 200
        switching = asyncio.create_task(runner.switch(model, decision))
        await asyncio.sleep(1.0)
        assert not switching.done()
        # ...and dies while it does.
        kill = {"action": "kill", "rank": 5}
        assert (await http.post(f"{sim.url}/sim/faults", json=kill)).status_code == 200
    record = await asyncio.wait_for(switching, timeout=10)
    assert record.result == "prepare_failed"
    assert await version_of(agent, model) == 0
    for client in runner.clients:
        await client.close()


async def test_a_prepare_that_times_out_is_aborted_and_never_staged(
    guarded_sim: tuple[SimHandle, str], faults: FaultInjection
) -> None:
    sim, agent = guarded_sim
    runner = runner_for(agent, prepare_timeout_seconds=1.0)
    await runner.sync()
    model, decision = skewed_decision(runner)
    async with httpx.AsyncClient(headers=faults.headers) as http:
        stall = {"action": "stall", "rank": 7, "seconds": 3}
        assert (await http.post(f"{sim.url}/sim/faults", json=stall)).status_code == 200
    record = await runner.switch(model, decision)
    assert record.result == "prepare_timeout" and record.switch_id is not None
    await asyncio.sleep(3.0)  # the stall ends; a late Prepare must not stage the aborted switch
    client = runner.clients[0]
    with pytest.raises(AgentRejected, match="not staged"):
        await client.commit(record.switch_id, 0, 2.0)
    # Nothing was left staged: the next switch goes through, and only it switches.
    retry = await runner.switch(model, decision)
    assert retry.result == "committed"
    for each in runner.clients:
        await each.close()


async def test_a_bad_or_missing_token_is_refused_and_logged(
    guarded_sim: tuple[SimHandle, str],
) -> None:
    sim, agent = guarded_sim
    placement = await AgentClient(agent, token=TOKEN).get_placement(5.0)
    message = placement.placements[0]
    for token in ("wrong-secret", None):
        client = AgentClient(agent, token=token)
        with pytest.raises(AgentUnauthenticated):
            await client.prepare("intruder", [message], 5.0)
        with pytest.raises(AgentUnauthenticated):
            await client.abort("intruder", "test", 5.0)
        await client.close()
    assert "refused Prepare" in sim.log() and "bad bearer token" in sim.log()
    assert "no bearer token" in sim.log()
    assert await version_of(agent, message.model) == 0


async def test_the_agent_serves_tls_to_a_service_holding_its_ca(
    start_sim: Callable[..., SimHandle], tmp_path: Path
) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    await asyncio.to_thread(
        subprocess.run,
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"),
            *("-addext", "subjectAltName=DNS:localhost"),
        ],
        check=True,
        capture_output=True,
    )
    agent_port = free_port()
    start_sim(
        *DEP32_FLAGS,
        "--eplb-agent-port",
        str(agent_port),
        "--eplb-agent-tls-cert",
        str(cert),
        "--eplb-agent-tls-key",
        str(key),
    )
    secure = AgentClient(f"localhost:{agent_port}", tls_ca=cert.read_bytes())
    info = await secure.describe(5.0)
    assert info.data_parallel_size == 32
    await secure.close()
    plain = AgentClient(f"localhost:{agent_port}")
    with pytest.raises(AgentUnavailable):
        await plain.describe(2.0)
    await plain.close()


async def test_an_engine_restart_restarts_the_groups_windows(
    start_sim: Callable[..., SimHandle], tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    agent_port = free_port()
    flags: tuple[str, ...] = (*DEP32_FLAGS, "--eplb-agent-port", str(agent_port))
    flags += ("--eplb-agent-token-file", str(token_file))
    first = start_sim(*flags)
    agent = f"127.0.0.1:{agent_port}"
    runner = runner_for(agent, reconnect_seconds=0.2)
    synced = runner.metrics.group_synced.labels("cell-0")
    task = asyncio.create_task(runner.run())
    await asyncio.wait_for(runner.synced.wait(), timeout=10)
    assert synced._value.get() == 1
    before = runner.tracks["target"].window
    stop_process(first.process)
    # Polled from a thread while the runner, on this loop, finds the stream broken.
    await asyncio.to_thread(eventually, lambda: synced._value.get() == 0, 10)
    start_sim(*flags)

    def resynced() -> bool:
        return runner.synced.is_set() and runner.tracks["target"].window is not before

    await asyncio.to_thread(eventually, resynced, 20)
    assert synced._value.get() == 1
    restarts = runner.metrics.window_restarts.labels("cell-0", "agent_lost")._value.get()
    assert restarts >= 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    for client in runner.clients:
        await client.close()
    assert isinstance(runner.tracks["target"].placement, Placement)


class MovingGroup:
    """The groups of one cell whose agents change address when the group is recreated (moved
    to a spare tray), as the ModelDeployment's status lists them."""

    def __init__(self, agent: str) -> None:
        self.spec = GroupSpec(name="cell-0", agents=(agent,))
        self._changed = asyncio.Event()

    def decode_groups(self) -> tuple[GroupSpec, ...]:
        return (self.spec,)

    def move(self, agent: str) -> None:
        self.spec = GroupSpec(name="cell-0", agents=(agent,))
        self._changed.set()

    async def changed(self) -> None:
        await self._changed.wait()
        self._changed.clear()


async def test_a_group_recreated_elsewhere_gets_back_the_placement_in_force_before(
    start_sim: Callable[..., SimHandle], tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)

    def start_group() -> str:
        port = free_port()
        sim = start_sim(
            *DEP32_FLAGS,
            "--eplb-agent-port",
            str(port),
            "--eplb-agent-token-file",
            str(token_file),
        )
        keep_decoding(sim.url, requests=32)  # steps advance, so switches apply
        return f"127.0.0.1:{port}"

    first = start_group()
    source = MovingGroup(first)
    config = service_config(first, reconnect_seconds=0.2)
    service = EplbService(config, source, EplbMetrics(CollectorRegistry()), token=TOKEN)
    task = asyncio.create_task(service.run())
    await asyncio.to_thread(eventually, lambda: "cell-0" in service.runners, 10)
    runner = service.runners["cell-0"]
    await asyncio.wait_for(runner.synced.wait(), timeout=20)
    model, decision = skewed_decision(runner)
    assert (await runner.switch(model, decision)).result == "committed"
    # the group is recreated on other trays: a fresh engine, on its cold placement (version 0)
    second = start_group()
    assert await version_of(second, model) == 0
    before = dict(runner.last_in_force)  # the service's own cadence may have switched more
    assert before[model][1] >= 1
    source.move(second)

    async def restored() -> bool:
        now = service.runners.get("cell-0")
        return (
            now is not None
            and now is not runner
            and now.synced.is_set()
            and all(
                np.array_equal(now.tracks[m].placement.phy2log, placement.phy2log)
                for m, (placement, _) in before.items()
            )
        )

    deadline = asyncio.get_running_loop().time() + 30
    while not await restored():
        assert asyncio.get_running_loop().time() < deadline, "the placement was not restored"
        await asyncio.sleep(0.2)
    now = service.runners["cell-0"]
    # committed for a coming step, as a rebalance is: the fresh engines' first switch, so their
    # version 1 (a version counts an engine's own switches)
    while await version_of(second, model) != 1:
        assert asyncio.get_running_loop().time() < deadline + 30, "the restore never applied"
        await asyncio.sleep(0.2)
    recovered = now.metrics.switches_recovered.labels("cell-0", "restored")._value.get()
    assert recovered == sum(1 for _, version in before.values() if version > 0)
    # and the windows take what the engines report under it: steps complete past the switch
    track = now.tracks[model]
    while track.window.completed_end <= track.switch_step:
        assert asyncio.get_running_loop().time() < deadline + 60, "reports were not taken"
        await asyncio.sleep(0.2)
    dropped = now.metrics.reports_dropped.labels("cell-0", model, "unknown_version")
    assert dropped._value.get() == 0
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
