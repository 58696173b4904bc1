"""The Helm chart: lint, a clear failure without its one required value, every rendered object
accepted by the real API server, its RBAC enough for the controller to run a deployment as its
ServiceAccount, no more for the gateway than reading ModelDeployments and for the EPLB service
than that and writing their status; its EPLB configuration accepted by the service; its Ray
Serve mode a RayService (KubeRay's CRD) that serves ``router.serve:app`` with arguments the app
accepts."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from kubernetes import client, utils
from kubernetes.client.exceptions import ApiException

from baton.cli import COMMANDS
from baton.core.api import GROUP, PLURAL, ModelDeployment
from baton.core.crd import CRD_PATH
from baton.core.follow import DeploymentRef
from baton.core.kube import json_object
from baton.core.labels import CELL_LABEL, DEPLOYMENT_LABEL, ROLE_LABEL
from baton.core.profile import shipped_profiles
from controller.cli import build_parser as controller_parser
from controller.placement import DeploymentShape, plan_placement
from controller.podspec import render_cell
from controller.topology import synthetic_topology
from deploy.grafana.dashboards import DASHBOARDS, RULES
from deploy.grafana.dashboards import OUT as DASHBOARDS_OUT
from eplb.cli import build_parser as eplb_parser
from eplb.config import load_config
from rigs.devcluster import (
    ROOT,
    ControlPlane,
    add_cpu_nodes,
    binaries_dir,
    fail_pod,
    install_crd,
    patch_model_deployment_spec,
    pods,
    remove_nodes,
    start_controller,
    write_kubeconfig,
)
from rigs.processes import eventually, free_port, stop_process
from router.cli import build_parser as gateway_parser
from router.policy import PrefillPolicy
from router.settings import GatewaySettings
from tests.helpers import SimHandle
from tests.k8s.helpers import apply, compute_domains_served, controller_log, read, wait_ready

# Ray's own pydantic models use deprecated Field arguments: not ours to fix, and not an error here.
RAY_WARNINGS = "ignore::DeprecationWarning:ray"
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=DeprecationWarning, module="ray")
    from ray.serve.schema import ServeDeploySchema

    import router.serve

CHART = ROOT / "helm" / "baton"
RAY_SERVE_EXAMPLE = CHART / "examples" / "ray-serve.yaml"
# deploy/dev/build.sh copies it from KubeRay's Go module beside the binaries.
RAY_SERVICE_CRD = "ray.io_rayservices.yaml"
# and the Prometheus Operator's CRDs from its module, into monitoring-crds/
MONITORING_PLURALS = {
    "ServiceMonitor": "servicemonitors",
    "PodMonitor": "podmonitors",
    "PrometheusRule": "prometheusrules",
}
MONITORING_ON = (
    "monitoring.serviceMonitor.enabled=true,monitoring.podMonitor.enabled=true,"
    "monitoring.prometheusRule.enabled=true,monitoring.dashboards.enabled=true,"
    "monitoring.serviceMonitor.labels.release=kps,monitoring.prometheusRule.labels.release=kps"
)


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binaries_dir() / "helm"), *args], capture_output=True, text=True, check=False
    )


def test_chart_lints_and_names_its_required_value() -> None:
    linted = helm("lint", str(CHART), "--set", "gateway.modelDeployments={serving/dsv4}")
    assert linted.returncode == 0, linted.stdout + linted.stderr
    missing = helm("template", "baton", str(CHART))
    assert missing.returncode != 0
    assert "gateway.modelDeployments: list the NAMESPACE/NAME of each" in missing.stderr


def test_an_install_for_a_namespace_that_does_not_exist_fails_before_creating_anything(
    api: client.ApiClient, namespace: str, control_plane: ControlPlane
) -> None:
    # Seen following the docs: the chart's Roles for the gateway and the EPLB service go in the
    # ModelDeployment's namespace, created after the install, so the install failed four times
    # on "namespaces not found" and left a failed release with its pods running.
    kubeconfig = str(control_plane.kubeconfig)
    release = f"n-{namespace}"
    installed = helm(
        "install",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--kubeconfig",
        kubeconfig,
        "--set",
        "gateway.modelDeployments={not-created/dsv4},crds.install=false",
    )
    assert installed.returncode != 0
    assert (
        "namespace not-created (of a ModelDeployment the gateway serves) does not exist: create "
        "it first "
        "(kubectl create namespace not-created)" in installed.stderr
    ), installed.stderr
    listed = helm("list", "--all", "--namespace", namespace, "--kubeconfig", kubeconfig, "-q")
    assert release not in listed.stdout
    assert not client.AppsV1Api(api).list_namespaced_deployment(namespace).items
    # without a cluster (helm template, lint) the chart renders as before
    assert (
        helm("template", "baton", str(CHART), "--set", "gateway.modelDeployments={x/y}").returncode
        == 0
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("controller.replicas=two", "at '/controller/replicas': got string, want integer"),
        ("gateway.polcy=affinity", "additional properties 'polcy' not allowed"),
        ("gateway.settings.policy=random", "at '/gateway/settings/policy'"),
        (
            "gateway.settings.prefill_timeout=60",
            "additional properties 'prefill_timeout' not allowed",
        ),
        ("gateway.workers=0", "at '/gateway/workers'"),
        ("gateway.modelDeployments={dsv4}", "at '/gateway/modelDeployments/0'"),
        ("gateway.modelDeployment=serving/dsv4", "additional properties 'modelDeployment' not"),
        ("eplb.reportPort=70000", "at '/eplb/reportPort'"),
        ("image.pullPolicy=Sometimes", "at '/image/pullPolicy'"),
        ("gateway.rayService.enable=true", "additional properties 'enable' not allowed"),
        ("gateway.rayService.head.replicas=2", "additional properties 'replicas' not allowed"),
        ("controller.stragglers.stepSlowdown=1", "at '/controller/stragglers/stepSlowdown'"),
        (
            "controller.stragglers.performanceProfile=h100",
            "at '/controller/stragglers/performanceProfile'",
        ),
    ],
)
def test_the_values_schema_refuses_a_wrong_value_naming_it(value: str, message: str) -> None:
    rendered = helm(
        "template",
        "baton",
        str(CHART),
        "--set",
        "gateway.modelDeployments={serving/dsv4}",
        "--set",
        value,
    )
    assert rendered.returncode != 0
    assert message in rendered.stderr, rendered.stderr


def test_the_straggler_watch_is_given_its_bound_and_one_of_the_shipped_profiles() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    stragglers = schema["properties"]["controller"]["properties"]["stragglers"]["properties"]
    assert stragglers["performanceProfile"]["enum"] == shipped_profiles()
    [controller] = [
        o
        for o in render(
            "b",
            "--set",
            "gateway.modelDeployments={serving/dsv4},"
            "controller.stragglers.prometheusUrl=http://prometheus:9090",
            "--set-json",
            "controller.stragglers.stepSlowdown=1.5",
        )
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "b-baton-controller"
    ]
    args = controller["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--straggler-step-slowdown=1.5" in args
    assert "--performance-profile=deepseek-v4.1-flash-gb300" in args


def helm_test_pod(*values: str) -> dict[str, Any]:
    """The chart's ``helm test`` pod for release ``b``, with ``values`` set."""
    sets = [arg for value in values for arg in ("--set", value)]
    rendered = helm(
        "template",
        "b",
        str(CHART),
        "--set",
        "gateway.modelDeployments={serving/dsv4}",
        *sets,
        "--show-only",
        "templates/tests/gateway.yaml",
    )
    assert rendered.returncode == 0, rendered.stderr
    pod: dict[str, Any] = yaml.safe_load(rendered.stdout)
    return pod


