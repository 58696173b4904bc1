"""eplb/discovery.py and the service's group supervision: groups from a
ModelDeployment's status, runners kept in step with them, balance figures for status from the
agents' groups and the engines' reports."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from baton.core.eplb_report import WindowReport
from baton.core.experts import Placement
from baton.core.follow import DeploymentRef
from eplb.config import EplbServiceConfig, GroupSpec
from eplb.decide import Decision, Outcome
from eplb.discovery import deployment_eplb_status, groups_from_deployment, model_names
from eplb.engine_reports import EngineReports, ReportRejected
from eplb.metrics import EplbMetrics
from eplb.service import RECORDS_KEPT, EplbService, GroupRunner, SwitchRecord


def test_every_ready_cell_is_a_group_with_its_agents_at_the_specs_cadence() -> None:
    deployment: dict[str, Any] = {
        "spec": {"model": "m", "eplb": {"stepInterval": 600, "windowSize": 200}},
        "status": {
            "endpoints": {
                "cells": [
                    {"name": "dsv4-cell-0", "eplbAgents": ["10.0.0.1:50100", "10.0.0.2:50100"]},
                    {"name": "dsv4-cell-1", "eplbAgents": []},  # decode group not ready
                ]
            }
        },
    }
    [group] = groups_from_deployment(deployment)
    assert group == GroupSpec(
        name="dsv4-cell-0",
        agents=("10.0.0.1:50100", "10.0.0.2:50100"),
        window_size=200,
        step_interval=600,
    )
    config = EplbServiceConfig().for_group(group)
    assert (config.policy.window_size, config.policy.step_interval) == (200, 600)
    deployment["spec"]["eplb"]["enabled"] = False
    assert groups_from_deployment(deployment) == ()
    assert groups_from_deployment({}) == ()


def test_the_crd_default_cadence_is_the_studys() -> None:
    [group] = groups_from_deployment(
        {"status": {"endpoints": {"cells": [{"name": "c", "eplbAgents": ["h:1"]}]}}}
    )
    assert (group.step_interval, group.window_size) == (3000, 1000)


class Groups:
    """A GroupSource whose groups the test sets."""

    def __init__(self, groups: tuple[GroupSpec, ...]) -> None:
        self.groups = groups
        self.event = asyncio.Event()

    def decode_groups(self) -> tuple[GroupSpec, ...]:
        return self.groups

    async def changed(self) -> None:
        await self.event.wait()
        self.event.clear()

    def set(self, *groups: GroupSpec) -> None:
        self.groups = groups
        self.event.set()


async def until(check: Callable[[], bool]) -> None:
    """Poll state another task owns: at most 500 looks, 10 ms apart."""
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in 5 s")


async def test_runners_follow_the_groups_their_source_lists() -> None:
    a = GroupSpec(name="cell-0", agents=("127.0.0.1:9",))
    source = Groups((a,))
    config = EplbServiceConfig(reconnect_seconds=0.05)
    service = EplbService(config, source, EplbMetrics(CollectorRegistry()))
    task = asyncio.create_task(service.run())
    await until(lambda: set(service.runners) == {"cell-0"})
    first = service.runners["cell-0"]
    moved = GroupSpec(name="cell-0", agents=("127.0.0.1:10",))  # the group was recreated
    b = GroupSpec(name="cell-1", agents=("127.0.0.1:11",))
    source.set(moved, b)
    await until(lambda: set(service.runners) == {"cell-0", "cell-1"})
    await until(lambda: service.runners["cell-0"] is not first)
    assert service.runners["cell-0"].spec == moved
    source.set()
    await until(lambda: not service.runners)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_the_synced_gauge_is_0_until_the_group_syncs_and_leaves_with_it() -> None:
    registry = CollectorRegistry()
    source = Groups((GroupSpec(name="cell-0", agents=("127.0.0.1:9",)),))  # nothing listens
    config = EplbServiceConfig(reconnect_seconds=0.05)
    service = EplbService(config, source, EplbMetrics(registry))
    task = asyncio.create_task(service.run())

    def synced() -> float | None:
        return registry.get_sample_value("baton_eplb_group_synced", {"group": "cell-0"})

    await until(lambda: synced() == 0)
    source.set()
    await until(lambda: not service.runners)
    assert synced() is None  # a group gone leaves no series behind
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_status_reports_each_models_worst_cell_and_the_last_rebalance() -> None:
    source = Groups(())
    service = EplbService(EplbServiceConfig(), source, EplbMetrics(CollectorRegistry()))
    assert deployment_eplb_status(service) == {}
    config = EplbServiceConfig()
    for name, target, draft, step in (("c0", 0.91, 0.88, 3000), ("c1", 0.87, 0.93, None)):
        runner = GroupRunner(GroupSpec(name=name, agents=("h:1",)), config, [], service.metrics)
        runner.balance = {"target": target, "draft": draft}
        if step is not None:
            runner.last_rebalance_step = {"target": step}
        service.runners[name] = runner
    assert deployment_eplb_status(service) == {
        "eplb": {
            "target": {"balance": 0.87, "lastRebalanceStep": 3000},
            "draft": {"balance": 0.88},
        },
        "balance": "0.870",
    }


def _engine_window(cell: str, experts: int, before: float | None, after: float) -> WindowReport:
    return WindowReport(
        namespace="serving",
        deployment="dsv4",
        cell=cell,
        layers=1,
        experts=experts,
        num_ranks=4,
        load=[[1] * experts],
        balance_before=before,
        balance_after=after,
        experts_moved=3,
        policy="baton",
        vllm_version="0.33.0",
    )


def _reports(service: EplbService) -> EngineReports:
    return EngineReports(
        service.metrics,
        lambda: model_names({}),
        EplbServiceConfig().expert_bytes_of,
        DeploymentRef("serving", "dsv4"),
    )


def test_engine_reports_give_status_each_models_worst_measured_cell_and_its_time() -> None:
    service = EplbService(EplbServiceConfig(), Groups(()), EplbMetrics(CollectorRegistry()))
    reports = _reports(service)
    reports.window(_engine_window("c0", 384, 0.93, 0.97))
    reports.window(_engine_window("c1", 384, 0.89, 0.96))
    reports.window(_engine_window("c1", 128, None, 0.99))  # nothing measured yet for the draft
    status = deployment_eplb_status(service, reports)
    assert status["balance"] == "0.890"
    assert status["eplb"]["target"]["balance"] == 0.89
    assert status["eplb"]["target"]["lastRebalanceTime"].endswith("Z")
    assert "draft" not in status["eplb"]
    reports.keep_cells({"c0"})
    assert deployment_eplb_status(service, reports)["balance"] == "0.930"


def test_the_spec_names_the_models_engines_report_by_expert_count() -> None:
    spec = {"spec": {"eplb": {"models": [{"name": "big", "experts": 256, "topK": 8}]}}}
    assert model_names(spec) == {256: "big"}
    assert model_names({}) == {384: "target", 128: "draft"}


def test_engine_reports_for_another_deployment_or_an_unknown_model_are_refused() -> None:
    service = EplbService(EplbServiceConfig(), Groups(()), EplbMetrics(CollectorRegistry()))
    reports = _reports(service)
    other = _engine_window("c0", 384, 0.9, 0.95).model_copy(update={"deployment": "other"})
    with pytest.raises(ReportRejected) as refused:
        reports.window(other)
    assert (refused.value.status, refused.value.param) == (404, "deployment")
    with pytest.raises(ReportRejected) as unknown:
        reports.window(_engine_window("c0", 200, 0.9, 0.95))
    assert (unknown.value.status, unknown.value.param) == (400, "experts")
    assert reports.cells == {}


def test_a_runner_keeps_its_recent_decisions_only() -> None:
    """Each decision keeps its placement (every layer's maps, about 0.55 MB for a switch of
    the target model): kept all, they grew the EPLB service for as long as it ran."""
    runner = GroupRunner(
        GroupSpec(name="c0", agents=("h:1",)),
        EplbServiceConfig(),
        [],
        EplbMetrics(CollectorRegistry()),
    )
    placement = Placement(np.arange(8).reshape(1, 8) % 4, num_ranks=2, num_logical_experts=4)
    for boundary in range(3 * RECORDS_KEPT):
        decision = Decision(
            boundary, boundary, boundary, Outcome.REBALANCE, placement, 0.5, 0.9, 0.9, 2
        )
        runner._record(SwitchRecord("c0", "target", decision, "committed", f"s{boundary}"))
        runner.achieved[f"s{boundary}"] = 0.9
    assert len(runner.records) == RECORDS_KEPT
    assert runner.records[-1].switch_id == f"s{3 * RECORDS_KEPT - 1}"
    assert set(runner.achieved) <= {record.switch_id for record in runner.records}
