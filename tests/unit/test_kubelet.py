"""The dev cluster's kubelet decides how a pod runs here: its program, address, environment and
mounts (``launch_of``), a container of an image podman holds as a podman container
(``podman_argv``, ``run_as``), and the names cluster DNS would give (``hosts_entries``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from baton.core.api import ModelDeploymentSpec
from controller.placement import CellPlacement, PrefillInstance
from controller.podspec import render_cell
from rigs.containers import SERVICE_ACCOUNT_MOUNT, ContainerRefused, podman_argv, run_as
from rigs.kubelet import NotRunnable, hosts_entries, launch_of
from rigs.processes import baton_command

IP = "127.64.0.7"


def _pod(containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "p",
            "namespace": "serving",
            "uid": "u-1",
            "labels": {},
            "creationTimestamp": "2026-12-05T00:00:00Z",
        },
        "spec": {"containers": containers, "nodeName": "rack-0-tray-0", **spec},
        "status": {"podIP": IP, "phase": "Running"},
    }


def _no_lookup(kind: str, name: str, key: str) -> str | None:
    return None


def test_an_engine_pod_runs_as_baton_sim_with_its_rendered_vllm_flags_at_its_pod_ip() -> None:
    spec = ModelDeploymentSpec.model_validate({"model": "deepseek-ai/DeepSeek-V4.1-Flash"})
    placement = CellPlacement(
        name="dsv4-cell-0",
        deployment="dsv4",
        domain="d",
        decode_trays=tuple(f"t{i}" for i in range(8)),
        prefill=(PrefillInstance(0, "t9", (0, 1)),),
        spare_trays=(),
        max_prefill_instances=1,
    )
    pod = next(
        m
        for m in render_cell(spec, placement, deployment="dsv4", uid="u", namespace="serving")
        if m["kind"] == "Pod"
    )
    pod["status"] = {"podIP": IP}
    container = pod["spec"]["containers"][0]
    mounts = {"/opt/baton/vllm-plugin": Path("/pods/p/volumes/plugin")}
    launch = launch_of(pod, container, mounts=mounts, lookup=_no_lookup)
    rendered = container["command"]
    assert rendered[:2] == ["vllm", "serve"]
    assert launch.argv == [*baton_command("sim", *rendered[2:]), "--host", IP]
    # what the kubelet fills from the pod
    assert launch.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == IP
    # the plugin installed for vLLM is not the simulator's to load
    assert "PYTHONPATH" not in launch.env


def test_a_chart_pod_binds_its_pod_ip_where_it_says_every_interface() -> None:
    container = {
        "name": "gateway",
        "command": ["baton", "gateway"],
        "args": ["--host=0.0.0.0", "--port=8000", "--engine-api-key-file=/var/run/key/k"],
    }
    mounts = {"/var/run/key": Path("/pods/p/volumes/key")}
    launch = launch_of(_pod([container]), container, mounts=mounts, lookup=_no_lookup)
    assert launch.argv == baton_command(
        "gateway", f"--host={IP}", "--port=8000", "--engine-api-key-file=/pods/p/volumes/key/k"
    )


def test_a_volume_over_tmp_renames_the_pods_paths_not_the_interpreter_that_runs_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # CI's checkout (and so its interpreter) lives under /tmp, where the gateway mounts an emptyDir
    monkeypatch.setattr("sys.executable", "/tmp/ci/.venv/bin/python3")
    container = {"name": "gateway", "command": ["baton", "gateway"], "args": ["--x=/tmp/a"]}
    mounts = {"/tmp": Path("/pods/p/volumes/tmp")}
    launch = launch_of(_pod([container]), container, mounts=mounts, lookup=_no_lookup)
    assert launch.argv == [
        "/tmp/ci/.venv/bin/python3",
        "-m",
        "baton.cli",
        "gateway",
        "--x=/pods/p/volumes/tmp/a",
    ]


def test_secrets_and_fields_fill_the_environment_and_a_missing_key_is_named() -> None:
    container = {
        "name": "c",
        "command": ["python", "-c", "pass"],
        "env": [
            {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
    }
    values = {("Secret", "s", "k"): "sekret"}
    launch = launch_of(
        _pod([container]),
        container,
        mounts={},
        lookup=lambda kind, name, key: values.get((kind, name, key)),
        kubeconfig=Path("/pods/p/kubeconfig"),
    )
    assert launch.env["KEY"] == "sekret"
    assert launch.env["POD"] == "p"
    assert launch.env["KUBECONFIG"] == "/pods/p/kubeconfig"
    with pytest.raises(NotRunnable, match="Secret s has no key k"):
        launch_of(_pod([container]), container, mounts={}, lookup=_no_lookup)


def test_a_program_the_machine_cannot_run_is_named() -> None:
    container = {"name": "web", "command": ["nginx", "-g", "daemon off;"]}
    with pytest.raises(NotRunnable, match="nginx: the dev cluster runs Baton's CLI"):
        launch_of(_pod([container]), container, mounts={}, lookup=_no_lookup)


def test_a_service_names_its_oldest_ready_pod_and_a_pod_with_a_subdomain_its_own() -> None:
    ready = {"conditions": [{"type": "Ready", "status": "True"}]}
    older = _pod([], hostname="dsv4-cell-0-decode-0", subdomain="dsv4-cell-0-decode")
    older["metadata"] |= {"name": "a", "labels": {"app": "gw"}}
    older["status"] |= ready
    newer = _pod([])
    newer["status"] |= ready
    newer["metadata"] |= {
        "name": "b",
        "labels": {"app": "gw"},
        "creationTimestamp": "2026-12-05T01:00:00Z",
    }
    newer["status"]["podIP"] = "127.64.0.9"
    service = {
        "metadata": {"name": "baton-gateway", "namespace": "serving"},
        "spec": {"selector": {"app": "gw"}},
    }
    names = hosts_entries([service], [newer, older])
    for alias in (
        "baton-gateway",
        "baton-gateway.serving",
        "baton-gateway.serving.svc",
        "baton-gateway.serving.svc.cluster.local",
    ):
        assert names[alias] == IP
    assert names["dsv4-cell-0-decode-0.dsv4-cell-0-decode.serving.svc"] == IP
    # a Service whose pods are not running resolves nowhere; nor one whose pods are not Ready
    lonely = {"metadata": {"name": "x", "namespace": "serving"}, "spec": {"selector": {"a": "b"}}}
    assert "x" not in hosts_entries([lonely], [older])
    older["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    assert hosts_entries([service], [older, newer])["baton-gateway"] == "127.64.0.9"
    newer["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    assert "baton-gateway" not in hosts_entries([service], [older, newer])


def _chart_like_pod(**container_context: Any) -> dict[str, Any]:
    container = {
        "name": "gateway",
        "image": "ghcr.io/baton-dev/baton:0.1.0",
        "command": ["baton", "gateway"],
        "args": ["--host=0.0.0.0", "--port=8000"],
        "securityContext": container_context,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    return _pod(
        [container],
        securityContext={"runAsUser": 65532, "runAsNonRoot": True, "fsGroup": 65532},
    )


def test_a_container_of_an_image_runs_in_podman_as_its_security_context_says() -> None:
    pod = _chart_like_pod(
        readOnlyRootFilesystem=True,
        allowPrivilegeEscalation=False,
        capabilities={"drop": ["ALL"]},
    )
    container = pod["spec"]["containers"][0]
    argv = podman_argv(
        pod,
        container,
        image_user="65532:65532",
        env={"HOSTNAME": "p"},
        mounts=[(Path("/pods/p/volumes/tmp"), "/tmp", False), (Path("/s"), "/etc/s", True)],
        hosts=Path("/dev-cluster/hosts"),
        service_account=Path("/pods/p/serviceaccount"),
        server="https://127.0.0.1:6443",
    )
    assert argv[:2] == ["podman", "run"]
    image = argv.index("ghcr.io/baton-dev/baton:0.1.0")
    flags, command = argv[2:image], argv[image + 1 :]
    assert command == [f"--host={IP}", "--port=8000"]  # every interface is the pod's address
    assert '--entrypoint=["baton", "gateway"]' in flags
    assert {"--user=65532", "--group-add", "--read-only", "--read-only-tmpfs=false"} <= set(flags)
    assert {"--cap-drop=all", "--security-opt", "no-new-privileges", "--network=host"} <= set(flags)
    assert "--volume=/pods/p/volumes/tmp:/tmp" in flags and "--volume=/s:/etc/s:ro" in flags
    assert "--volume=/dev-cluster/hosts:/etc/hosts:ro" in flags
    assert f"--volume=/pods/p/serviceaccount:{SERVICE_ACCOUNT_MOUNT}:ro" in flags
    assert "--env=KUBERNETES_SERVICE_HOST=127.0.0.1" in flags
    assert "--env=KUBERNETES_SERVICE_PORT=6443" in flags


def test_run_as_takes_the_containers_user_over_the_pods_and_the_images_last() -> None:
    pod = _chart_like_pod(runAsUser=1000, runAsGroup=2000)
    assert run_as(pod, pod["spec"]["containers"][0], "65532:65532") == "1000:2000"
    pod = _chart_like_pod()
    assert run_as(pod, pod["spec"]["containers"][0], "") == "65532"
    del pod["spec"]["securityContext"]["runAsUser"]
    assert run_as(pod, pod["spec"]["containers"][0], "65532:65532") == "65532:65532"


@pytest.mark.parametrize(("image_user", "why"), [("", "root"), ("0", "root"), ("baton", "numeric")])
def test_run_as_non_root_refuses_an_image_that_would_run_as_root(image_user: str, why: str) -> None:
    pod = _chart_like_pod()
    del pod["spec"]["securityContext"]["runAsUser"]
    with pytest.raises(ContainerRefused, match=why):
        run_as(pod, pod["spec"]["containers"][0], image_user)
