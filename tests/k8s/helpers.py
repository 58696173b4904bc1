"""Helpers for tests that drive ModelDeployments on the test cluster."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

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
    metrics_port: int | None = None,
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
            f"--metrics-port={metrics_port or free_port()}",
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


COMPUTE_DOMAIN_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "computedomains.resource.nvidia.com"},
    "spec": {
        "group": "resource.nvidia.com",
        "scope": "Namespaced",
        "names": {
            "kind": "ComputeDomain",
            "plural": "computedomains",
            "singular": "computedomain",
            "listKind": "ComputeDomainList",
        },
        "versions": [
            {
                "name": "v1beta1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


@contextmanager
def compute_domains_served(api: client.ApiClient) -> Iterator[None]:
    """NVIDIA's ComputeDomain API (its CRD, as the DRA driver's chart installs it; the driver
    itself needs GPUs) served inside the block, and gone after it."""
    extensions = client.ApiextensionsV1Api(api)
    # The model the client would validate the dict into itself: the request is the same.
    extensions.create_custom_resource_definition(
        client.V1CustomResourceDefinition.model_validate(COMPUTE_DOMAIN_CRD)
    )
    custom = client.CustomObjectsApi(api)
    eventually(
        lambda: custom.list_cluster_custom_object(
            "resource.nvidia.com", "v1beta1", "computedomains"
        ),
        timeout=30,
    )
    try:
        yield
    finally:
        extensions.delete_custom_resource_definition(COMPUTE_DOMAIN_CRD["metadata"]["name"])

        def gone() -> bool:
            try:
                custom.list_cluster_custom_object(
                    "resource.nvidia.com", "v1beta1", "computedomains"
                )
            except ApiException as exc:
                return exc.status == 404
            return False

        eventually(gone, timeout=60)  # later controllers must find the API absent
