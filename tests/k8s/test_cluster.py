"""The test cluster itself: kwok trays labelled as GB300 NVL72 nodes run the pods bound to them,
and the real API server validates ModelDeployments against the generated CRD."""

from __future__ import annotations

import json
import subprocess

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from baton.core.labels import CLIQUE_LABEL
from rigs.devcluster import (
    KWOK_ANNOTATION,
    ControlPlane,
    add_trays,
    binaries_dir,
    create_model_deployment,
    install_crd,
    node_ready,
    read_model_deployment,
    remove_nodes,
)
from rigs.processes import eventually


def fake_tray(name: str, clique: str) -> client.V1Node:
    return client.V1Node(
        metadata=client.V1ObjectMeta(
            name=name,
            annotations={KWOK_ANNOTATION: "fake"},
            labels={
                CLIQUE_LABEL: clique,
                "nvidia.com/gpu.product": "NVIDIA-GB300",
                "kubernetes.io/hostname": name,
                "type": "kwok",
            },
        ),
        spec=client.V1NodeSpec(taints=[]),
        status=client.V1NodeStatus(
            allocatable={"cpu": "72", "memory": "900Gi", "pods": "110", "nvidia.com/gpu": "4"},
            capacity={"cpu": "72", "memory": "900Gi", "pods": "110", "nvidia.com/gpu": "4"},
        ),
    )


# kube-controller-manager marks a node whose kubelet neither updated its status nor renewed its
# Lease within --node-monitor-grace-period (50 s by default in v1.37) NotReady, checking every
# --node-monitor-period (5 s); a watch held past both, with margin, sees any such flip.
HOLD_SECONDS = 50 + 5 + 20


def _ready_condition(node: client.V1Node) -> tuple[str | None, object]:
    conditions = node.status.conditions if node.status else None
    ready = next((c for c in conditions or [] if c.type == "Ready"), None)
    return (ready.status, ready.last_transition_time) if ready else (None, None)


def test_kwok_trays_stay_ready_past_the_node_monitor_grace_period(
    api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api)
    nodes = add_trays(api, 1, trays_per_rack=2, name_prefix=f"{namespace}-")
    names = {node["metadata"]["name"] for node in nodes}
    try:
        listed = core.list_node()
        before = {
            n.metadata.name: _ready_condition(n)
            for n in listed.items
            if n.metadata and n.metadata.name in names
        }
        assert {status for status, _ in before.values()} == {"True"}
        assert listed.metadata is not None  # a list always carries its resourceVersion
        # Every change to a node arrives on the watch, even one kwok reverts within milliseconds.
        seen: list[tuple[str, str | None]] = []
        for event in watch.Watch().stream(
            core.list_node,
            resource_version=listed.metadata.resource_version,
            timeout_seconds=HOLD_SECONDS,
            _request_timeout=HOLD_SECONDS + 30,
        ):
            node = event["object"]
            if node.metadata.name in names:
                seen.append((node.metadata.name, _ready_condition(node)[0]))
        assert [(name, status) for name, status in seen if status != "True"] == []
        after = {name: _ready_condition(core.read_node(name)) for name in names}
        assert after == before
        leases = client.CoordinationV1Api(api).list_namespaced_lease("kube-node-lease").items
        assert names <= {lease.metadata.name for lease in leases if lease.metadata}
    finally:
        remove_nodes(api, nodes)


def test_the_api_server_reports_its_release_and_kubectl_talks_to_it(
    api: client.ApiClient, control_plane: ControlPlane
) -> None:
    info = client.VersionApi(api).get_code()
    assert (info.git_version, info.major, info.minor) == ("v1.37.2", "1", "37")
    shown = subprocess.run(
        [
            str(binaries_dir() / "kubectl"),
            f"--kubeconfig={control_plane.kubeconfig}",
            "version",
            "--output=json",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    versions = json.loads(shown.stdout)
    assert versions["clientVersion"]["gitVersion"] == "v1.37.2"
    assert versions["serverVersion"]["gitVersion"] == "v1.37.2"


def test_kwok_tray_runs_a_pod_that_requests_its_gpus(api: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(api)
    core.create_node(fake_tray("tray-t0", "cluster-a.0"))
    try:
        eventually(lambda: node_ready(core.read_node("tray-t0")), timeout=60)
        pod = client.V1Pod(
            metadata=client.V1ObjectMeta(name="decode-0"),
            spec=client.V1PodSpec(
                node_selector={"kubernetes.io/hostname": "tray-t0"},
                containers=[
                    client.V1Container(
                        name="engine",
                        image="baton:dev",
                        resources=client.V1ResourceRequirements(
                            requests={"nvidia.com/gpu": "4"}, limits={"nvidia.com/gpu": "4"}
                        ),
                    )
                ],
            ),
        )
        core.create_namespaced_pod(namespace, pod)

        def running() -> bool:
            status = core.read_namespaced_pod("decode-0", namespace).status
            return status is not None and status.phase == "Running" and bool(status.pod_ip)

        eventually(running, timeout=60)
    finally:
        core.delete_node("tray-t0")


def test_api_server_rejects_an_invalid_model_deployment(
    api: client.ApiClient, namespace: str
) -> None:
    install_crd(api)
    try:
        create_model_deployment(api, namespace, "dsv4", {"cells": -1})
    except ApiException as exc:
        assert exc.status == 422 and exc.body is not None
        assert "spec.model: Required value" in exc.body
        assert "spec.cells" in exc.body
    else:
        raise AssertionError("the API server accepted a ModelDeployment without spec.model")
    create_model_deployment(api, namespace, "dsv4", {"model": "deepseek-ai/DeepSeek-V4.1-Flash"})
    stored = read_model_deployment(api, namespace, "dsv4")
    assert stored["spec"]["cells"] == 1  # defaulted by the API server from the CRD
