"""Where the cluster serves NVIDIA's ComputeDomain API (here its CRD, as the DRA driver's chart
installs it; the driver itself needs GPUs), every cell gets one ComputeDomain and its decode pods
claim the domain's IMEX channel; prefill pods claim none."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from baton.core.kube import json_object
from rigs.devcluster import pods
from rigs.processes import eventually
from tests.k8s.helpers import apply

pytestmark = pytest.mark.usefixtures("compute_domain_api", "controller")


def test_each_cell_gets_a_compute_domain_and_its_decode_pods_the_channel(
    api: client.ApiClient, namespace: str, rack: list[dict[str, Any]]
) -> None:
    apply(api, namespace, "dsv4", {"cell": {"prefill": {"instances": 2}}})
    custom = client.CustomObjectsApi(api)

    def domain() -> dict[str, Any]:
        return json_object(
            custom.get_namespaced_custom_object(
                "resource.nvidia.com", "v1beta1", namespace, "computedomains", "dsv4-cell-0-imex"
            )
        )

    created = eventually(domain, timeout=30)
    assert created["spec"]["channel"] == {
        "resourceClaimTemplate": {"name": "dsv4-cell-0-imex-channel"},
        "allocationMode": "Single",
    }
    assert created["metadata"]["ownerReferences"][0]["name"] == "dsv4"
    eventually(lambda: len(pods(api, namespace)) == 8 + 2, timeout=30)
    for pod in pods(api, namespace, "decode").values():
        [claim] = pod.spec.resource_claims
        assert claim.resource_claim_template_name == "dsv4-cell-0-imex-channel"
        assert [c.name for c in pod.spec.containers[0].resources.claims] == [claim.name]
    for pod in pods(api, namespace, "prefill").values():
        assert not pod.spec.resource_claims
