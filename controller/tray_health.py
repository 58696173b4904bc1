"""The straggler watch on a running rack: dcgm-exporter's clocks and the decode engines' vLLM
series from Prometheus, window after window, for every decode group the ModelDeployments'
status places; a mark on each tray the watch finds degraded, and an Event on the deployment of a
group whose steps are slow with no tray to blame (``controller.stragglers`` decides; this
module only reads and writes).

A verdict becomes the tray's ``baton.dev/degraded`` annotations and a Warning Event on its Node
(``kubectl describe node`` shows both); the reconciler reads the annotations, keeps new pods off
the tray and moves the group once the move pays (``controller.cell``). A tray already marked is
left as it is, so an operator's own mark is never overwritten, and a mark is never lifted here:
once the group has moved, nothing runs on the tray to judge it by, so an operator clears it
(``kubectl annotate node TRAY baton.dev/degraded-``). Only the leader runs the watch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import httpx
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from baton.core.api import Reason
from baton.core.labels import CONTROLLER_COMPONENT, DEGRADED_ANNOTATION
from baton.core.model import DRAFT, TARGET
from baton.core.profile import Profile
from controller.actions import Event
from controller.observe import rfc3339
from controller.stragglers import (
    GpuClock,
    GroupStep,
    StepWatch,
    StragglerWatch,
    Verdict,
    clock_queries,
    clocks_from,
    degraded_marks,
    expected_step_seconds,
    group_step_from,
    link_culprit,
    link_error_queries,
    link_errors_from,
    step_queries,
)

__all__ = ["GroupKey", "StepReading", "TrayHealthMonitor", "WindowResult"]

log = logging.getLogger("baton.controller")

Obj = dict[str, Any]
# A decode group: namespace, deployment, cell and its trays (a group that moved is a new one).
GroupKey = tuple[str, str, str, tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class StepReading:
    """A decode group's last window: its step over the prediction, and whether the watch finds
    it slow with no tray to blame."""

    slowdown: float
    slow: bool


@dataclass
class WindowResult:
    """What one window found: trays newly marked degraded, and per namespace the Events of
    decode groups newly found slow with no tray of theirs to blame."""

    degraded: list[Verdict] = field(default_factory=list)
    slow_groups: list[tuple[str, Event]] = field(default_factory=list)


class TrayHealthMonitor:
    """One ``StragglerWatch`` and one ``StepWatch`` per decode group, fed one Prometheus window
    every ``window_s``; ``profile``: the performance model's constants for the engines' model
    and GPU, which predict each group's step."""

    def __init__(
        self,
        core: client.CoreV1Api,
        prometheus_url: str,
        *,
        deployments: Callable[[], list[Obj]],
        nodes: Callable[[], list[Obj]],
        profile: Profile,
        window_s: int = 60,
        persist: int = 3,
        min_slowdown: float = 1.25,
        identity: str = "baton-controller",
    ) -> None:
        self.core = core
        self.prometheus = httpx.Client(base_url=prometheus_url.rstrip("/"), timeout=10.0)
        self.deployments, self.nodes = deployments, nodes
        self.profile = profile
        self.window_s, self.persist, self.min_slowdown = window_s, persist, min_slowdown
        self.identity = identity
        self._watches: dict[GroupKey, StragglerWatch] = {}
        self._step_watches: dict[GroupKey, StepWatch] = {}
        # the last window's step per group, for /metrics (``baton_decode_group_slowdown``)
        self.steps: dict[GroupKey, StepReading] = {}
        # trays marked here that the Node informer has not shown marked yet: not marked twice
        self._unseen_marks: set[str] = set()

    def window(self) -> WindowResult:
        """Judge one window of every placed decode group; mark the trays newly found degraded
        and return them with the groups newly found slow. Raises ``httpx.HTTPError`` or
        ``ValueError`` when Prometheus cannot answer: the window then judges nothing."""
        now = time.time()
        groups = {key: deployment for key, deployment in self._groups()}
        self._watches = {
            key: self._watches.get(key) or StragglerWatch(self.persist) for key in groups
        }
        self._step_watches = {
            key: self._step_watches.get(key) or StepWatch(self.persist, self.min_slowdown)
            for key in groups
        }
        seen = {
            node["metadata"]["name"]
            for node in self.nodes()
            if DEGRADED_ANNOTATION in (node["metadata"].get("annotations") or {})
        }
        self._unseen_marks -= seen
        marked = seen | self._unseen_marks
        result = WindowResult()
        steps: dict[GroupKey, StepReading] = {}
        for key, deployment in groups.items():
            trays = list(key[3])
            for verdict in self._watches[key].observe(now, self._clocks(trays)):
                if verdict.tray in marked:
                    continue
                self._mark(verdict, f"{key[0]}/{key[1]} {key[2]}")
                marked.add(verdict.tray)
                result.degraded.append(verdict)
            step = self._step(key, deployment)
            expected = self._expected(step, deployment) if step is not None else None
            slow = self._step_watches[key].observe(now, step, expected)
            # A marked tray of the group explains its steps (its move is under way); else the
            # GPU whose NVLinks fail, if one does.
            if slow is not None and marked.isdisjoint(trays):
                queries = link_error_queries(trays, self.window_s)
                errors = link_errors_from([self._query(query) for query in queries])
                culprit = link_culprit(slow, errors, self.window_s)
                if culprit is not None:
                    self._mark(culprit, f"{key[0]}/{key[1]} {key[2]}")
                    marked.add(culprit.tray)
                    result.degraded.append(culprit)
            unexplained = slow is not None and marked.isdisjoint(trays)
            if step is not None and expected:
                steps[key] = StepReading(step.step_s / expected, unexplained)
            was_slow = key in self.steps and self.steps[key].slow
            if slow is not None and unexplained and not was_slow:
                message = (
                    f"decode group {key[2]}: {slow.message}, for {self.persist} windows of "
                    f"{self.window_s} s; no GPU of it runs below its group's clock or logs "
                    "NVLink errors, so no tray is marked: look for a slow or busy CPU on its "
                    f"trays, and mark the tray with kubectl annotate node TRAY "
                    f"{DEGRADED_ANNOTATION}=WHY to move the group off it"
                )
                event = Event(key[1], "Warning", Reason.DECODE_GROUP_SLOW, message)
                result.slow_groups.append((key[0], event))
        self.steps = steps
        return result

    def _groups(self) -> Iterable[tuple[GroupKey, Obj]]:
        for deployment in self.deployments():
            meta = deployment["metadata"]
            for cell in (deployment.get("status") or {}).get("cells") or []:
                trays = tuple((cell.get("decode") or {}).get("trays") or [])
                if trays:
                    yield (meta["namespace"], meta["name"], cell["name"], trays), deployment

    def _step(self, key: GroupKey, deployment: Obj) -> GroupStep | None:
        queries = step_queries(f"{key[0]}/{key[1]}", key[2], self.window_s)
        step = group_step_from({name: self._query(q) for name, q in queries.items()})
        if step is None or step.target_balance is not None:
            return step
        # No agent-mode figure: the balance the deployment's status reports (plugin mode's)
        balances = (deployment.get("status") or {}).get("eplb") or {}
        return replace(
            step,
            target_balance=(balances.get(TARGET.name) or {}).get("balance"),
            draft_balance=(balances.get(DRAFT.name) or {}).get("balance"),
        )

    def _expected(self, step: GroupStep, deployment: Obj) -> float | None:
        speculative = (deployment.get("spec") or {}).get("speculative") or {}
        return expected_step_seconds(
            self.profile,
            step,
            num_speculative_tokens=int(speculative.get("numSpeculativeTokens") or 0),
        )

    def _clocks(self, trays: list[str]) -> list[GpuClock]:
        clocks, reasons = clock_queries(trays, self.window_s)
        return clocks_from(self._query(clocks), self._query(reasons))

    def _query(self, promql: str) -> list[Obj]:
        response = self.prometheus.get("/api/v1/query", params={"query": promql})
        response.raise_for_status()
        body = response.json()
        if body.get("status") != "success":
            raise ValueError(f"Prometheus refused {promql}: {body.get('error')}")
        result: list[Obj] = body["data"]["result"]
        return result

    def _mark(self, verdict: Verdict, group: str) -> None:
        since = datetime.fromtimestamp(verdict.since, UTC)
        marks = degraded_marks(verdict, since)
        log.warning("tray %s degraded (decode group %s): %s", verdict.tray, group, verdict.message)
        self.core.patch_node(verdict.tray, {"metadata": {"annotations": marks}})
        self._unseen_marks.add(verdict.tray)
        node = next((n for n in self.nodes() if n["metadata"]["name"] == verdict.tray), None)
        stamp = rfc3339(datetime.now(UTC))
        body = client.CoreV1Event.model_validate(
            {
                # Node events live in the default namespace, as the kubelet's do.
                "metadata": {"name": f"{verdict.tray}.{time.time_ns():x}", "namespace": "default"},
                "involvedObject": {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "name": verdict.tray,
                    "uid": (node or {}).get("metadata", {}).get("uid", verdict.tray),
                },
                "type": "Warning",
                "reason": "TrayDegraded",
                "message": (
                    f"{verdict.message}, for {self.persist} windows of {self.window_s} s since "
                    f"{rfc3339(since)}: holds back decode group {group}; marked "
                    f"{DEGRADED_ANNOTATION} (the controller moves the group once that pays)"
                )[:1024],
                "source": {"component": "baton-controller"},
                "firstTimestamp": stamp,
                "lastTimestamp": stamp,
                "count": 1,
                "reportingComponent": CONTROLLER_COMPONENT,
                "reportingInstance": self.identity,
            }
        )
        try:
            self.core.create_namespaced_event("default", body)
        except ApiException as exc:  # the mark is what counts; events are best effort
            log.warning("event TrayDegraded for %s not recorded: %s", verdict.tray, exc.reason)
