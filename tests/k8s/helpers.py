"""Helpers for tests that drive ModelDeployments on the test cluster."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rigs.devcluster import (
    ControlPlane,
    condition,
    create_model_deployment,
    read_model_deployment,
)
from rigs.processes import (
    baton_command,
    eventually,
    free_port,
    stop_process,
    wait_healthy,
)


def controller_log(plane: ControlPlane, identity: str, since: int = 0) -> str:
    """The controller's log (from byte ``since``: what one run of it wrote to the shared
    file)."""
    with Path(plane.directory / f"{identity}.log").open("rb") as log:
        log.seek(since)
        return log.read().decode(errors="replace")


def log_size(plane: ControlPlane, identity: str) -> int:
    path = Path(plane.directory / f"{identity}.log")
    return path.stat().st_size if path.exists() else 0


def no_traceback(log: str) -> None:
    """Fail with the traceback and what led to it, if ``log`` holds one."""
    at = log.find("Traceback")
    assert at < 0, f"the controller logged a traceback:\n{log[max(0, at - 2000) : at + 4000]}"


MODEL = "deepseek-ai/DeepSeek-V4.1-Flash"


def apply(api: client.ApiClient, namespace: str, name: str, spec: dict[str, Any]) -> None:
    create_model_deployment(api, namespace, name, {"model": MODEL, **spec})


def read(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return read_model_deployment(api, namespace, name)


def wait_ready(
    api: client.ApiClient, namespace: str, name: str, timeout: float = 60
) -> dict[str, Any]:
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
                return bool(exc.status == 404)
            return False

        eventually(gone, timeout=60)  # later controllers must find the API absent


def start_gateway_following(
    plane: ControlPlane, namespace: str, name: str, log: Path, *more: str
) -> tuple[subprocess.Popen[bytes], str]:
    """``baton gateway --model-deployment NAMESPACE/NAME`` (one flag for ``name`` and each of
    ``more``) on a free port, every request a P/D handoff and health checked every 0.5 s; the
    process and its URL, once it answers."""
    port = free_port()
    followed = [f"--model-deployment={namespace}/{each}" for each in (name, *more)]
    gateway = subprocess.Popen(
        baton_command(
            "gateway",
            *followed,
            f"--kubeconfig={plane.kubeconfig}",
            f"--port={port}",
            "--health-interval=0.5",
            "--pd-threshold-tokens=0",
        ),
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, gateway, log)
    except BaseException:
        stop_process(gateway)
        raise
    return gateway, url
