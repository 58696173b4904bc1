"""A real Kubernetes control plane on loopback: the tests, benchmarks and ``baton dev-cluster``.

etcd, kube-apiserver, kube-scheduler and kube-controller-manager (built from Go modules by
``deploy/dev/build.sh``) and kwok, which plays the kubelet of every node annotated as a fake tray:
heartbeats (a Lease per tray in kube-node-lease, renewed as a kubelet does), and pods bound to it
reported Running and Ready with an IP. Pod IPs come from 127.64.0.0/16, a loopback range: a test
can serve a pod's engine (``baton sim``) at its pod IP. Everything lives in a temporary directory
and stops with :meth:`ControlPlane.stop`.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from baton.core.api import API_VERSION, GROUP, KIND, PLURAL, VERSION
from baton.core.crd import CRD_PATH
from baton.core.kube import json_object
from baton.core.labels import (
    CELL_LABEL,
    DEPLOYMENT_LABEL,
    HOSTNAME_LABEL,
    NODE_ARCH_LABEL,
    NODE_OS_LABEL,
    ROLE_LABEL,
    TRAY_FAILURES_ANNOTATION,
)
from controller.observe import rfc3339
from controller.topology import synthetic_nodes
from rigs.processes import baton_command, eventually, free_port, stop_process

__all__ = [
    "ControlPlane",
    "add_cpu_nodes",
    "add_trays",
    "apply_crd",
    "binaries_dir",
    "condition",
    "create_model_deployment",
    "fail_pod",
    "install_crd",
    "mark_tray_not_ready",
    "mark_tray_ready",
    "node_ready",
    "partial_groups",
    "patch_model_deployment_spec",
    "pods",
    "read_model_deployment",
    "record_tray_failures",
    "remove_nodes",
    "start_control_plane",
    "start_controller",
    "write_kubeconfig",
]

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "baton-test-admin-token"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
POD_CIDR = "127.64.0.0/16"
# What service accounts ask of the API server, at Metadata level (no bodies): a test reads it to
# compare what a component does with what its RBAC grants. Nothing else is logged.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
        {"level": "None"},
    ],
}
# The kubelet's default; kwok renews each tray's Lease in kube-node-lease every quarter of it.
NODE_LEASE_SECONDS = 40
# What a GB300 tray's kubelet reports beside its GPUs.
TRAY_RESOURCES = {"cpu": "144", "memory": "960Gi", "pods": "110"}
# A modest x86 system node, enough for the chart's controller, gateway and EPLB service.
CPU_NODE_RESOURCES = {"cpu": "16", "memory": "64Gi", "pods": "110"}


def binaries_dir() -> Path:
    """Where ``deploy/dev/build.sh`` put the binaries; they are built by ``make dev-bin`` (a
    prerequisite of ``make test`` and ``make bench``), never here: a build takes longer than a
    test may."""
    where = subprocess.run(
        [str(ROOT / "deploy/dev/build.sh"), "--where"], check=True, capture_output=True, text=True
    )
    directory = Path(where.stdout.strip())
    if not (directory / ".complete").exists():
        raise RuntimeError(
            f"the Kubernetes test binaries are not built in {directory}; run `make dev-bin` "
            "(deploy/dev/build.sh: 10-20 minutes on a new machine, then cached)"
        )
    return directory


@dataclass
class ControlPlane:
    directory: Path
    server: str
    kubeconfig: Path
    detached: bool = False
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    commands: dict[str, list[str]] = field(default_factory=dict)

    def log(self, name: str) -> str:
        return (self.directory / f"{name}.log").read_text()

    def requests_of(self, user: str) -> set[tuple[str, str, str]]:
        """(API group, resource[/subresource], verb) of every request ``user`` made, from the
        API server's audit log (service accounts only; see ``AUDIT_POLICY``)."""
        seen: set[tuple[str, str, str]] = set()
        for line in (self.directory / "audit.log").read_text().splitlines():
            event = json.loads(line)
            ref = event.get("objectRef")
            if event["user"]["username"] != user or ref is None:
                continue
            resource = ref["resource"] + (
                f"/{ref['subresource']}" if ref.get("subresource") else ""
            )
            seen.add((ref.get("apiGroup", ""), resource, event["verb"]))
        return seen

    def stop(self) -> None:
        for process in reversed(list(self.processes.values())):
            stop_process(process)

    def api_ready(self) -> bool:
        ca = self.directory / "certs" / "apiserver.crt"
        if not ca.exists():
            return False
        response = httpx.get(
            f"{self.server}/readyz",
            verify=ssl.create_default_context(cafile=str(ca)),
            timeout=2,
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        return response.status_code == 200

    def restart(self, name: str, *, down_s: float = 0.0, timeout: float = 120) -> None:
        """SIGKILL component ``name`` (kube-apiserver, kwok, ...), wait ``down_s``, start it
        again with its command line; for the API server, until it is ready."""
        process = self.processes[name]
        process.kill()
        process.wait()
        time.sleep(down_s)
        _spawn(self, name, self.commands[name])
        if name == "kube-apiserver":
            _wait(self, self.api_ready, timeout)


def _spawn(plane: ControlPlane, name: str, command: list[str]) -> None:
    plane.commands[name] = command
    log = (plane.directory / f"{name}.log").open("ab")
    plane.processes[name] = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=plane.directory,
        # A session of its own: the starting command's terminal (Ctrl-C, hang-up) cannot stop it.
        start_new_session=plane.detached,
    )


