"""``baton dev-cluster`` as a user runs it: every subcommand a process of its own, the cluster's
processes outliving the one that started them and all gone after ``stop``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import psutil

from baton.core.labels import CLIQUE_LABEL, GPU_RESOURCE, GPU_TAINT_KEY
from rigs.devcluster import KWOK_ANNOTATION, binaries_dir
from rigs.processes import baton_command
from tests.helpers import ROOT


def dev_cluster(
    directory: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        baton_command("dev-cluster", *args, "--dir", str(directory)),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=env,
    )


def kubectl(kubeconfig: str, *args: str) -> Any:
    shown = subprocess.run(
        [str(binaries_dir() / "kubectl"), f"--kubeconfig={kubeconfig}", *args, "--output=json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(shown.stdout)


def ready(node: dict[str, Any]) -> str:
    status: str = next(c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready")
    return status


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_without_the_binaries_start_names_make_dev_bin(tmp_path: Path) -> None:
    env = {**os.environ, "BATON_DEV_BIN": str(tmp_path / "not-built")}
    started = dev_cluster(tmp_path / "cluster", "start", env=env)
    assert started.returncode == 1
    assert "make dev-bin" in started.stderr and "Traceback" not in started.stderr
    assert not (tmp_path / "cluster").exists()


def test_start_add_a_rack_fail_a_tray_and_stop(tmp_path: Path) -> None:
    directory = tmp_path / "cluster"
    started = dev_cluster(directory, "start", "--racks", "1", "--cpu-nodes", "1")
    assert started.returncode == 0, started.stderr  # a failed start stops what it started
    state = json.loads((directory / "state.json").read_text())
    pids = [process["pid"] for process in state["processes"].values()]
    assert len(pids) == 6 and all(map(alive, pids))  # they outlived the command (kubelet too)
    try:
        kubeconfig = str(directory / "kubeconfig")
        assert f"export KUBECONFIG={kubeconfig}" in started.stdout.splitlines()
        assert dev_cluster(directory, "kubeconfig").stdout.strip() == kubeconfig
        again = dev_cluster(directory, "start")
        assert again.returncode == 1
        assert str(directory / "state.json") in again.stderr and "stop" in again.stderr

        added = dev_cluster(directory, "add-racks", "1")
        assert added.returncode == 0, added.stderr
        nodes = kubectl(kubeconfig, "get", "nodes")["items"]
        trays = [n for n in nodes if CLIQUE_LABEL in n["metadata"]["labels"]]
        [cpu_node] = [n for n in nodes if n not in trays]
        assert len(trays) == 36 and {ready(n) for n in trays} == {"True"}
        assert len({n["metadata"]["labels"][CLIQUE_LABEL] for n in trays}) == 2  # two racks
        assert ready(cpu_node) == "True" and GPU_RESOURCE not in cpu_node["status"]["allocatable"]
        # Kubernetes' own not-ready taint may still be leaving a new node; never the GPU one.
        assert GPU_TAINT_KEY not in {t["key"] for t in cpu_node["spec"].get("taints", [])}
        assert all(GPU_TAINT_KEY in {t["key"] for t in n["spec"]["taints"]} for n in trays)

        failed = dev_cluster(directory, "tray", "rack-1-tray-3", "--not-ready")
        assert failed.returncode == 0, failed.stderr
        tray = kubectl(kubeconfig, "get", "node", "rack-1-tray-3")
        assert ready(tray) == "False"
        assert KWOK_ANNOTATION not in tray["metadata"].get("annotations", {})
        restored = dev_cluster(directory, "tray", "rack-1-tray-3", "--ready")
        assert restored.returncode == 0, restored.stderr
        tray = kubectl(kubeconfig, "get", "node", "rack-1-tray-3")
        assert ready(tray) == "True" and tray["metadata"]["annotations"][KWOK_ANNOTATION]

        status = dev_cluster(directory, "status")
        assert status.returncode == 0, status.stdout
        assert "36/36 Ready in 2 racks" in status.stdout

        # docs/dev-cluster.md's install, as a user pastes it: the chart owns its CRD (a CRD the
        # dev cluster had applied itself made `helm install` fail: "exists and cannot be
        # imported into the current release")
        helm = [str(binaries_dir() / "helm"), "--kubeconfig", kubeconfig]
        subprocess.run(
            [
                str(binaries_dir() / "kubectl"),
                f"--kubeconfig={kubeconfig}",
                "create",
                "namespace",
                "serving",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        installed = subprocess.run(
            [
                *helm,
                "install",
                "baton",
                str(ROOT / "helm" / "baton"),
                "-n",
                "baton-system",
                "--create-namespace",
                "--set",
                "gateway.modelDeployments={serving/dsv4}",
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert installed.returncode == 0, installed.stderr
        crd = kubectl(kubeconfig, "get", "crd", "modeldeployments.baton.dev")
        assert crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == "baton"
    finally:
        stopped = dev_cluster(directory, "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert not [pid for pid in pids if alive(pid)]
    assert dev_cluster(directory, "stop").returncode == 0  # nothing left to stop
    late = dev_cluster(directory, "add-racks", "1")
    assert late.returncode == 1 and "baton dev-cluster start" in late.stderr