def test_the_helm_test_pods_check_passes_against_a_running_gateway_and_fails_without_one(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> None:
    pod = helm_test_pod()
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    [container] = pod["spec"]["containers"]
    assert container["command"][:2] == ["python", "-c"]
    script = container["command"][2]
    in_cluster = "http://b-baton-gateway:8000"
    assert in_cluster in script
    engine = start_sim("--served-model-name", "dsv4")
    gateway = start_gateway("--decode", engine.url)

    def check(url: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", script.replace(in_cluster, url)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    eventually(lambda: check(gateway.url).returncode == 0, timeout=30)
    assert "serving dsv4" in check(gateway.url).stdout
    assert check(f"http://127.0.0.1:{free_port()}").returncode != 0


def test_the_helm_test_pod_sends_one_of_the_gateways_api_keys_from_its_secret(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> None:
    [container] = helm_test_pod("gateway.apiKeySecret.name=gateway-keys")["spec"]["containers"]
    [keys] = container["env"]
    assert keys == {
        "name": "BATON_API_KEYS",
        "valueFrom": {"secretKeyRef": {"name": "gateway-keys", "key": "api-keys"}},
    }
    script = container["command"][2]
    engine = start_sim("--served-model-name", "dsv4")
    gateway = start_gateway("--decode", engine.url, "--api-key", "k-1", "--api-key", "k-2")

    def check(secret: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", script.replace("http://b-baton-gateway:8000", gateway.url)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "BATON_API_KEYS": secret},
        )

    eventually(lambda: check("k-2, k-1").returncode == 0, timeout=30)
    assert "serving dsv4" in check("k-1").stdout
    refused = check("")  # the chart before: no key sent
    assert refused.returncode != 0 and "401" in refused.stderr


def render(*args: str) -> list[dict[str, Any]]:
    """``helm template`` of the chart with ``args``: the objects, or the test fails on stderr."""
    rendered = helm("template", *args[:1], str(CHART), *args[1:])
    assert rendered.returncode == 0, rendered.stderr
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]


def _args(objects: list[dict[str, Any]], name: str) -> list[str]:
    [deployment] = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == name
    ]
    return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])


def test_one_release_serves_several_model_deployments_each_with_its_own_monitors() -> None:
    served = "gateway.modelDeployments={serving/dsv4,small/tiny}"
    objects = render("b", "--set", f"{served},networkPolicy.enabled=true,{MONITORING_ON}")
    gateway = _args(objects, "b-baton-gateway")
    follows = [a for a in gateway if a.startswith("--model-deployment")]
    assert follows == ["--model-deployment=serving/dsv4", "--model-deployment=small/tiny"]
    # the EPLB service balances the first unless told which
    assert "--model-deployment=serving/dsv4" in _args(objects, "b-baton-eplb")
    roles = {
        (o["metadata"]["namespace"], o["metadata"]["name"]) for o in objects if o["kind"] == "Role"
    }
    assert {("serving", "b-baton-gateway"), ("small", "b-baton-gateway")} <= roles
    assert ("serving", "b-baton-eplb") in roles and ("small", "b-baton-eplb") not in roles
    bound = {
        (o["metadata"]["namespace"], o["metadata"]["name"])
        for o in objects
        if o["kind"] == "RoleBinding"
    }
    assert {("serving", "b-baton-gateway"), ("small", "b-baton-gateway")} <= bound
    monitors = {
        o["metadata"]["name"]: (o["spec"]["namespaceSelector"]["matchNames"], o["spec"]["selector"])
        for o in objects
        if o["kind"] == "PodMonitor"
    }
    assert monitors == {
        "b-baton-engines-serving-dsv4": (["serving"], {"matchLabels": {DEPLOYMENT_LABEL: "dsv4"}}),
        "b-baton-engines-small-tiny": (["small"], {"matchLabels": {DEPLOYMENT_LABEL: "tiny"}}),
    }
    engine_policies = {
        (o["metadata"]["namespace"], o["metadata"]["name"]): o["spec"]["podSelector"]
        for o in objects
        if o["kind"] == "NetworkPolicy" and "-engines-" in o["metadata"]["name"]
    }
    assert engine_policies == {
        ("serving", "b-baton-engines-dsv4"): {"matchLabels": {DEPLOYMENT_LABEL: "dsv4"}},
        ("small", "b-baton-engines-tiny"): {"matchLabels": {DEPLOYMENT_LABEL: "tiny"}},
    }

    chosen = render("b", "--set", f"{served},eplb.modelDeployment=small/tiny")
    assert "--model-deployment=small/tiny" in _args(chosen, "b-baton-eplb")
    roles = {
        (o["metadata"]["namespace"], o["metadata"]["name"]) for o in chosen if o["kind"] == "Role"
    }
    assert ("small", "b-baton-eplb") in roles and ("serving", "b-baton-eplb") not in roles
    # the second deployment's EPLB service: a release of its own with the gateway off
    alone = render(
        "e",
        "--set",
        "gateway.enabled=false,controller.replicas=0,crds.install=false,"
        "eplb.modelDeployment=small/tiny",
    )
    assert "--model-deployment=small/tiny" in _args(alone, "e-baton-eplb")
    assert "e-baton-gateway" not in {
        o["metadata"]["name"] for o in alone if o["kind"] == "Deployment"
    }


