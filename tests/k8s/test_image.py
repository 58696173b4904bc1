"""Baton's image (``make image``) as the chart runs it: the dev cluster's kubelet runs every
container whose image podman holds in a podman container of that image (rigs/containers.py),
with the pod's command, args, environment, mounted Secrets and ConfigMaps, service account,
user and read-only root file system. The chart's controller, gateway and EPLB service run from
the image; the engines are ``baton sim`` processes, whose EPLB plugin the decode pods' init
container installs from the image into their volume; a client chats through the gateway's
container port."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from kubernetes import client

from baton.core.api import BATON_IMAGE
from baton.core.kube import api_client, raw_json
from rigs.containers import image_present, podman_env
from rigs.devcluster import (
    ControlPlane,
    add_cpu_nodes,
    add_trays,
    binaries_dir,
    pods,
    start_control_plane,
)
from rigs.processes import eventually
from tests.helpers import ROOT
from tests.k8s.helpers import MODEL, apply, wait_ready

NAMESPACE, RELEASE = "serving", "baton"
CLIENT_KEY = "client-key"


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    assert image_present(BATON_IMAGE), f"{BATON_IMAGE} is not built: run `make image`"
    directory = tmp_path_factory.mktemp("image")
    plane = start_control_plane(directory, binaries_dir(), run_pods=True, images=True)
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="module")
def api(plane: ControlPlane) -> client.ApiClient:
    api = api_client(plane.kubeconfig)
    add_cpu_nodes(api, 1)
    add_trays(api, 1)
    client.CoreV1Api(api).create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE))
    )
    return api


def _podman(*args: str) -> Any:
    shown = subprocess.run(
        ["podman", *args], env=podman_env(), capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(shown.stdout)


def _containers() -> dict[str, dict[str, Any]]:
    """The running podman containers by name, inspected."""
    names = [c["Names"][0] for c in _podman("ps", "--format=json")]
    return {c["Name"]: c for c in _podman("inspect", *names)} if names else {}


def _of(containers: dict[str, dict[str, Any]], container: str) -> list[dict[str, Any]]:
    return [c for name, c in containers.items() if name.startswith(f"k8s_{container}_")]


@pytest.mark.timeout(900)
def test_the_charts_pods_run_from_the_image_and_serve_a_chat_through_the_gateway(
    plane: ControlPlane, api: client.ApiClient, tmp_path: Path
) -> None:
    # Secrets the chart's containers read: the clients' API keys (an environment variable),
    # the engines' API key and the EPLB reports' token (mounted files); the engines' namespace
    # holds the same two under the same names, as docs/operator.md says.
    core = client.CoreV1Api(api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="baton-system")))
    secrets = {
        "gateway-keys": {"api-keys": f"other-key,{CLIENT_KEY}"},
        "engine-key": {"api-key": "engine-secret"},
        "eplb-token": {"token": "report-secret"},
    }
    for namespace in ("baton-system", NAMESPACE):
        for name, data in secrets.items():
            body = client.V1Secret(metadata=client.V1ObjectMeta(name=name), string_data=data)
            core.create_namespaced_secret(namespace, body)
    helm = [str(binaries_dir() / "helm"), "--kubeconfig", str(plane.kubeconfig)]
    installed = subprocess.run(
        [
            *helm,
            "install",
            RELEASE,
            str(ROOT / "helm" / "baton"),
            "-n",
            "baton-system",
            "--set",
            f"gateway.modelDeployments={{{NAMESPACE}/dsv4}}",
            "--set",
            "controller.replicas=1",
            "--set",
            "gateway.replicas=1",
            "--set",
            "gateway.apiKeySecret.name=gateway-keys",
            "--set",
            "gateway.engineApiKeySecret.name=engine-key",
            "--set",
            "eplb.tokenSecret.name=eplb-token",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert installed.returncode == 0, installed.stderr
    # The engines report to the release's EPLB service: the decode pods get the plugin's init
    # container, from Baton's image.
    apply(
        api,
        NAMESPACE,
        "dsv4",
        {
            "cell": {"decode": {"dep": 4, "spareTrays": 0}, "prefill": {"instances": 1}},
            "engine": {"apiKeySecret": {"name": "engine-key", "key": "api-key"}},
            "eplb": {
                "reportUrl": f"http://{RELEASE}-eplb.baton-system.svc:9091",
                "tokenSecret": {"name": "eplb-token", "key": "token"},
            },
        },
    )
    # Ready is the controller's word: the controller runs in its container, leads, places and
    # publishes the engines it finds answering.
    status = wait_ready(api, NAMESPACE, "dsv4", timeout=300)["status"]
    assert status["endpoints"]["cells"]

    def gateway_ready() -> str | None:
        listed = core.list_namespaced_pod(
            "baton-system",
            label_selector="app.kubernetes.io/component=gateway",
            _preload_content=False,
        )
        for pod in raw_json(listed)["items"]:
            conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
            if conditions.get("Ready") == "True":
                return str(pod["status"]["podIP"])
        return None

    address = eventually(gateway_ready, timeout=300, interval=1)
    anonymous = openai.OpenAI(base_url=f"http://{address}:8000/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()
    # The gateway read the engines' key from its mounted Secret: the engines accept its calls.
    chat = openai.OpenAI(base_url=f"http://{address}:8000/v1", api_key=CLIENT_KEY, max_retries=0)
    stream = chat.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello"}],
        max_tokens=8,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text

    # Each of the chart's processes is a container of the image, as the chart's pod spec says.
    running = _containers()
    for component in ("controller", "gateway", "eplb"):
        [container] = _of(running, component)
        assert container["ImageName"] == BATON_IMAGE
        assert container["Config"]["User"] == "65532"  # the chart's runAsUser
        assert container["HostConfig"]["ReadonlyRootfs"] is True
        assert container["HostConfig"]["CapDrop"]  # capabilities: drop ALL
        assert "no-new-privileges" in container["HostConfig"]["SecurityOpt"]
    [eplb] = _of(running, "eplb")
    mounts = {m["Destination"]: m["RW"] for m in eplb["Mounts"]}
    # the chart's ConfigMap and the token's Secret, read-only
    assert mounts["/etc/baton/eplb.yaml"] is False and mounts["/etc/baton/eplb-token"] is False
    # The gateway found its deployment through the API server as its service account.
    [gateway] = _of(running, "gateway")
    assert any(m["Destination"].endswith("/serviceaccount") for m in gateway["Mounts"])

    # The plugin's init container ran from the image and filled the engine's volume.
    decode = next(iter(pods(api, NAMESPACE, "decode").values()))
    pod_dirs = list((plane.directory / "pods").glob(f"{NAMESPACE}_{decode.metadata.name}_*"))
    [entry_points] = [
        path for d in pod_dirs for path in d.glob("volumes/*/*.dist-info/entry_points.txt")
    ]
    assert "vllm.general_plugins" in entry_points.read_text()
