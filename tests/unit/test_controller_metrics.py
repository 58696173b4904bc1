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


def test_placements_restarts_and_quarantines_are_counted_per_deployment_from_their_events() -> None:
    registry = CollectorRegistry()
    metrics = ControllerMetrics(registry)
    metrics.count(
        "serving",
        [
            Event("dsv4", "Normal", Reason.PLACED, "dsv4-0 placed"),
            Event("dsv4", "Normal", Reason.PLACED, "dsv4-1 placed"),
            Event("dsv4", "Warning", Reason.GROUP_RESTARTING, "decode group of dsv4-0 restarts"),
            Event("small", "Warning", Reason.TRAY_QUARANTINED, "tray-3: 3 failures"),
            Event("dsv4", "Warning", Reason.PODS_PENDING, "not an action: not counted"),
        ],
    )
    where = {"namespace": "serving", "deployment": "dsv4"}
    value = registry.get_sample_value
    assert value("baton_controller_placements_total", where) == 2
    assert value("baton_controller_group_restarts_total", where) == 1
    assert value("baton_controller_tray_quarantines_total", where) is None
    assert value("baton_controller_tray_quarantines_total", {**where, "deployment": "small"}) == 1
    # both outcomes exist before the first error, so an error rate is 0 rather than no data
    assert value("baton_controller_reconciles_total", {"outcome": "error"}) == 0


def test_each_condition_exports_one_series_per_status_one_for_the_status_it_has() -> None:
    registry = CollectorRegistry()
    cache = [
        deployment("serving", "dsv4", Placed="True", Ready="False", Degraded="True"),
        {"metadata": {"namespace": "serving", "name": "new"}},  # no status yet
    ]
    ControllerMetrics(registry).watch_conditions(registry, lambda: cache)

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
