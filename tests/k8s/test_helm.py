"""The Helm chart: lint, a clear failure without its one required value, every rendered object
accepted by the real API server, its RBAC enough for the controller to run a deployment as its
ServiceAccount, no more for the gateway than reading ModelDeployments and for the EPLB service
than that and writing their status; its EPLB configuration accepted by the service."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client, utils
from kubernetes.client.rest import ApiException

from eplb.cli import build_parser as eplb_parser
from eplb.config import load_config
from rigs.devcluster import ROOT, ControlPlane, binaries_dir, write_kubeconfig
from rigs.processes import stop_process
from tests.k8s.helpers import apply, controller_log, start_controller, wait_ready

CHART = ROOT / "helm" / "baton"


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binaries_dir() / "helm"), *args], capture_output=True, text=True, check=False
    )


def test_chart_lints_and_names_its_required_value() -> None:
    linted = helm("lint", str(CHART), "--set", "gateway.modelDeployment=serving/dsv4")
    assert linted.returncode == 0, linted.stdout + linted.stderr
    missing = helm("template", "baton", str(CHART))
    assert missing.returncode != 0
    assert "gateway.modelDeployment: set it to NAMESPACE/NAME" in missing.stderr


@pytest.fixture
def release(api: client.ApiClient, namespace: str) -> Iterator[list[dict]]:
    """The chart rendered into ``namespace`` (no replicas: nothing here runs images) and
    created object by object on the API server; cluster-wide objects removed afterwards."""
    rendered = helm(
        "template",
        f"b-{namespace}",
        str(CHART),
        "--namespace",
        namespace,
        "--set",
        f"gateway.modelDeployment={namespace}/dsv4,controller.replicas=0,gateway.replicas=0",
    )
    assert rendered.returncode == 0, rendered.stderr
    objects = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
    for obj in objects:
        utils.create_from_dict(api, obj, namespace=namespace)
    yield objects
    rbac = client.RbacAuthorizationV1Api(api)
    for obj in objects:
        try:
            if obj["kind"] == "ClusterRole":
                rbac.delete_cluster_role(obj["metadata"]["name"])
            elif obj["kind"] == "ClusterRoleBinding":
                rbac.delete_cluster_role_binding(obj["metadata"]["name"])
        except ApiException as exc:
            if exc.status != 404:
                raise


def token_for(api: client.ApiClient, namespace: str, account: str) -> str:
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=["https://kubernetes.default.svc"])
    )
    issued = client.CoreV1Api(api).create_namespaced_service_account_token(
        account, namespace, request
    )
    assert issued.status is not None and issued.status.token is not None  # what was requested
    return issued.status.token


def allowed(api: client.ApiClient, token: str, attributes: client.V1ResourceAttributes) -> bool:
    """What the holder of ``token`` may do, as the API server decides it."""
    authenticated = client.AuthenticationV1Api(api).create_token_review(
        client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token))
    )
    user = authenticated.status.user if authenticated.status else None
    assert user is not None, f"token not authenticated: {authenticated.status}"
    review = client.V1SubjectAccessReview(
        spec=client.V1SubjectAccessReviewSpec(
            resource_attributes=attributes,
            user=user.username,
            groups=["system:serviceaccounts"],
        )
    )
    decision = client.AuthorizationV1Api(api).create_subject_access_review(review).status
    assert decision is not None  # the API server answers every review with its decision
    return decision.allowed


def test_controller_runs_a_deployment_with_the_charts_rbac_alone(
    api, namespace, rack, release, control_plane: ControlPlane, tmp_path: Path
) -> None:
    kinds = sorted({obj["kind"] for obj in release})
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "Deployment",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    ]
    account = f"b-{namespace}-baton-controller"
    kubeconfig = write_kubeconfig(
        control_plane, tmp_path / "controller.kubeconfig", token_for(api, namespace, account)
    )
    process = start_controller(
        control_plane,
        f"sa-{namespace}",
        "baton-controller",
        kubeconfig=kubeconfig,
        lease_namespace=namespace,
    )
    try:
        apply(api, namespace, "dsv4", {"cell": {"prefill": {"instances": 2}}})
        wait_ready(api, namespace, "dsv4")
    finally:
        stop_process(process)
    log = controller_log(control_plane, f"sa-{namespace}")
    assert "Forbidden" not in log and "Traceback" not in log

    gateway = token_for(api, namespace, f"b-{namespace}-baton-gateway")
    deployments = client.V1ResourceAttributes(
        group="baton.dev", resource="modeldeployments", verb="watch", namespace=namespace
    )
    pods = client.V1ResourceAttributes(resource="pods", verb="create", namespace=namespace)
    assert allowed(api, gateway, deployments)
    assert not allowed(api, gateway, pods)
    eplb = token_for(api, namespace, f"b-{namespace}-baton-eplb")
    status = client.V1ResourceAttributes(
        group="baton.dev",
        resource="modeldeployments",
        subresource="status",
        verb="patch",
        namespace=namespace,
    )
    assert allowed(api, eplb, deployments) and allowed(api, eplb, status)
    assert not allowed(api, gateway, status) and not allowed(api, eplb, pods)

    # The EPLB service's configuration as rendered is one it accepts.
    [config_map] = [obj for obj in release if obj["kind"] == "ConfigMap"]
    config = tmp_path / "eplb.yaml"
    config.write_text(config_map["data"]["eplb.yaml"])
    assert load_config(config).apply_margin_steps == 50

    # The EPLB service's command line parses, and its Service reaches the engines' reports.
    [service_deployment] = [
        obj
        for obj in release
        if obj["kind"] == "Deployment" and obj["metadata"]["name"].endswith("-eplb")
    ]
    [container] = service_deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["baton", "eplb"]
    args = eplb_parser().parse_args(container["args"])
    [service] = [
        obj
        for obj in release
        if obj["kind"] == "Service" and obj["metadata"]["name"].endswith("-eplb")
    ]
    ports = {port["name"]: port["port"] for port in service["spec"]["ports"]}
    assert ports["reports"] == args.report_port and args.report_host == "0.0.0.0"