def _alive(plane: ControlPlane) -> None:
    for name, process in plane.processes.items():
        if process.poll() is not None:
            raise RuntimeError(
                f"{name} exited with {process.returncode}:\n{plane.log(name)[-3000:]}"
            )


def _wait(plane: ControlPlane, check: Callable[[], bool], timeout: float) -> None:
    """Until ``check`` passes; fails at once with its log if a component exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _alive(plane)
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the control plane was not ready within {timeout} s")


def write_kubeconfig(plane: ControlPlane, path: Path, token: str) -> Path:
    """A kubeconfig for ``plane`` that authenticates with ``token``."""
    # The API server writes a self-signed serving certificate into --cert-dir; trust it.
    ca = plane.directory / "certs" / "apiserver.crt"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "test",
                        "cluster": {"server": plane.server, "certificate-authority": str(ca)},
                    }
                ],
                "users": [{"name": "user", "user": {"token": token}}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": "user"}}],
                "current-context": "test",
            }
        )
    )
    return path


def _admin_configuration(plane: ControlPlane) -> client.Configuration:
    configuration = client.Configuration()
    configuration.host = plane.server
    configuration.ssl_ca_cert = str(plane.directory / "certs" / "apiserver.crt")
    configuration.api_key = {"authorization": f"Bearer {TOKEN}"}
    return configuration


def _self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for a server at 127.0.0.1, and its key."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "3650",
            "-subj",
            f"/CN={name}",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def _start_kubelet(plane: ControlPlane, images: bool) -> None:
    """Run the cluster's Running pods as local processes from now on (rigs/kubelet.py), in
    ``plane.directory``, and with ``images`` those of images podman holds as containers; it
    stops with the plane."""
    _spawn(
        plane,
        "kubelet",
        [
            sys.executable,
            "-m",
            "rigs.kubelet",
            f"--kubeconfig={plane.kubeconfig}",
            f"--dir={plane.directory}",
            f"--server={plane.server}",
            f"--ca={plane.directory / 'certs' / 'apiserver.crt'}",
            *(["--images"] if images else []),
        ],
    )


def _pod_stages(bin_dir: Path, directory: Path, run_pods: bool) -> list[Path]:
    """kwok's stages. Its pod-ready stage calls a pod Ready as it starts; where the pods run
    (``run_pods``), a pod starts not Ready instead, and the kubelet for processes makes it Ready
    when its readiness probe answers, as a kubelet does."""
    stages = sorted((bin_dir / "kwok-stages").glob("*.yaml"))
    if not run_pods:
        return stages
    ready = bin_dir / "kwok-stages" / "pod-ready.yaml"
    text = ready.read_text()
    for old, new in (
        ("name: pod-ready", "name: pod-running"),
        ('status: "True"\n        type: Ready', 'status: "False"\n        type: Ready'),
        (
            'status: "True"\n        type: ContainersReady',
            'status: "False"\n        type: ContainersReady',
        ),
        (
            "ready: true\n        restartCount: 0\n        state:\n          running:",
            "ready: false\n        restartCount: 0\n        state:\n          running:",
        ),
    ):
        if text.count(old) != 1:
            raise RuntimeError(f"{ready}: kwok's pod-ready stage changed; cannot find {old!r}")
        text = text.replace(old, new)
    running = directory / "pod-running.yaml"
    running.write_text(text)
    return [running if stage == ready else stage for stage in stages]


def start_control_plane(
    directory: Path,
    bin_dir: Path,
    *,
    detached: bool = False,
    run_pods: bool = False,
    images: bool = False,
) -> ControlPlane:
    """Start the control plane in ``directory`` (its data, certificates, logs and kubeconfig).

    ``detached`` processes outlive the Python process that started them (``baton dev-cluster``);
    otherwise they stop with :meth:`ControlPlane.stop`. With ``run_pods``, the kubelet for
    processes runs the Running pods (``rigs/kubelet.py``); with ``images`` too, a container whose
    image podman holds runs in a podman container (``rigs/containers.py``).
    """
    directory.mkdir(parents=True, exist_ok=True)
    etcd_port, etcd_peer, api_port = free_port(), free_port(), free_port()
    plane = ControlPlane(
        directory, f"https://127.0.0.1:{api_port}", directory / "kubeconfig", detached
    )
    key = directory / "sa.key"
    subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True)
    subprocess.run(
        ["openssl", "rsa", "-in", str(key), "-pubout", "-out", str(directory / "sa.pub")],
        check=True,
        capture_output=True,
    )
    (directory / "tokens.csv").write_text(f"{TOKEN},admin,admin,system:masters\n")
    (directory / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
    try:
        _spawn(
            plane,
            "etcd",
            [
                str(bin_dir / "etcd"),
                "--data-dir",
                str(directory / "etcd"),
                "--listen-client-urls",
                f"http://127.0.0.1:{etcd_port}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{etcd_peer}",
            ],
        )
        _spawn(
            plane,
            "kube-apiserver",
            [
                str(bin_dir / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                f"--secure-port={api_port}",
                f"--cert-dir={directory / 'certs'}",
                f"--token-auth-file={directory / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                f"--service-account-key-file={directory / 'sa.pub'}",
                f"--service-account-signing-key-file={key}",
                "--service-account-issuer=https://kubernetes.default.svc",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--allow-privileged=true",
                # the kubernetes Service needs no endpoints here (and cannot use loopback ones)
                "--endpoint-reconciler-type=none",
                f"--audit-policy-file={directory / 'audit-policy.yaml'}",
                f"--audit-log-path={directory / 'audit.log'}",
                "--audit-log-mode=blocking",  # written before the request returns: a test reads it
                # kwok serves every node's kubelet API at 127.0.0.1 (logs, port-forward); a
                # node's Hostname address resolves nowhere
                "--kubelet-preferred-address-types=InternalIP",
            ],
        )
        _wait(plane, plane.api_ready, 120)
        write_kubeconfig(plane, plane.kubeconfig, TOKEN)
        common = [f"--kubeconfig={plane.kubeconfig}", "--leader-elect=false"]
        _spawn(
            plane, "kube-scheduler", [str(bin_dir / "kube-scheduler"), *common, "--secure-port=0"]
        )
        _spawn(
            plane,
            "kube-controller-manager",
            [
                str(bin_dir / "kube-controller-manager"),
                *common,
                "--secure-port=0",
                f"--service-account-private-key-file={key}",
                "--use-service-account-credentials=false",
            ],
        )
        api = client.ApiClient(_admin_configuration(plane))
        for crd in sorted((bin_dir / "kwok-crds").glob("*.yaml")):
            apply_crd(api, yaml.safe_load(crd.read_text()))
        kubelet_port = free_port()
        cert, key_file = _self_signed(directory, "kwok")
        _spawn(
            plane,
            "kwok",
            [
                str(bin_dir / "kwok"),
                f"--kubeconfig={plane.kubeconfig}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
                # Every node's kubelet API (logs, port-forward) at one address, over TLS as the
                # API server dials it; the pods' log files and ports are in Logs and PortForward
                # objects (rigs/kubelet.py writes them).
                "--node-ip=127.0.0.1",
                f"--node-port={kubelet_port}",
                f"--server-address=127.0.0.1:{kubelet_port}",
                f"--tls-cert-file={cert}",
                f"--tls-private-key-file={key_file}",
                "--enable-crds=Logs,PortForward",
                f"--cidr={POD_CIDR}",
                # A kubelet's Lease: without one, kube-controller-manager marks every tray
                # NotReady after its 50 s grace period and kwok flips it back, over and over.
                f"--node-lease-duration-seconds={NODE_LEASE_SECONDS}",
                *(f"--config={stage}" for stage in _pod_stages(bin_dir, directory, run_pods)),
            ],
        )
        if run_pods:
            _start_kubelet(plane, images)
        _alive(plane)
    except BaseException:
        plane.stop()
        raise
    return plane


def _create_kwok_nodes(api: client.ApiClient, nodes: list[dict[str, Any]], timeout: float) -> None:
    """Create ``nodes`` for kwok to play their kubelets, and wait until all are Ready."""
    core = client.CoreV1Api(api)
    for node in nodes:
        node["metadata"].setdefault("annotations", {})[KWOK_ANNOTATION] = "fake"
        # kwok initialises a node that is not Ready yet: its conditions, and its kubelet's
        # address and port (where the API server asks for logs and port-forwards). The
        # caller's dict keeps its conditions: it is the node as it will be.
        body = {**node, "status": {k: v for k, v in node["status"].items() if k != "conditions"}}
        # The model the client would validate the dict into itself: the request is the same.
        core.create_node(client.V1Node.model_validate(body))
    names = {node["metadata"]["name"] for node in nodes}

    def all_ready() -> bool:
        ready = {n.metadata.name for n in core.list_node().items if n.metadata and node_ready(n)}
        return names <= ready

    eventually(all_ready, timeout=timeout, interval=0.5)


def add_trays(
    api: client.ApiClient,
    racks: int,
    *,
    first_rack: int = 0,
    trays_per_rack: int = 18,
    name_prefix: str = "",
    timeout: float = 120,
) -> list[dict[str, Any]]:
    """Create ``racks`` synthetic GB300 racks as kwok nodes and wait until all are Ready.

    Racks are numbered from ``first_rack``, so racks added later join those already there.
    ``name_prefix`` keeps node names unique across tests: a pod of an earlier test that is
    still terminating names its node, and must not count against a new tray of that name.
    """
    # A rack's ClusterUUID depends on its index alone: the first racks of a longer list are
    # the racks created before.
    nodes = synthetic_nodes(first_rack + racks, trays_per_rack=trays_per_rack)[
        first_rack * trays_per_rack :
    ]
    for node in nodes:
        meta = node["metadata"]
        meta["name"] = name_prefix + meta["name"]
        meta["labels"][HOSTNAME_LABEL] = meta["name"]
        status = node["status"]
        for field_name in ("allocatable", "capacity"):
            status[field_name].update(TRAY_RESOURCES)
    _create_kwok_nodes(api, nodes, timeout)
    return nodes


def add_cpu_nodes(
    api: client.ApiClient, count: int, *, name_prefix: str = "", timeout: float = 60
) -> list[dict[str, Any]]:
    """Create ``count`` CPU nodes (``cpu-0``, ...) as kwok nodes and wait until all are Ready.

    A real cluster runs its system pods (Baton's controller, gateway and EPLB service among them)
    on such nodes: no GPU labels, no GPU resource and no taint, so a pod that tolerates nothing
    schedules there, never on a tray.
    """
    nodes = []
    for index in range(count):
        name = f"{name_prefix}cpu-{index}"
        nodes.append(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "labels": {
                        HOSTNAME_LABEL: name,
                        NODE_ARCH_LABEL: "amd64",
                        NODE_OS_LABEL: "linux",
                    },
                },
                "spec": {},
                "status": {
                    "capacity": dict(CPU_NODE_RESOURCES),
                    "allocatable": dict(CPU_NODE_RESOURCES),
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            }
        )
    _create_kwok_nodes(api, nodes, timeout)
    return nodes


def node_ready(node: client.V1Node) -> bool:
    """Whether the node reports Ready (a fake tray does once kwok plays its kubelet)."""
    conditions = node.status.conditions if node.status else None
    return any(c.type == "Ready" and c.status == "True" for c in conditions or [])


def mark_tray_not_ready(api: client.ApiClient, name: str) -> None:
    """The tray's kubelet stops: kwok no longer plays it (no status, no Lease renewal) and its
    Ready condition goes False, as a kubelet reports when its runtime or network fails."""
    core = client.CoreV1Api(api)
    core.patch_node(name, {"metadata": {"annotations": {KWOK_ANNOTATION: None}}})
    # A strategic merge patch replaces the Ready condition alone (conditions merge by type).
    ready = {
        "type": "Ready",
        "status": "False",
        "reason": "KubeletNotReady",
        "message": "marked not ready by the dev cluster",
        "lastTransitionTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    core.patch_node_status(name, {"status": {"conditions": [ready]}})


def mark_tray_ready(api: client.ApiClient, name: str, timeout: float = 60) -> None:
    """kwok plays the tray's kubelet again; returns once the tray reports Ready."""
    core = client.CoreV1Api(api)
    core.patch_node(name, {"metadata": {"annotations": {KWOK_ANNOTATION: "fake"}}})
    eventually(lambda: node_ready(core.read_node(name)), timeout=timeout, interval=0.5)


def remove_nodes(api: client.ApiClient, nodes: list[dict[str, Any]]) -> None:
    core = client.CoreV1Api(api)
    for node in nodes:
        try:
            core.delete_node(node["metadata"]["name"])
        except ApiException as exc:
            if exc.status != 404:
                raise


def create_model_deployment(
    api: client.ApiClient, namespace: str, name: str, spec: dict[str, Any]
) -> dict[str, Any]:
    """Create a ModelDeployment with ``spec`` as given (the API server validates it)."""
    manifest = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name},
        "spec": spec,
    }
    return json_object(
        client.CustomObjectsApi(api).create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, manifest
        )
    )


