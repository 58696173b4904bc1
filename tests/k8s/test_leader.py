"""Two `baton controller` replicas share one Lease: one reconciles; when it dies, the other
takes the Lease once it expires and carries on."""

from __future__ import annotations

import signal
from typing import Any

from kubernetes import client

from rigs.devcluster import ControlPlane, pods, start_controller
from rigs.processes import eventually, stop_process
from tests.k8s.helpers import apply, controller_log, wait_ready

LEASE = "baton-controller-failover"


def holder(api: client.ApiClient) -> str | None:
    lease = client.CoordinationV1Api(api).read_namespaced_lease(LEASE, "default")
    return lease.spec.holder_identity if lease.spec else None


def test_standby_takes_over_when_the_leader_dies(
    api: client.ApiClient, namespace: str, rack: list[dict[str, Any]], control_plane: ControlPlane
) -> None:
    first = start_controller(control_plane, "replica-a", LEASE)
    try:
        eventually(lambda: holder(api) == "replica-a", timeout=30)
        second = start_controller(control_plane, "replica-b", LEASE)
        try:
            apply(api, namespace, "dsv4", {"cell": {"prefill": {"instances": 2}}})
            wait_ready(api, namespace, "dsv4")
            assert holder(api) == "replica-a"
            first.send_signal(signal.SIGKILL)  # no release: the Lease must expire
            first.wait()
            eventually(lambda: holder(api) == "replica-b", timeout=40, interval=0.5)
            client.CoreV1Api(api).delete_namespaced_pod("dsv4-cell-0-prefill-1", namespace)
            old = pods(api, namespace)["dsv4-cell-0-prefill-0"].metadata.uid

            def recreated() -> bool:
                prefill = pods(api, namespace, "prefill")
                return "dsv4-cell-0-prefill-1" in prefill and all(
                    p.status.phase == "Running" for p in prefill.values()
                )

            eventually(recreated, timeout=30, interval=0.25)
            wait_ready(api, namespace, "dsv4")
            assert pods(api, namespace)["dsv4-cell-0-prefill-0"].metadata.uid == old
            assert "replica-b leads" in controller_log(control_plane, "replica-b")
        finally:
            stop_process(second)
        assert "released the lease" in controller_log(control_plane, "replica-b")
    finally:
        stop_process(first)
