"""The test cluster itself: kwok trays labelled as GB300 NVL72 nodes run the pods bound to them,
and the real API server validates ModelDeployments against the generated CRD."""

from __future__ import annotations

from kubernetes import client
from kubernetes.client.rest import ApiException

from baton.core.labels import CLIQUE_LABEL
from rigs.devcluster import (
    KWOK_ANNOTATION,
    create_model_deployment,
    install_crd,
    node_ready,
    read_model_deployment,
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


def test_kwok_tray_runs_a_pod_that_requests_its_gpus(api, namespace) -> None:
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


def test_api_server_rejects_an_invalid_model_deployment(api, namespace) -> None:
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
