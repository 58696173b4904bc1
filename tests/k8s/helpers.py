"""Helpers for tests that drive ModelDeployments on the test cluster."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from kubernetes import client

from baton.core.labels import DEPLOYMENT_LABEL, ROLE_LABEL
from rigs.devcluster import ControlPlane, create_model_deployment, read_model_deployment
from rigs.processes import eventually, free_port


def start_controller(
    plane: ControlPlane,
    identity: str,
    lease: str,
    *,
    kubeconfig: Path | None = None,
    lease_namespace: str = "default",
) -> subprocess.Popen:
    """``baton controller`` against the test cluster (as admin unless ``kubeconfig`` says
    otherwise), logging to ``<identity>.log``."""
    log = (plane.directory / f"{identity}.log").open("ab")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "baton.cli",
            "controller",
            f"--kubeconfig={kubeconfig or plane.kubeconfig}",
            f"--lease-name={lease}",
            f"--lease-namespace={lease_namespace}",
            f"--identity={identity}",
            f"--metrics-port={free_port()}",
            "--metrics-host=127.0.0.1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def controller_log(plane: ControlPlane, identity: str) -> str:
    return Path(plane.directory / f"{identity}.log").read_text()


MODEL = "deepseek-ai/DeepSeek-V4.1-Flash"


def apply(api: client.ApiClient, namespace: str, name: str, spec: dict[str, Any]) -> None:
    create_model_deployment(api, namespace, name, {"model": MODEL, **spec})


def read(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return read_model_deployment(api, namespace, name)


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def wait_ready(api: client.ApiClient, namespace: str, name: str, timeout: float = 60) -> dict:
    def ready() -> bool:
        obj = read(api, namespace, name)
        return (
            condition(obj, "Ready").get("status") == "True"
            and obj["status"].get("observedGeneration") == obj["metadata"]["generation"]
        )

    try:
        eventually(ready, timeout=timeout, interval=0.25)
    except TimeoutError:
        raise AssertionError(f"not Ready: {read(api, namespace, name).get('status')}") from None
    return read(api, namespace, name)


def pods(api: client.ApiClient, namespace: str, role: str | None = None) -> dict[str, Any]:
    selector = f"{ROLE_LABEL}={role}" if role else DEPLOYMENT_LABEL
    listed = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=selector).items
    # A listed object always has a name: the condition only narrows the type.
    return {p.metadata.name: p for p in listed if p.metadata and p.metadata.name}