def test_the_gateways_workers_value_is_its_workers_flag() -> None:
    objects = render("b", "--set", "gateway.modelDeployments={serving/dsv4},gateway.workers=4")
    [gateway] = [
        o
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "b-baton-gateway"
    ]
    [container] = gateway["spec"]["template"]["spec"]["containers"]
    assert "--workers=4" in container["args"]
    assert gateway_parser().parse_args(container["args"]).workers == 4
    # where the workers' metrics files go: the root filesystem is read-only
    assert container["securityContext"]["readOnlyRootFilesystem"]
    [tmp] = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    volumes = {v["name"]: v for v in gateway["spec"]["template"]["spec"]["volumes"]}
    assert "emptyDir" in volumes[tmp["name"]]


def test_the_gateway_reads_kv_events_with_the_tokenizer_files_of_an_extra_volume() -> None:
    objects = render(
        "b",
        "--set",
        "gateway.modelDeployments={serving/dsv4}",
        "--set-json",
        'gateway.extraVolumes=[{"name": "weights", "persistentVolumeClaim": '
        '{"claimName": "weights", "readOnly": true}}]',
        "--set-json",
        'gateway.extraVolumeMounts=[{"name": "weights", "mountPath": "/models", "readOnly": true}]',
        "--set-json",
        'gateway.settings={"tokenizer": "/models/dsv4", "kv_events_port": 5557}',
    )
    [gateway] = [
        o
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "b-baton-gateway"
    ]
    pod = gateway["spec"]["template"]["spec"]
    [container] = pod["containers"]
    args = gateway_parser().parse_args(container["args"])
    assert (args.tokenizer, args.kv_events_port) == ("/models/dsv4", 5557)
    assert {"name": "weights", "mountPath": "/models", "readOnly": True} in container[
        "volumeMounts"
    ]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["weights"]["persistentVolumeClaim"]["claimName"] == "weights"
    assert "tmp" in volumes  # the chart's own volumes stay


@contextlib.contextmanager
def created(api: client.ApiClient, namespace: str, objects: list[dict[str, Any]]) -> Iterator[None]:
    """``objects`` created one by one on the API server (a RayService with strict field
    validation: a field KubeRay's CRD lacks is an error, not dropped); cluster-wide objects
    removed afterwards."""
    for obj in objects:
        if obj["kind"] == "RayService":
            client.CustomObjectsApi(api).create_namespaced_custom_object(
                "ray.io", "v1", namespace, "rayservices", obj, field_validation="Strict"
            )
        elif obj["kind"] in MONITORING_PLURALS:
            client.CustomObjectsApi(api).create_namespaced_custom_object(
                "monitoring.coreos.com",
                "v1",
                namespace,
                MONITORING_PLURALS[obj["kind"]],
                obj,
                field_validation="Strict",
            )
        else:
            utils.create_from_dict(api, obj, namespace=namespace)
    yield
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


@pytest.fixture
def release(api: client.ApiClient, namespace: str) -> Iterator[list[dict[str, Any]]]:
    """The chart rendered into ``namespace`` (no replicas: nothing here runs images) and
    created object by object on the API server; cluster-wide objects removed afterwards."""
    objects = render(
        f"b-{namespace}",
        "--namespace",
        namespace,
        "--set",
        f"gateway.modelDeployments={{{namespace}/dsv4}},controller.replicas=0,gateway.replicas=0",
        "--set",
        "crds.install=false",  # the session's CRD; test_helm_upgrade_* installs one by Helm
        "--skip-tests",
    )
    with created(api, namespace, objects):
        yield objects


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


