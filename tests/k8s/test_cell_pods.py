"""A placed cell's rendered pods on a real API server, scheduler and kwok trays: once the cell's
gates are lifted together, every pod runs on its planned tray."""

from __future__ import annotations

import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from baton.api import ModelDeployment
from baton.crd import CRD_PATH
from baton.processes import eventually
from baton.topology import parse_topology, synthetic_nodes
from controller.placement import plan_placement
from controller.podspec import render_cell
from tests.k8s.cluster import KWOK_ANNOTATION, ROOT

TRAY_RESOURCES = {"cpu": "144", "memory": "960Gi", "pods": "110"}


def install_crd(api: client.ApiClient) -> None:
    extensions = client.ApiextensionsV1Api(api)
    crd = yaml.safe_load((ROOT / CRD_PATH).read_text())
    try:
        extensions.create_custom_resource_definition(crd)
    except ApiException as exc:
        if exc.status != 409:
            raise
    eventually(
        lambda: (
            extensions.read_custom_resource_definition(
                crd["metadata"]["name"]
            ).status.accepted_names.kind
            == "ModelDeployment"
        ),
        timeout=30,
    )


def test_gated_cell_pods_run_on_their_planned_trays_once_lifted(api, namespace) -> None:
    core = client.CoreV1Api(api)
    nodes = synthetic_nodes(1)
    for node in nodes:
        node["metadata"]["annotations"][KWOK_ANNOTATION] = "fake"  # type: ignore[index]
        # what a GB300 tray's kubelet reports beside its GPUs
        status = node.setdefault("status", {})
        for field in ("allocatable", "capacity"):
            status.setdefault(field, {}).update(TRAY_RESOURCES)  # type: ignore[union-attr]
        core.create_node(node)
    try:
        names = [node["metadata"]["name"] for node in nodes]  # type: ignore[index]
        eventually(
            lambda: all(
                any(
                    c.type == "Ready" and c.status == "True"
                    for c in core.read_node(n).status.conditions or []
                )
                for n in names
            ),
            timeout=90,
        )
        install_crd(api)
        manifest = {
            "apiVersion": "baton.dev/v1alpha1",
            "kind": "ModelDeployment",
            "metadata": {"name": "dsv4"},
            "spec": {
                "model": "deepseek-ai/DeepSeek-V4.1-Flash",
                "cell": {"prefill": {"instances": 4}},
            },
        }
        created = client.CustomObjectsApi(api).create_namespaced_custom_object(
            "baton.dev", "v1alpha1", namespace, "modeldeployments", manifest
        )
        deployment = ModelDeployment.model_validate(manifest)
        plan = plan_placement([deployment.shape()], parse_topology({"items": nodes}))
        cell = plan.cells[0]
        manifests = render_cell(
            deployment.spec,
            cell,
            deployment="dsv4",
            uid=created["metadata"]["uid"],
            namespace=namespace,
        )
        core.create_namespaced_service(namespace, manifests[0])
        pod_names = []
        for pod in manifests[1:]:
            core.create_namespaced_pod(namespace, pod)
            pod_names.append(pod["metadata"]["name"])
        # gated: created, not scheduled
        assert all(core.read_namespaced_pod(n, namespace).spec.node_name is None for n in pod_names)
        lift = [{"op": "replace", "path": "/spec/schedulingGates", "value": []}]  # JSON patch
        for name in pod_names:
            core.patch_namespaced_pod(name, namespace, lift)
        planned = {
            pod["metadata"]["name"]: pod["spec"]["affinity"]["nodeAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"
            ]["nodeSelectorTerms"][0]["matchExpressions"][0]["values"][0]
            for pod in manifests[1:]
        }

        def all_running_where_planned() -> bool:
            for name in pod_names:
                pod = core.read_namespaced_pod(name, namespace)
                if pod.status.phase != "Running" or pod.spec.node_name != planned[name]:
                    return False
            return True

        try:
            eventually(all_running_where_planned, timeout=120, interval=0.5)
        except TimeoutError:
            states = {
                n: (
                    p.status.phase,
                    p.spec.node_name,
                    planned[n],
                    [(c.type, c.reason, c.message) for c in p.status.conditions or []],
                )
                for n in pod_names
                for p in [core.read_namespaced_pod(n, namespace)]
            }
            raise AssertionError(f"pods not running where planned: {states}") from None
        assert len(pod_names) == 8 + 4
    finally:
        for node in nodes:
            core.delete_node(node["metadata"]["name"])  # type: ignore[index]
