"""The EPLB service and a ModelDeployment: its decode groups come from the status the
controller writes (every ready cell's ``eplbAgents``), with the cadence of ``spec.eplb``
(``stepInterval``, ``windowSize``; none when ``enabled`` is false), and the balance it measures
goes back into that status (``status.eplb.<model>``, and the BALANCE printer column for the
target model).

A deployment's figure per model is its worst cell's latest window balance: the cell that limits
decode throughput. Status is patched only when a figure changed, at most every
``interval_s`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as Urllib3Error

from baton.core.api import (
    GROUP,
    PLURAL,
    VERSION,
    Endpoints,
    EplbSpec,
    ModelDeploymentStatus,
)
from baton.core.follow import DeploymentRef, StatusFollower, custom_objects_api
from eplb.config import GroupSpec
from eplb.engine_reports import EngineReports
from eplb.service import EplbService

__all__ = [
    "ModelDeploymentGroups",
    "deployment_eplb_status",
    "groups_from_deployment",
    "model_names",
    "publish_status",
]

log = logging.getLogger("baton.eplb")


def groups_from_deployment(obj: Mapping[str, Any]) -> tuple[GroupSpec, ...]:
    """One group per cell whose decode group is ready (it lists its agents), at the cadence
    of the deployment's ``spec.eplb``."""
    eplb = EplbSpec.model_validate((obj.get("spec") or {}).get("eplb") or {})
    if not eplb.enabled:
        return ()
    endpoints = Endpoints.model_validate((obj.get("status") or {}).get("endpoints") or {})
    return tuple(
        GroupSpec(
            name=cell.name,
            agents=tuple(cell.eplb_agents),
            window_size=eplb.window_size,
            step_interval=eplb.step_interval,
        )
        for cell in endpoints.cells
        if cell.eplb_agents
    )


def model_names(obj: Mapping[str, Any]) -> dict[int, str]:
    """Each model of ``spec.eplb.models`` by its logical expert count."""
    eplb = EplbSpec.model_validate((obj.get("spec") or {}).get("eplb") or {})
    return {model.experts: model.name for model in eplb.models}


def cell_names(obj: Mapping[str, Any]) -> set[str]:
    status = ModelDeploymentStatus.model_validate(obj.get("status") or {})
    return {cell.name for cell in status.cells}


@dataclass(frozen=True, slots=True)
class _Reading:
    groups: tuple[GroupSpec, ...]
    model_names: dict[int, str]
    cells: set[str]


def _read(obj: Mapping[str, Any]) -> _Reading:
    return _Reading(groups_from_deployment(obj), model_names(obj), cell_names(obj))


class ModelDeploymentGroups:
    """A :class:`~eplb.config.GroupSource` following a ModelDeployment: its decode groups, the
    names of its models (``spec.eplb.models``) and its cells, which bound the engines' reports."""

    def __init__(
        self, ref: DeploymentRef, loop: asyncio.AbstractEventLoop, reports: EngineReports
    ) -> None:
        self.ref = ref
        self.reports = reports
        self._groups: tuple[GroupSpec, ...] = ()
        self._model_names: dict[int, str] = model_names({})
        self._changed = asyncio.Event()
        self._follower = StatusFollower(ref, loop, _read, self._take)

    def start(self) -> None:
        self._follower.start()

    def stop(self) -> None:
        self._follower.stop()

    def decode_groups(self) -> tuple[GroupSpec, ...]:
        return self._groups

    def model_names(self) -> dict[int, str]:
        return self._model_names

    async def changed(self) -> None:
        await self._changed.wait()
        self._changed.clear()

    def _take(self, reading: _Reading) -> None:
        self._model_names = reading.model_names
        self.reports.keep_cells(reading.cells)
        if reading.groups != self._groups:
            self._groups = reading.groups
            self._changed.set()


def deployment_eplb_status(
    service: EplbService, reports: EngineReports | None = None
) -> dict[str, Any]:
    """``status.eplb`` and the ``balance`` summary for the service's groups and the engines'
    reports (empty: no figure yet)."""
    models: dict[str, dict[str, Any]] = {}

    def take(balances: Mapping[str, float], latest: Mapping[str, int | str], key: str) -> None:
        for model, balance in balances.items():
            entry = models.setdefault(model, {"balance": balance})
            entry["balance"] = min(entry["balance"], balance)
            if model in latest:
                entry[key] = max(entry.get(key, latest[model]), latest[model])

    for runner in service.runners.values():
        take(runner.balance, runner.last_rebalance_step, "lastRebalanceStep")
    for cell in reports.cells.values() if reports is not None else ():
        take(cell.balance, cell.last_rebalance_time, "lastRebalanceTime")
    if not models:
        return {}
    for entry in models.values():
        entry["balance"] = round(entry["balance"], 4)
    status: dict[str, Any] = {"eplb": models}
    if "target" in models:
        status["balance"] = f"{models['target']['balance']:.3f}"
    return status


async def publish_status(
    service: EplbService,
    reports: EngineReports,
    ref: DeploymentRef,
    interval_s: float = 10.0,
) -> None:
    """Patch the ModelDeployment's status with the service's figures whenever they change."""
    api = await asyncio.to_thread(custom_objects_api, ref)
    published: dict[str, Any] = {}
    while True:
        await asyncio.sleep(interval_s)
        status = deployment_eplb_status(service, reports)
        if not status or status == published:
            continue
        try:
            await asyncio.to_thread(
                api.patch_namespaced_custom_object_status,
                GROUP,
                VERSION,
                ref.namespace,
                PLURAL,
                ref.name,
                {"status": status},
            )
        except (ApiException, Urllib3Error, OSError) as exc:
            log.warning("balance not written to %s/%s: %s", ref.namespace, ref.name, exc)
            continue
        published = status