def granted(release: list[dict[str, Any]], account: str) -> set[tuple[str, str, str]]:
    """(API group, resource, verb) the release's roles grant ``account``."""
    bound = {
        o["roleRef"]["name"]
        for o in release
        if o["kind"] in ("ClusterRoleBinding", "RoleBinding")
        and any(s["name"] == account for s in o["subjects"])
    }
    return {
        (group, resource, verb)
        for o in release
        if o["kind"] in ("ClusterRole", "Role") and o["metadata"]["name"] in bound
        for rule in o["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_the_controllers_rbac_is_exactly_what_it_does_running_a_deployment_through_its_life(
    api: client.ApiClient,
    namespace: str,
    rack: list[dict[str, Any]],
    release: list[dict[str, Any]],
    control_plane: ControlPlane,
    tmp_path: Path,
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
    # Cluster scope is the controller's alone.
    assert [o["metadata"]["name"] for o in release if o["kind"] == "ClusterRole"] == [
        f"b-{namespace}-baton-controller"
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
    core = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)

    def cell_gone() -> bool:
        return not pods(api, namespace) and not (
            core.list_namespaced_service(namespace, label_selector=DEPLOYMENT_LABEL).items
        )

    try:
        apply(api, namespace, "dsv4", {"cell": {"prefill": {"instances": 2}}})
        wait_ready(api, namespace, "dsv4")
        # The same engine fails twice: two group restarts, one Event counted twice, the tray's
        # failures marked.
        for _ in range(2):
            before = pods(api, namespace, "decode")["dsv4-cell-0-decode-5"].metadata.uid
            fail_pod(api, namespace, "dsv4-cell-0-decode-5")

            def restarted(uid: str | None = before) -> bool:
                decode = pods(api, namespace, "decode")
                return len(decode) == 8 and decode["dsv4-cell-0-decode-5"].metadata.uid != uid

            eventually(restarted, timeout=60, interval=0.25)
            wait_ready(api, namespace, "dsv4")
        # Scaled to no cells: every pod and Service of the cell goes.
        patch_model_deployment_spec(api, namespace, "dsv4", {"cells": 0})
        eventually(cell_gone, timeout=60, interval=0.25)
    finally:
        stop_process(process)

    # Where NVIDIA's ComputeDomain API is served (checked when a controller starts, then every
    # minute), a cell gets one and its prefill trays their shared channel claims, deleted with
    # it. The pods claiming a channel stay Pending here: no DRA driver runs.
    def compute_domains() -> list[dict[str, Any]]:
        listed = custom.list_namespaced_custom_object(
            "resource.nvidia.com", "v1beta1", namespace, "computedomains"
        )
        items: list[dict[str, Any]] = cast(dict[str, Any], listed)["items"]
        return items

    def channel_claims() -> list[dict[str, Any]]:
        listed = custom.list_namespaced_custom_object(
            "resource.k8s.io", "v1", namespace, "resourceclaims"
        )
        items: list[dict[str, Any]] = cast(dict[str, Any], listed)["items"]
        return items

    with compute_domains_served(api):
        process = start_controller(
            control_plane,
            f"sa-{namespace}",
            "baton-controller",
            kubeconfig=kubeconfig,
            lease_namespace=namespace,
        )
        try:
            patch_model_deployment_spec(api, namespace, "dsv4", {"cells": 1})
            eventually(channel_claims, timeout=60, interval=0.25)
            patch_model_deployment_spec(api, namespace, "dsv4", {"cells": 0})
            eventually(
                lambda: cell_gone() and not compute_domains() and not channel_claims(),
                timeout=60,
                interval=0.25,
            )
        finally:
            stop_process(process)
    log = controller_log(control_plane, f"sa-{namespace}")
    assert "Forbidden" not in log and "Traceback" not in log
    used = control_plane.requests_of(f"system:serviceaccount:{namespace}:{account}")
    rules = granted(release, account)
    assert (sorted(rules - used), sorted(used - rules)) == ([], [])  # (granted unused, used)

    gateway = token_for(api, namespace, f"b-{namespace}-baton-gateway")
    deployments = client.V1ResourceAttributes(
        group="baton.dev", resource="modeldeployments", verb="watch", namespace=namespace
    )
    create_pods = client.V1ResourceAttributes(resource="pods", verb="create", namespace=namespace)
    assert allowed(api, gateway, deployments)
    assert not allowed(api, gateway, create_pods)
    eplb = token_for(api, namespace, f"b-{namespace}-baton-eplb")
    status = client.V1ResourceAttributes(
        group="baton.dev",
        resource="modeldeployments",
        subresource="status",
        verb="patch",
        namespace=namespace,
    )
    assert allowed(api, eplb, deployments) and allowed(api, eplb, status)
    assert not allowed(api, gateway, status) and not allowed(api, eplb, create_pods)
    elsewhere = client.V1ResourceAttributes(
        group="baton.dev", resource="modeldeployments", verb="watch", namespace="other"
    )
    assert not allowed(api, gateway, elsewhere) and not allowed(api, eplb, elsewhere)

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


def test_helm_upgrade_updates_the_crd_and_uninstall_keeps_it_and_the_deployments(
    api: client.ApiClient, namespace: str, control_plane: ControlPlane, tmp_path: Path
) -> None:
    install_crd(api)
    extensions = client.ApiextensionsV1Api(api)
    crd_name = f"{PLURAL}.{GROUP}"
    original = extensions.read_custom_resource_definition(crd_name)
    release = f"u-{namespace}"
    # A CRD created without Helm is adopted the way docs/operations.md says: Helm's ownership
    # label and annotations on it.
    extensions.patch_custom_resource_definition(
        crd_name,
        {
            "metadata": {
                "labels": {"app.kubernetes.io/managed-by": "Helm"},
                "annotations": {
                    "meta.helm.sh/release-name": release,
                    "meta.helm.sh/release-namespace": namespace,
                },
            }
        },
    )
    chart = tmp_path / "baton"
    shutil.copytree(CHART, chart)
    kubeconfig = str(control_plane.kubeconfig)
    values = [
        "--namespace",
        namespace,
        "--kubeconfig",
        kubeconfig,
        "--set",
        f"gateway.modelDeployments={{{namespace}/dsv4}},controller.replicas=0,gateway.replicas=0",
    ]
    try:
        installed = helm("install", release, str(chart), *values)
        assert installed.returncode == 0, installed.stderr
        apply(api, namespace, "dsv4", {"cell": {"prefill": {"instances": 2}}})

        # A new chart version whose CRD gained a printer column.
        crd_file = chart / CRD_PATH.removeprefix("helm/baton/")
        crd = yaml.safe_load(crd_file.read_text())
        column = {"name": "Model", "type": "string", "jsonPath": ".spec.model"}
        crd["spec"]["versions"][0]["additionalPrinterColumns"].append(column)
        crd_file.write_text(yaml.safe_dump(crd))
        upgraded = helm("upgrade", release, str(chart), *values)
        assert upgraded.returncode == 0, upgraded.stderr
        served = extensions.read_custom_resource_definition(crd_name)
        assert served.spec.versions[0].additional_printer_columns  # the chart's columns
        assert served.spec.versions[0].additional_printer_columns[-1].name == "Model"

        uninstalled = helm(
            "uninstall", release, "--namespace", namespace, "--kubeconfig", kubeconfig
        )
        assert uninstalled.returncode == 0, uninstalled.stderr
        assert "kept due to the resource policy" in uninstalled.stdout + uninstalled.stderr
        assert extensions.read_custom_resource_definition(crd_name).spec.versions[0]
        assert read(api, namespace, "dsv4")["spec"]["cells"] == 1  # the deployment stays
        core = client.CoreV1Api(api)
        left = [
            a.metadata.name
            for a in core.list_namespaced_service_account(namespace).items
            if a.metadata and a.metadata.name != "default"
        ]
        assert left == []  # the release's own objects are gone
    finally:
        helm("uninstall", release, "--namespace", namespace, "--kubeconfig", kubeconfig)
        # The session's CRD back as it was, spec and metadata.
        current = extensions.read_custom_resource_definition(crd_name)
        assert original.metadata is not None and current.metadata is not None  # served objects
        original.metadata.resource_version = current.metadata.resource_version
        extensions.replace_custom_resource_definition(crd_name, original)


def test_the_charts_pods_wait_for_a_cpu_node_and_run_there_never_on_a_tray(
    api: client.ApiClient, namespace: str, rack: list[dict[str, Any]], control_plane: ControlPlane
) -> None:
    release = f"c-{namespace}"
    installed = helm(
        "install",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--kubeconfig",
        str(control_plane.kubeconfig),
        "--set",
        f"gateway.modelDeployments={{{namespace}/dsv4}}",
        "--set",
        "crds.install=false",  # the session's CRD, which no release owns
    )
    assert installed.returncode == 0, installed.stderr
    core = client.CoreV1Api(api)
    selector = f"app.kubernetes.io/instance={release}"

    def listed() -> list[client.V1Pod]:
        return core.list_namespaced_pod(namespace, label_selector=selector).items

    def unschedulable(pod: client.V1Pod) -> bool:
        conditions = pod.status.conditions if pod.status else None
        return any(
            c.type == "PodScheduled" and c.reason == "Unschedulable" for c in conditions or []
        )

    cpu_nodes: list[dict[str, Any]] = []
    try:
        # Two controllers, two gateways, one EPLB service; the trays' taint keeps them off.
        eventually(lambda: len(listed()) == 5 and all(map(unschedulable, listed())), timeout=60)
        cpu_nodes = add_cpu_nodes(api, 1, name_prefix=f"{namespace}-")
        cpu_node = cpu_nodes[0]["metadata"]["name"]

        def running_on_the_cpu_node() -> bool:
            return all(
                p.spec is not None
                and p.spec.node_name == cpu_node
                and p.status is not None
                and p.status.phase == "Running"
                for p in listed()
            )

        eventually(running_on_the_cpu_node, timeout=60)
        components = {
            (p.metadata.labels or {}).get("app.kubernetes.io/component")
            for p in listed()
            if p.metadata
        }
        assert components == {"controller", "gateway", "eplb"}
    finally:
        kubeconfig = str(control_plane.kubeconfig)
        helm("uninstall", release, "--namespace", namespace, "--kubeconfig", kubeconfig)
        eventually(lambda: not listed(), timeout=60)
        remove_nodes(api, cpu_nodes)


def test_drains_keep_a_controller_and_a_gateway_and_every_pod_runs_under_runtime_seccomp(
    api: client.ApiClient, namespace: str
) -> None:
    rendered = helm(
        "template",
        f"p-{namespace}",
        str(CHART),
        "--namespace",
        namespace,
        "--set",
        f"gateway.modelDeployments={{{namespace}/dsv4}}",
        "--skip-tests",
    )
    assert rendered.returncode == 0, rendered.stderr
    objects = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    covered = set()
    for budget in budgets:
        utils.create_from_dict(api, budget, namespace=namespace)  # the API server accepts it
        assert budget["spec"]["minAvailable"] == 1
        selector = budget["spec"]["selector"]["matchLabels"]
        [name] = [
            n
            for n, d in deployments.items()
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert deployments[name]["spec"]["replicas"] > 1
        covered.add(name)
    assert covered == {f"p-{namespace}-baton-controller", f"p-{namespace}-baton-gateway"}
    for deployment in deployments.values():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["securityContext"]["runAsNonRoot"] is True


def test_the_notes_give_a_modeldeployment_that_reports_to_the_releases_eplb_service(
    namespace: str, control_plane: ControlPlane
) -> None:
    # A one-letter release: "n" is a YAML boolean unless the chart quotes it.
    installed = helm(
        "install",
        "--dry-run=client",
        "n",
        str(CHART),
        "--namespace",
        namespace,
        "--kubeconfig",
        str(control_plane.kubeconfig),
        "--set",
        "gateway.modelDeployments={serving/dsv4}",
        "--set",
        "eplb.tokenSecret.name=eplb-token",
        "--set",
        "crds.install=false",  # the session's CRD, which no release owns
    )
    assert installed.returncode == 0, installed.stderr
    notes = installed.stdout.split("NOTES:", 1)[1]
    manifest = textwrap.dedent(notes.split("<<EOF\n", 1)[1].split("   EOF", 1)[0])
    deployment = ModelDeployment.model_validate(yaml.safe_load(manifest))
    assert (deployment.metadata.namespace, deployment.metadata.name) == ("serving", "dsv4")
    eplb = deployment.spec.eplb
    assert eplb.report_url == f"http://n-baton-eplb.{namespace}.svc:9091"
    assert eplb.token_secret is not None and eplb.token_secret.name == "eplb-token"
    assert "helm test n" in notes and "Pending" in notes


PARSERS = {"controller": controller_parser, "gateway": gateway_parser, "eplb": eplb_parser}


def test_the_charts_commands_are_entry_points_of_the_image_it_names() -> None:
    """Every chart container runs `baton COMMAND` with arguments that command accepts (or the
    image's python). That the image runs them as the chart does: tests/k8s/test_image.py."""
    rendered = helm("template", "b", str(CHART), "--set", "gateway.modelDeployments={serving/dsv4}")
    assert rendered.returncode == 0, rendered.stderr
    objects = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
    specs = [o["spec"]["template"]["spec"] for o in objects if o["kind"] == "Deployment"]
    specs += [o["spec"] for o in objects if o["kind"] == "Pod"]
    commands = [c["command"] + c.get("args", []) for spec in specs for c in spec["containers"]]
    assert len(commands) == 4  # controller, gateway, EPLB service, helm test
    for command in commands:
        if command[0] == "python":
            continue
        assert command[0] == "baton" and command[1] in COMMANDS, command
        PARSERS[command[1]]().parse_args(command[2:])
    # The engines' init container runs the same image's `baton vllm-plugin install`.
    assert "vllm-plugin" in COMMANDS
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsNonRoot"] is True


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector's verdict on ``labels`` (matchLabels and In expressions)."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))


def _admits(
    peers: list[dict[str, Any]], labels: dict[str, str], pod_namespace: str, policy_namespace: str
) -> bool:
    """Whether a pod with ``labels`` in ``pod_namespace`` is one of a NetworkPolicy's peers."""
    return any(
        _selects(peer.get("podSelector", {}), labels)
        and (
            "namespaceSelector" not in peer
            or _selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": pod_namespace})
        )
        and ("namespaceSelector" in peer or pod_namespace == policy_namespace)
        for peer in peers
    )


def test_with_the_network_policy_engines_take_traffic_from_baton_and_each_other_only(
    api: client.ApiClient, namespace: str
) -> None:
    rendered = helm(
        "template",
        "np",
        str(CHART),
        "--namespace",
        "baton-system",
        "--set",
        f"gateway.modelDeployments={{{namespace}/dsv4}},networkPolicy.enabled=true",
        "--skip-tests",
    )
    assert rendered.returncode == 0, rendered.stderr
    objects = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
    [policy] = [
        o
        for o in objects
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"].endswith("-engines-dsv4")
    ]
    utils.create_from_dict(api, policy, namespace=namespace)  # the API server accepts it
    assert policy["metadata"]["namespace"] == namespace
    spec = policy["spec"]
    deployment = ModelDeployment.model_validate(
        {"metadata": {"name": "dsv4"}, "spec": {"model": "deepseek-ai/DeepSeek-V4.1-Flash"}}
    )
    plan = plan_placement([DeploymentShape.of(deployment)], synthetic_topology(1))
    engines = [
        m["metadata"]["labels"]
        for m in render_cell(
            deployment.spec, plan.cells[0], deployment="dsv4", uid="u", namespace=namespace
        )
        if m["kind"] == "Pod"
    ]
    assert all(_selects(spec["podSelector"], labels) for labels in engines)
    [rule] = spec["ingress"]
    peers, engine_peer = rule["from"], rule["from"][0]
    assert all(_selects(engine_peer["podSelector"], labels) for labels in engines)

    def admitted(labels: dict[str, str], pod_namespace: str) -> bool:
        return _admits(peers, labels, pod_namespace, namespace)

    baton = {
        o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"]
        for o in objects
        if o["kind"] == "Deployment"
    }
    assert len(baton) == 3 and all(admitted(labels, "baton-system") for labels in baton.values())
    other_release = dict(next(iter(baton.values())), **{"app.kubernetes.io/instance": "other"})
    assert not admitted(other_release, "baton-system")
    assert not admitted({"app": "curl"}, namespace)
    assert not admitted(next(iter(baton.values())), "elsewhere")


def test_with_the_network_policy_only_prometheus_scrapes_the_controller_and_eplb_service(
    api: client.ApiClient, namespace: str
) -> None:
    objects = render(
        "np",
        "--namespace",
        namespace,
        "--set",
        f"gateway.modelDeployments={{{namespace}/dsv4}},networkPolicy.enabled=true",
    )
    policies = {
        o["metadata"]["name"]: o
        for o in objects
        if o["kind"] == "NetworkPolicy" and "-engines-" not in o["metadata"]["name"]
    }
    assert set(policies) == {"np-baton-controller", "np-baton-eplb"}
    pods = {
        o["metadata"]["name"]: o["spec"]["template"] for o in objects if o["kind"] == "Deployment"
    }
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    engine = {"baton.dev/deployment": "dsv4"}
    for name, policy in policies.items():
        utils.create_from_dict(api, policy, namespace=namespace)  # the API server accepts it
        template = pods[name]
        assert _selects(policy["spec"]["podSelector"], template["metadata"]["labels"])
        ports = {
            p["containerPort"]: p["name"]
            for c in template["spec"]["containers"]
            for p in c["ports"]
        }
        rules = {ports[r["ports"][0]["port"]]: r["from"] for r in policy["spec"]["ingress"]}
        # every port the pod listens on has its rule, and only Prometheus scrapes metrics
        assert set(rules) == set(ports.values())
        assert _admits(rules["metrics"], prometheus, "monitoring", namespace)
        assert not _admits(rules["metrics"], {"app": "curl"}, namespace, namespace)
        assert not _admits(rules["metrics"], engine, namespace, namespace)
        if "reports" in rules:  # the EPLB service's: the engines' window reports only
            assert _admits(rules["reports"], engine, namespace, namespace)
            assert not _admits(rules["reports"], engine, "elsewhere", namespace)
            assert not _admits(rules["reports"], prometheus, "monitoring", namespace)


# ---- Ray Serve on KubeRay (gateway.rayService)


@pytest.mark.filterwarnings(RAY_WARNINGS)
def test_the_gateways_settings_are_its_flags_and_its_serve_arguments_unset_ones_its_defaults() -> (
    None
):
    settings = "gateway.settings.policy=least_loaded,gateway.settings.prefill_timeout_s=600"
    objects = render("b", "--set", f"gateway.modelDeployments={{serving/dsv4}},{settings}")
    [gateway] = [
        o
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "b-baton-gateway"
    ]
    [container] = gateway["spec"]["template"]["spec"]["containers"]
    parsed = GatewaySettings.from_flags(gateway_parser().parse_args(container["args"]))
    assert parsed == GatewaySettings(policy=PrefillPolicy.LEAST_LOADED, prefill_timeout_s=600)
    objects = render("b", "-f", str(RAY_SERVE_EXAMPLE), "--set", settings)
    [ray_service] = [o for o in objects if o["kind"] == "RayService"]
    [application] = yaml.safe_load(ray_service["spec"]["serveConfigV2"])["applications"]
    assert application["args"]["policy"] == "least_loaded"
    assert application["args"]["prefill_timeout_s"] == 600
    assert "pd_threshold_tokens" not in application["args"]  # the gateway's own default


def test_the_ray_serve_example_runs_router_serve_app_on_a_rayservice_instead_of_the_deployment(
    tmp_path: Path,
) -> None:
    objects = render("b", "-f", str(RAY_SERVE_EXAMPLE))
    deployments = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"}
    assert deployments == {"b-baton-controller", "b-baton-eplb"}  # no gateway Deployment
    assert "b-baton-gateway" not in {
        o["metadata"]["name"] for o in objects if o["kind"] == "Service"
    }
    [ray_service] = [o for o in objects if o["kind"] == "RayService"]
    assert ray_service["apiVersion"] == "ray.io/v1"
    spec = ray_service["spec"]

    # A Serve config file as Ray reads it (its schema ignores fields it does not know, so the
    # values are checked as Ray parsed them), whose one application is router.serve:app.
    serve_config = ServeDeploySchema.model_validate(yaml.safe_load(spec["serveConfigV2"]))
    [application] = serve_config.applications
    module, _, attribute = application.import_path.partition(":")
    assert getattr(importlib.import_module(module), attribute) is router.serve.app
    assert application.route_prefix == "/"
    assert serve_config.http_options.host == "0.0.0.0"

    # One Serve replica per Ray worker pod, none on the head.
    cluster = spec["rayClusterConfig"]
    [workers] = cluster["workerGroupSpecs"]
    [deployment] = application.deployments
    assert deployment.name == router.serve.DEPLOYMENT_NAME
    assert deployment.num_replicas == workers["replicas"] == 2
    assert deployment.max_replicas_per_node == 1
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"

    # Every Ray pod runs the serve image as the gateway's service account, with the clients'
    # keys in its environment and the engines' key where the application's arguments say.
    serve_port = serve_config.http_options.port
    key_file = Path(application.args["engine_api_key_file"])
    for group in (cluster["headGroupSpec"], workers):
        pod = group["template"]["spec"]
        assert pod["serviceAccountName"] == "b-baton-gateway"
        assert pod["securityContext"]["runAsNonRoot"] is True
        [container] = pod["containers"]
        assert container["image"] == "ghcr.io/baton-dev/baton:0.1.0-serve"
        assert {"name": "serve", "containerPort": serve_port} in container["ports"]
        [keys] = container["env"]
        assert keys["name"] == router.serve.API_KEYS_ENV
        assert keys["valueFrom"]["secretKeyRef"] == {"name": "gateway-api-keys", "key": "api-keys"}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["engine-api-key"] == str(key_file.parent)
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["engine-api-key"]["secret"]["secretName"] == "dsv4-engine-api-key"
        assert key_file.name == "api-key"  # the Secret's key, mounted as a file of that name
        assert group["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway"

    # The arguments are ones router.serve:app accepts, meaning what the values say.
    (tmp_path / "api-key").write_text("engine-secret\n")
    args = {**application.args, "engine_api_key_file": str(tmp_path / "api-key")}
    config = router.serve.config_from_serve_args(args, {router.serve.API_KEYS_ENV: "k1,k2"})
    assert config.model_deployments == (DeploymentRef("serving", "dsv4"),)
    assert config.pool is None and config.api_keys == ("k1", "k2")
    assert config.engine_api_key == "engine-secret"
    assert config.settings.policy.value == "affinity"
    assert config.settings.pd_threshold_tokens == 256

    # KubeRay's Serve Service takes the gateway Service's name; the helm test pod finds it there.
    assert spec["serveService"]["metadata"]["name"] == "b-baton-gateway"
    assert spec["serveService"]["spec"]["ports"] == [{"name": "serve", "port": serve_port}]
    [test_pod] = [o for o in objects if o["kind"] == "Pod"]
    assert f"http://b-baton-gateway:{serve_port}" in test_pod["spec"]["containers"][0]["command"][2]


def served(api: client.ApiClient, crd_file: Path) -> None:
    """The CRD in ``crd_file`` on the API server, established."""
    extensions = client.ApiextensionsV1Api(api)
    crd = yaml.safe_load(crd_file.read_text())
    try:
        extensions.create_custom_resource_definition(crd)
    except ApiException as exc:
        if exc.status != 409:
            raise

    def established() -> bool:
        status = extensions.read_custom_resource_definition(crd["metadata"]["name"]).status
        conditions = (status.conditions if status else None) or []
        return any(c.type == "Established" and c.status == "True" for c in conditions)

    eventually(established, timeout=30)


@pytest.fixture
def ray_service_crd(api: client.ApiClient) -> None:
    """KubeRay's RayService CRD on the API server, served."""
    served(api, binaries_dir() / RAY_SERVICE_CRD)


@pytest.fixture
def monitoring_crds(api: client.ApiClient) -> None:
    """The ServiceMonitor, PodMonitor and PrometheusRule CRDs on the API server, served."""
    for crd_file in sorted((binaries_dir() / "monitoring-crds").glob("*.yaml")):
        served(api, crd_file)


def test_monitoring_is_off_by_default() -> None:
    kinds = {o["kind"] for o in render("b", "--set", "gateway.modelDeployments={serving/dsv4}")}
    assert not kinds & set(MONITORING_PLURALS)
    names = {o["metadata"]["name"] for o in render("b", "--set", "gateway.modelDeployments={s/d}")}
    assert not any("dashboard" in name for name in names)


def test_every_alerts_runbook_url_is_a_section_of_the_page_the_chart_value_names() -> None:
    base = "https://wiki.example.com/ml-platform/baton-runbooks"
    [rule] = [
        o
        for o in render(
            "b",
            "--set",
            f"gateway.modelDeployments={{serving/dsv4}},{MONITORING_ON},monitoring.runbookBaseUrl={base}",
        )
        if o["kind"] == "PrometheusRule"
    ]
    alerts = [r for group in rule["spec"]["groups"] for r in group["rules"] if "alert" in r]
    assert len(alerts) == 15
    for alert in alerts:
        assert alert["annotations"]["runbook_url"] == f"{base}#{alert['alert'].lower()}"
    # each names a section of docs/observability.md, as Markdown anchors it
    sections = (ROOT / "docs" / "observability.md").read_text()
    assert all(f"### {alert['alert']}\n" in sections for alert in alerts)


def test_the_monitors_rules_and_dashboards_are_accepted_and_select_what_they_monitor(
    api: client.ApiClient, namespace: str, monitoring_crds: None
) -> None:
    objects = render(
        f"m-{namespace}",
        "--namespace",
        namespace,
        "--set",
        f"gateway.modelDeployments={{{namespace}/dsv4}},crds.install=false,{MONITORING_ON}",
        "--skip-tests",
    )
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for obj in objects:
        by_kind.setdefault(obj["kind"], []).append(obj)
    with created(api, namespace, objects):
        custom = client.CustomObjectsApi(api)
        for kind, plural in MONITORING_PLURALS.items():
            [obj] = by_kind[kind]
            stored = json_object(
                custom.get_namespaced_custom_object(
                    "monitoring.coreos.com", "v1", namespace, plural, obj["metadata"]["name"]
                )
            )
            assert stored["spec"] == obj["spec"], kind  # nothing pruned by the CRD's schema

    # The ServiceMonitor selects the three metrics Services, each on a port it has.
    [monitor] = by_kind["ServiceMonitor"]
    assert monitor["metadata"]["labels"]["release"] == "kps"
    ports = {endpoint["port"] for endpoint in monitor["spec"]["endpoints"]}
    selected = {
        service["metadata"]["name"]: {port["name"] for port in service["spec"]["ports"]}
        for service in by_kind["Service"]
        if _selects(monitor["spec"]["selector"], service["metadata"]["labels"])
    }
    release = f"m-{namespace}-baton"
    assert set(selected) == {
        f"{release}-gateway",
        f"{release}-eplb",
        f"{release}-controller-metrics",
    }
    assert all(names & ports for names in selected.values())
    # The EPLB service's series name the ModelDeployment it balances, as the engines' do; the
    # gateway's name their own (it may serve several), and the controller's keep the
    # namespace each of its series names.
    gateway_endpoint, metrics_endpoint = monitor["spec"]["endpoints"]
    assert "relabelings" not in gateway_endpoint
    [served] = metrics_endpoint["relabelings"]
    assert served["targetLabel"] == "modeldeployment"
    assert served["replacement"] == f"{namespace}/dsv4"
    components = {
        service["metadata"]["labels"]["app.kubernetes.io/component"]
        for service in by_kind["Service"]
        if _selects(monitor["spec"]["selector"], service["metadata"]["labels"])
    }
    assert {c for c in components if re.fullmatch(served["regex"], c)} == {"eplb"}
    assert [e.get("honorLabels", False) for e in monitor["spec"]["endpoints"]] == [True, True]

    # The PodMonitor selects the deployment's engine pods, on their http port, in their
    # namespace, and labels each series with its pod's cell and role.
    [pod_monitor] = by_kind["PodMonitor"]
    assert pod_monitor["spec"]["namespaceSelector"]["matchNames"] == [namespace]
    deployment = ModelDeployment.model_validate(
        {"metadata": {"name": "dsv4"}, "spec": {"model": "deepseek-ai/DeepSeek-V4.1-Flash"}}
    )
    plan = plan_placement([DeploymentShape.of(deployment)], synthetic_topology(1))
    engines = [
        m
        for m in render_cell(
            deployment.spec, plan.cells[0], deployment="dsv4", uid="u", namespace=namespace
        )
        if m["kind"] == "Pod"
    ]
    [endpoint] = pod_monitor["spec"]["podMetricsEndpoints"]
    for pod in engines:
        assert _selects(pod_monitor["spec"]["selector"], pod["metadata"]["labels"])
        pod_ports = [p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])]
        assert endpoint["port"] in pod_ports
    relabelled = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    pod_labels = engines[0]["metadata"]["labels"]
    for target, label in (("cell", CELL_LABEL), ("role", ROLE_LABEL)):
        meta = "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)
        assert relabelled[target] == [meta] and label in pod_labels
    # and with NAMESPACE/NAME of its ModelDeployment, as the gateway's series
    meta = "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", DEPLOYMENT_LABEL)
    assert relabelled["modeldeployment"] == ["__meta_kubernetes_namespace", meta]
    [joined] = [r for r in endpoint["relabelings"] if r["targetLabel"] == "modeldeployment"]
    assert joined["separator"] == "/" and pod_labels[DEPLOYMENT_LABEL] == "dsv4"

    # The rules are the file promtool tests; the dashboards the JSON make dashboards writes.
    [rule] = by_kind["PrometheusRule"]
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    dashboards = {
        key: json.loads(value)
        for config_map in by_kind["ConfigMap"]
        if config_map["metadata"]["labels"].get("grafana_dashboard") == "1"
        for key, value in config_map["data"].items()
    }
    assert dashboards == {
        f"{spec.uid}.json": json.loads((DASHBOARDS_OUT / f"{spec.uid}.json").read_text())
        for spec in DASHBOARDS
    }


def test_in_ray_serve_mode_the_api_server_takes_the_rayservice_and_its_pods_follow_the_deployment(
    api: client.ApiClient, namespace: str, ray_service_crd: None
) -> None:
    objects = render(
        f"r-{namespace}",
        "--namespace",
        namespace,
        "-f",
        str(RAY_SERVE_EXAMPLE),
        "--set",
        f"gateway.modelDeployments={{{namespace}/dsv4}},crds.install=false",
        "--skip-tests",
    )
    with created(api, namespace, objects):
        stored = json_object(
            client.CustomObjectsApi(api).get_namespaced_custom_object(
                "ray.io", "v1", namespace, "rayservices", f"r-{namespace}-baton-gateway"
            )
        )
        [ray_service] = [o for o in objects if o["kind"] == "RayService"]
        assert stored["spec"]["serveConfigV2"] == ray_service["spec"]["serveConfigV2"]
        cluster = stored["spec"]["rayClusterConfig"]
        groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
        accounts = {g["template"]["spec"]["serviceAccountName"] for g in groups}
        [account] = accounts
        token = token_for(api, namespace, account)
        deployments = client.V1ResourceAttributes(
            group="baton.dev", resource="modeldeployments", verb="watch", namespace=namespace
        )
        elsewhere = client.V1ResourceAttributes(
            group="baton.dev", resource="modeldeployments", verb="watch", namespace="other"
        )
        pods = client.V1ResourceAttributes(resource="pods", verb="create", namespace=namespace)
        assert allowed(api, token, deployments)
        assert not allowed(api, token, elsewhere) and not allowed(api, token, pods)
