"""A placed cell's rendered pods on a real API server, scheduler and kwok trays: once the cell's
gates are lifted together, every pod runs on its planned tray."""

from __future__ import annotations

from kubernetes import client

from baton.core.api import ModelDeployment
from controller.placement import DeploymentShape, plan_placement
from controller.podspec import render_cell
from controller.topology import parse_topology
from rigs.devcluster import add_trays, create_model_deployment, install_crd, remove_nodes
from rigs.processes import eventually


def phase_of(pod: client.V1Pod) -> str | None:
    return pod.status.phase if pod.status else None


def node_of(pod: client.V1Pod) -> str | None:
    return pod.spec.node_name if pod.spec else None


def test_gated_cell_pods_run_on_their_planned_trays_once_lifted(
    api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api)
    nodes = add_trays(api, 1, name_prefix=f"{namespace}-")
    try:
        install_crd(api)
        spec = {"model": "deepseek-ai/DeepSeek-V4.1-Flash", "cell": {"prefill": {"instances": 4}}}
        created = create_model_deployment(api, namespace, "dsv4", spec)
        deployment = ModelDeployment.model_validate(created)
        plan = plan_placement([DeploymentShape.of(deployment)], parse_topology({"items": nodes}))
        cell = plan.cells[0]
        manifests = render_cell(
            deployment.spec,
            cell,
            deployment="dsv4",
            uid=created["metadata"]["uid"],
            namespace=namespace,
        )
        # The models the client would validate these dicts into itself: the requests are the same.
        core.create_namespaced_service(namespace, client.V1Service.model_validate(manifests[0]))
        pod_names = []
        for pod in manifests[1:]:
            core.create_namespaced_pod(namespace, client.V1Pod.model_validate(pod))
            pod_names.append(pod["metadata"]["name"])
        # gated: created, not scheduled
        assert all(node_of(core.read_namespaced_pod(n, namespace)) is None for n in pod_names)
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
                if phase_of(pod) != "Running" or node_of(pod) != planned[name]:
                    return False
            return True

        try:
            eventually(all_running_where_planned, timeout=120, interval=0.5)
        except TimeoutError:
            states = {
                n: (
                    phase_of(p),
                    node_of(p),
                    planned[n],
                    [(c.type, c.reason, c.message) for c in p.status.conditions or []]
                    if p.status
                    else [],
                )
                for n in pod_names
                for p in [core.read_namespaced_pod(n, namespace)]
            }
            raise AssertionError(f"pods not running where planned: {states}") from None
        assert len(pod_names) == 8 + 4
    finally:
        remove_nodes(api, nodes)
