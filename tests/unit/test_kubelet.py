"""The dev cluster's kubelet decides how a pod runs here: its program, address, environment and
mounts (``launch_of``), and the names cluster DNS would give (``hosts_entries``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from baton.core.api import ModelDeploymentSpec
from controller.placement import CellPlacement, PrefillInstance
from controller.podspec import render_cell
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