def read_model_deployment(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return json_object(
        client.CustomObjectsApi(api).get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name
        )
    )


def patch_model_deployment_spec(
    api: client.ApiClient, namespace: str, name: str, spec: dict[str, Any]
) -> None:
    """Merge ``spec`` into the ModelDeployment's spec."""
    client.CustomObjectsApi(api).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name, {"spec": spec}
    )


def install_crd(api: client.ApiClient) -> None:
    """Apply the generated ModelDeployment CRD and wait until the API server serves it."""
    apply_crd(api, yaml.safe_load((ROOT / CRD_PATH).read_text()))


def apply_crd(api: client.ApiClient, crd: dict[str, Any]) -> None:
    """Create ``crd`` (unless it exists) and wait until the API server serves its resource."""
    extensions = client.ApiextensionsV1Api(api)
    names, group = crd["spec"]["names"], crd["spec"]["group"]
    version = crd["spec"]["versions"][0]["name"]
    try:
        extensions.create_custom_resource_definition(
            client.V1CustomResourceDefinition.model_validate(crd)
        )
    except ApiException as exc:
        if exc.status != 409:
            raise

    custom = client.CustomObjectsApi(api)

    def served() -> bool:
        # Names are accepted before the CRD is Established, and the API server installs the
        # resource's handler after that: until then a request gets "404 page not found".
        status = extensions.read_custom_resource_definition(crd["metadata"]["name"]).status
        conditions = {c.type: c.status for c in (status.conditions or [])} if status else {}
        if conditions.get("Established") != "True":
            return False
        try:
            custom.list_cluster_custom_object(group, version, names["plural"], limit=1)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    eventually(served, timeout=30)


