"""The Helm chart: lint, a clear failure without its one required value, every rendered object
accepted by the real API server, its RBAC enough for the controller to run a deployment as its
ServiceAccount, no more for the gateway than reading ModelDeployments and for the EPLB service
than that and writing their status; its EPLB configuration accepted by the service."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client, utils
from kubernetes.client.rest import ApiException

from baton.cli import COMMANDS
from baton.core.api import ModelDeployment
from controller.cli import build_parser as controller_parser
from controller.placement import DeploymentShape, plan_placement
from controller.podspec import render_cell
from controller.topology import synthetic_topology
from eplb.cli import build_parser as eplb_parser
from eplb.config import load_config
from rigs.devcluster import (
    ROOT,
    ControlPlane,
    add_cpu_nodes,
    binaries_dir,
    remove_nodes,
    write_kubeconfig,
)
from rigs.processes import eventually, free_port, stop_process
from router.cli import build_parser as gateway_parser
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


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("controller.replicas=two", "at '/controller/replicas': got string, want integer"),
        ("gateway.polcy=affinity", "additional properties 'polcy' not allowed"),
        ("gateway.policy=random", "at '/gateway/policy'"),
        ("gateway.modelDeployment=dsv4", "at '/gateway/modelDeployment'"),
        ("eplb.reportPort=70000", "at '/eplb/reportPort'"),
        ("image.pullPolicy=Sometimes", "at '/image/pullPolicy'"),
    ],
)
def test_the_values_schema_refuses_a_wrong_value_naming_it(value: str, message: str) -> None:
    rendered = helm(
        "template",
        "baton",
        str(CHART),
        "--set",
        "gateway.modelDeployment=serving/dsv4",
        "--set",
        value,
    )
    assert rendered.returncode != 0
    assert message in rendered.stderr, rendered.stderr


def test_the_helm_test_pods_check_passes_against_a_running_gateway_and_fails_without_one(
    start_sim, start_gateway
) -> None:
    rendered = helm(
        "template",
        "b",
        str(CHART),
        "--set",
        "gateway.modelDeployment=serving/dsv4",
        "--show-only",
        "templates/tests/gateway.yaml",
    )
    assert rendered.returncode == 0, rendered.stderr
    pod = yaml.safe_load(rendered.stdout)
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
        "--skip-tests",
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


def test_the_charts_pods_wait_for_a_cpu_node_and_run_there_never_on_a_tray(
    api, namespace, rack, control_plane: ControlPlane
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
        f"gateway.modelDeployment={namespace}/dsv4",
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

    cpu_nodes: list[dict] = []
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
    api, namespace
) -> None:
    rendered = helm(
        "template",
        f"p-{namespace}",
        str(CHART),
        "--namespace",
        namespace,
        "--set",
        f"gateway.modelDeployment={namespace}/dsv4",
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
    namespace, control_plane: ControlPlane
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
        "gateway.modelDeployment=serving/dsv4",
        "--set",
        "eplb.tokenSecret.name=eplb-token",
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


CONTAINERFILE = ROOT / "Containerfile"
PARSERS = {"controller": controller_parser, "gateway": gateway_parser, "eplb": eplb_parser}


def test_the_charts_commands_are_entry_points_of_the_image_it_names() -> None:
    """Every chart container runs `baton COMMAND` with arguments that command accepts (or the
    image's python), and the Containerfile installs the whole project, as the non-root user
    the chart runs as, so `baton` and every package it dispatches to are in the image."""
    rendered = helm("template", "b", str(CHART), "--set", "gateway.modelDeployment=serving/dsv4")
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

    containerfile = CONTAINERFILE.read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["baton"] == "baton.cli:main"
    packages = {
        p.removesuffix("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    copied = set(re.findall(r"^COPY (\w+) \1$", containerfile, flags=re.MULTILINE))
    assert copied == packages
    assert "pip wheel --no-cache-dir --no-deps --wheel-dir /wheels ." in containerfile
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    user = values["podSecurityContext"]["runAsUser"]
    assert re.search(rf"^USER {user}:{user}$", containerfile, flags=re.MULTILINE)
    assert values["podSecurityContext"]["runAsNonRoot"] is True


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    """A label selector's verdict on ``labels`` (matchLabels and In expressions)."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))


def test_with_the_network_policy_engines_take_traffic_from_baton_and_each_other_only(
    api, namespace
) -> None:
    rendered = helm(
        "template",
        "np",
        str(CHART),
        "--namespace",
        "baton-system",
        "--set",
        f"gateway.modelDeployment={namespace}/dsv4,networkPolicy.enabled=true",
        "--skip-tests",
    )
    assert rendered.returncode == 0, rendered.stderr
    objects = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
    [policy] = [o for o in objects if o["kind"] == "NetworkPolicy"]
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
        return any(
            _selects(peer["podSelector"], labels)
            and (
                "namespaceSelector" not in peer
                or _selects(
                    peer["namespaceSelector"], {"kubernetes.io/metadata.name": pod_namespace}
                )
            )
            and ("namespaceSelector" in peer or pod_namespace == namespace)
            for peer in peers
        )

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
