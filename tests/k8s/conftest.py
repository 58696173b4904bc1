"""Fixtures for tests against a real Kubernetes API server (see rigs/devcluster.py)."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from baton.core.api import GROUP, PLURAL, VERSION
from baton.core.labels import DEPLOYMENT_LABEL
from rigs.devcluster import (
    ControlPlane,
    add_trays,
    binaries_dir,
    install_crd,
    remove_nodes,
    start_control_plane,
    start_controller,
)
from rigs.processes import eventually, stop_process
from tests.k8s.helpers import compute_domains_served, controller_log, log_size, no_traceback


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = start_control_plane(tmp_path_factory.mktemp("k8s"), binaries_dir())
    yield plane
    plane.stop()


@pytest.fixture(scope="session")
def api(control_plane: ControlPlane) -> client.ApiClient:
    api: client.ApiClient = config.new_client_from_config(config_file=str(control_plane.kubeconfig))
    return api


@pytest.fixture
def namespace(api: client.ApiClient) -> Iterator[str]:
    """A fresh namespace per test, deleted after it."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    try:  # the deployments first: a controller must not place a terminating namespace's cells
        client.CustomObjectsApi(api).delete_collection_namespaced_custom_object(
            GROUP, VERSION, name, PLURAL
        )
    except ApiException as exc:
        if exc.status != 404:  # no CRD installed yet
            raise
    core.delete_namespace(name)


@pytest.fixture
def rack(api: client.ApiClient, namespace: str) -> Iterator[list[dict[str, Any]]]:
    """One NVL72 rack of 18 kwok trays; removed after the test's deployments are gone."""
    install_crd(api)
    nodes = add_trays(api, 1, name_prefix=f"{namespace}-")
    yield nodes
    custom = client.CustomObjectsApi(api)
    core = client.CoreV1Api(api)
    custom.delete_collection_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
    # Owner references would remove the pods too, once the garbage collector has discovered
    # the CRD (up to 30 s after it appears); the test need not wait for that.
    core.delete_collection_namespaced_pod(namespace, label_selector=DEPLOYMENT_LABEL)
    eventually(
        lambda: not core.list_namespaced_pod(namespace, label_selector=DEPLOYMENT_LABEL).items,
        timeout=60,
    )
    remove_nodes(api, nodes)


@pytest.fixture(scope="module")
def controller(
    control_plane: ControlPlane, api: client.ApiClient
) -> Iterator[subprocess.Popen[bytes]]:
    """One ``baton controller`` for a test module; what it logged must show no traceback (the
    log file is the session's: a traceback is told once, by the module whose run wrote it)."""
    install_crd(api)
    since = log_size(control_plane, "controller")
    process = start_controller(control_plane, "controller", "baton-controller-tests")
    yield process
    stop_process(process)
    no_traceback(controller_log(control_plane, "controller", since))


@pytest.fixture(scope="module")
def compute_domain_api(api: client.ApiClient) -> Iterator[None]:
    """NVIDIA's ComputeDomain API served for a whole test module."""
    with compute_domains_served(api):
        yield
