"""The controller's metrics: the actions its events announce, counted, and every
ModelDeployment's conditions as kube-state-metrics would export them."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from baton.core.api import Reason
from controller.actions import Event
from controller.reconciler import ControllerMetrics


def deployment(namespace: str, name: str, **conditions: str) -> dict[str, Any]:
    return {
        "metadata": {"namespace": namespace, "name": name},
        "status": {
            "conditions": [{"type": kind, "status": status} for kind, status in conditions.items()]
        },
    }


def test_placements_restarts_and_quarantines_are_counted_from_their_events() -> None:
    registry = CollectorRegistry()
    metrics = ControllerMetrics(registry)
    value = registry.get_sample_value
    # every counter exists at 0 before its first action, so the first one is a rate
    assert value("baton_controller_placements_total") == 0
    assert value("baton_controller_tray_quarantines_total") == 0
    assert value("baton_controller_reconciles_total", {"outcome": "error"}) == 0
    metrics.count(
        [
            Event("dsv4", "Normal", Reason.PLACED, "dsv4-0 placed"),
            Event("dsv4", "Normal", Reason.PLACED, "dsv4-1 placed"),
            Event("dsv4", "Warning", Reason.GROUP_RESTARTING, "decode group of dsv4-0 restarts"),
            Event("small", "Warning", Reason.TRAY_QUARANTINED, "tray-3: 3 failures"),
            Event("dsv4", "Warning", Reason.PODS_PENDING, "not an action: not counted"),
        ],
    )
    assert value("baton_controller_placements_total") == 2
    assert value("baton_controller_group_restarts_total") == 1
    assert value("baton_controller_tray_quarantines_total") == 1


def test_each_condition_exports_one_series_per_status_one_for_the_status_it_has() -> None:
    registry = CollectorRegistry()
    cache = [
        deployment("serving", "dsv4", Placed="True", Ready="False", Degraded="True"),
        {"metadata": {"namespace": "serving", "name": "new"}},  # no status yet
    ]
    ControllerMetrics(registry).watch_status(registry, lambda: cache)

    def condition(kind: str, status: str, name: str = "dsv4") -> float | None:
        labels = {"namespace": "serving", "name": name, "type": kind, "status": status}
        return registry.get_sample_value("baton_modeldeployment_condition", labels)

    assert condition("Degraded", "true") == 1
    assert condition("Degraded", "false") == condition("Degraded", "unknown") == 0
    assert condition("Ready", "false") == 1 and condition("Ready", "true") == 0
    assert condition("Placed", "true", name="new") is None
    # read at scrape time: the cache as it is now
    cache[0] = deployment("serving", "dsv4", Placed="True", Ready="True", Degraded="False")
    assert condition("Degraded", "true") == 0 and condition("Ready", "true") == 1
    assert b"# TYPE baton_modeldeployment_condition gauge" in generate_latest(registry)


def test_each_deployment_exports_its_cells_wanted_and_ready_from_its_status() -> None:
    registry = CollectorRegistry()
    serving = deployment("serving", "dsv4", Ready="False")
    serving["status"]["ready"] = "1/2"
    cache = [serving, {"metadata": {"namespace": "serving", "name": "new"}}]  # no status yet
    ControllerMetrics(registry).watch_status(registry, lambda: cache)

    def cells(state: str, name: str = "dsv4") -> float | None:
        labels = {"namespace": "serving", "name": name, "state": state}
        return registry.get_sample_value("baton_modeldeployment_cells", labels)

    assert (cells("wanted"), cells("ready")) == (2, 1)
    assert cells("wanted", name="new") is None  # not judged yet: no series, no alert
