"""A dev cluster whose pods run (rigs/kubelet.py): an engine process that dies ends its pod
Failed, as a real kubelet reports a crashed vLLM, and the controller gang-restarts the decode
group onto running engines; a pod whose program cannot run here says so in an Event."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from baton.core.api import GROUP, PLURAL, VERSION
from baton.core.kube import api_client, raw_json
from baton.core.labels import DEPLOYMENT_LABEL, ROLE_LABEL
from rigs.devcluster import (
    ControlPlane,
    add_cpu_nodes,
    add_trays,
    binaries_dir,
    install_crd,
    start_control_plane,
    start_controller,
)
from rigs.processes import eventually, stop_process

NAMESPACE = "serving"


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = start_control_plane(tmp_path_factory.mktemp("pods"), binaries_dir(), run_pods=True)
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="module")
def api(plane: ControlPlane) -> client.ApiClient:
    api = api_client(plane.kubeconfig)
    add_cpu_nodes(api, 1)
    add_trays(api, 1)
    install_crd(api)
    client.CoreV1Api(api).create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE))
    )
    return api


def _pods(api: client.ApiClient) -> list[dict[str, Any]]:
    listed = client.CoreV1Api(api).list_namespaced_pod(
        NAMESPACE, label_selector=DEPLOYMENT_LABEL, _preload_content=False
    )
    return list(raw_json(listed)["items"])


def _ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _engine_pid(ip: str) -> int:
    """The pid of the ``baton sim`` serving at ``ip`` (the engine of the pod with that IP)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"sim" in argv and b"--host" in argv and ip.encode() in argv:
            return int(entry.name)
    raise LookupError(f"no baton sim serving at {ip}")


def test_an_engine_that_dies_fails_its_pod_and_the_group_restarts_onto_running_engines(
    plane: ControlPlane, api: client.ApiClient
) -> None:
    controller = start_controller(plane, "controller-0", "baton-controller")
    custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    try:
        custom.create_namespaced_custom_object(
            GROUP,
            VERSION,
            NAMESPACE,
            PLURAL,
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "ModelDeployment",
                "metadata": {"name": "dsv4"},
                "spec": {
                    "model": "deepseek-ai/DeepSeek-V4.1-Flash",
                    "cell": {"prefill": {"instances": 1}},
                },
            },
        )

        def all_ready() -> list[dict[str, Any]] | None:
            pods = _pods(api)
            running = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
            if len(running) == 9 and all(_ready(p) for p in running):
                return running
            return None

        # Ready only once every engine answers its probe (kwok alone calls them Ready at once)
        first = eventually(all_ready, timeout=240, interval=1)
        assert first is not None
        decode = sorted(
            (p for p in first if p["metadata"]["labels"][ROLE_LABEL] == "decode"),
            key=lambda p: p["metadata"]["name"],
        )
        victim = decode[3]
        os.kill(_engine_pid(victim["status"]["podIP"]), signal.SIGKILL)

        def failed() -> bool:
            pod = raw_json(
                core.read_namespaced_pod(
                    victim["metadata"]["name"], NAMESPACE, _preload_content=False
                )
            )
            replaced = pod["metadata"]["uid"] != victim["metadata"]["uid"]
            return replaced or bool(pod["status"].get("phase") == "Failed")

        eventually(failed, timeout=60, interval=0.5)
        # the whole group comes back as new pods, their engines answering
        before = {p["metadata"]["uid"] for p in decode}

        def restarted() -> bool:
            pods = all_ready()
            if pods is None:
                return False
            now = {
                p["metadata"]["uid"]
                for p in pods
                if p["metadata"]["labels"][ROLE_LABEL] == "decode"
            }
            return not (now & before)

        eventually(restarted, timeout=300, interval=1)
        events = core.list_namespaced_event(NAMESPACE).items
        assert "GroupRestarting" in {e.reason for e in events}
    finally:
        stop_process(controller)


def test_a_pod_whose_program_cannot_run_here_says_so(api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(
        NAMESPACE,
        client.V1Pod(
            metadata=client.V1ObjectMeta(name="web"),
            spec=client.V1PodSpec(
                containers=[client.V1Container(name="web", image="nginx", command=["nginx"])]
            ),
        ),
    )

    def told() -> str | None:
        events = core.list_namespaced_event(NAMESPACE, field_selector="involvedObject.name=web")
        return next((e.message for e in events.items if e.reason == "NotRun"), None)

    message = eventually(told, timeout=60, interval=0.5)
    assert message is not None
    assert "nginx: the dev cluster runs Baton's CLI, python and `vllm serve`" in message