def fail_pod(api: client.ApiClient, namespace: str, name: str) -> None:
    """The pod's engine exits for good: phase Failed, as a kubelet reports it."""
    core = client.CoreV1Api(api)
    failing = core.read_namespaced_pod_status(name, namespace)
    if failing.status is None:
        raise RuntimeError(f"pod {namespace}/{name} has no status yet; fail it once it runs")
    failing.status.phase = "Failed"
    core.replace_namespaced_pod_status(name, namespace, failing)


def record_tray_failures(api: client.ApiClient, tray: str, count: int) -> str:
    """``count`` earlier Baton pod failures on ``tray``'s record, an hour ago (within the
    controller's failure window); returns the annotation written."""
    hour_ago = datetime.now(UTC) - timedelta(hours=1)
    earlier = ",".join(rfc3339(hour_ago + timedelta(minutes=5 * i)) for i in range(count))
    client.CoreV1Api(api).patch_node(
        tray, {"metadata": {"annotations": {TRAY_FAILURES_ANNOTATION: earlier}}}
    )
    return earlier


def start_controller(
    plane: ControlPlane,
    identity: str,
    lease: str,
    *,
    kubeconfig: Path | None = None,
    lease_namespace: str = "default",
    metrics_port: int | None = None,
    extra: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """``baton controller`` against ``plane`` (as admin unless ``kubeconfig`` says otherwise),
    with ``extra`` arguments, logging to ``<identity>.log`` in the plane's directory."""
    log = (plane.directory / f"{identity}.log").open("ab")
    return subprocess.Popen(
        baton_command(
            "controller",
            f"--kubeconfig={kubeconfig or plane.kubeconfig}",
            f"--lease-name={lease}",
            f"--lease-namespace={lease_namespace}",
            f"--identity={identity}",
            f"--metrics-port={metrics_port or free_port()}",
            "--metrics-host=127.0.0.1",
            *extra,
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    """The ModelDeployment's condition of type ``kind`` ({} when it has none)."""
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def pods(api: client.ApiClient, namespace: str, role: str | None = None) -> dict[str, Any]:
    """Baton's pods in ``namespace`` by name, of one role (decode, prefill) or all."""
    selector = f"{ROLE_LABEL}={role}" if role else DEPLOYMENT_LABEL
    listed = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=selector).items
    # A listed object always has a name: the condition only narrows the type.
    return {p.metadata.name: p for p in listed if p.metadata and p.metadata.name}


def partial_groups(api: client.ApiClient, namespace: str, group_pods: int) -> list[str]:
    """Decode groups being started while some of their pods are missing, one line per cell.

    The controller lifts the gates of a group's pods (one call each) only once all of them
    exist, so gated and started pods side by side must be the whole group. Started pods with
    members missing and none gated is a group that lost a pod, which the controller then
    restarts whole."""
    cells: dict[str, list[Any]] = {}
    for pod in pods(api, namespace, "decode").values():
        if pod.metadata.deletion_timestamp is None:
            cells.setdefault(pod.metadata.labels.get(CELL_LABEL, ""), []).append(pod)
    found = []
    for cell, members in sorted(cells.items()):
        started = [pod for pod in members if not pod.spec.scheduling_gates]
        gated = len(members) - len(started)
        if started and gated and len(members) < group_pods:
            found.append(f"cell {cell}: {len(started)} started, {gated} gated, {group_pods} wanted")
    return found
