"""The straggler watch on a running rack: dcgm-exporter's clocks from Prometheus, window after
window, for every decode group the ModelDeployments' status places, and a mark on each tray the
watch finds degraded (``controller.stragglers`` decides; this module only reads and writes).

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
from datetime import UTC, datetime
from typing import Any

import httpx
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from baton.core.labels import CONTROLLER_COMPONENT, DEGRADED_ANNOTATION
from controller.observe import rfc3339
from controller.stragglers import (
    Degraded,
    GpuClock,
    StragglerWatch,
    clock_queries,
    clocks_from,
    degraded_marks,
)

__all__ = ["TrayHealthMonitor"]

log = logging.getLogger("baton.controller")

Obj = dict[str, Any]


class TrayHealthMonitor:
    """One ``StragglerWatch`` per decode group (namespace, deployment, cell and its trays: a
    group that moved starts a new watch), fed one Prometheus window every ``window_s``."""

    def __init__(
        self,
        core: client.CoreV1Api,
        prometheus_url: str,
        *,
        deployments: Callable[[], list[Obj]],
        nodes: Callable[[], list[Obj]],
        window_s: int = 60,
        persist: int = 3,
        identity: str = "baton-controller",
    ) -> None:
        self.core = core
        self.prometheus = httpx.Client(base_url=prometheus_url.rstrip("/"), timeout=10.0)
        self.deployments, self.nodes = deployments, nodes
        self.window_s, self.persist = window_s, persist
        self.identity = identity
        self._watches: dict[tuple[str, str, str, tuple[str, ...]], StragglerWatch] = {}

    def window(self) -> list[Degraded]:
        """Judge one window of every placed decode group; mark and return the trays newly found
        degraded. Raises ``httpx.HTTPError`` or ``ValueError`` when Prometheus cannot answer:
        the window then judges nothing."""
        now = time.time()
        groups = dict(self._groups())
        self._watches = {
            key: self._watches.get(key) or StragglerWatch(self.persist) for key in groups
        }
        marked = {
            node["metadata"]["name"]
            for node in self.nodes()
            if DEGRADED_ANNOTATION in (node["metadata"].get("annotations") or {})
        }
        found: list[Degraded] = []
        for key, trays in groups.items():
            for verdict in self._watches[key].observe(now, self._clocks(trays)):
                if verdict.tray in marked:
                    continue
                self._mark(verdict, f"{key[0]}/{key[1]} {key[2]}")
                marked.add(verdict.tray)
                found.append(verdict)
        return found

    def _groups(self) -> Iterable[tuple[tuple[str, str, str, tuple[str, ...]], list[str]]]:
        for deployment in self.deployments():
            meta = deployment["metadata"]
            for cell in (deployment.get("status") or {}).get("cells") or []:
                trays = list((cell.get("decode") or {}).get("trays") or [])
                if trays:
                    key = (meta["namespace"], meta["name"], cell["name"], tuple(trays))
                    yield key, trays

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

    def _mark(self, verdict: Degraded, group: str) -> None:
        since = datetime.fromtimestamp(verdict.since, UTC)
        marks = degraded_marks(verdict, since)
        log.warning("tray %s degraded (decode group %s): %s", verdict.tray, group, verdict.message)
        self.core.patch_node(verdict.tray, {"metadata": {"annotations": marks}})
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
