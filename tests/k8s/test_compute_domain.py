"""Where the cluster serves NVIDIA's ComputeDomain API (here its CRD, as the DRA driver's chart
installs it; the driver itself needs GPUs), every cell gets one ComputeDomain and every pod joins
it: decode pods claim the domain's IMEX channel from its template, the prefill pods of one tray
share one ResourceClaim of the channel, which goes when no prefill pod of the cell is left there."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from baton.core.kube import json_object
from rigs.devcluster import patch_model_deployment_spec, pods
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
    uid = created["metadata"]["uid"]
    prefill = pods(api, namespace, "prefill")
    trays = {
        p.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms[
            0
        ]
        .match_expressions[0]
        .values[0]
        for p in prefill.values()
    }
    assert len(trays) == 1  # two DEP2 instances fill one 4-GPU tray
    [tray] = trays
    for pod in prefill.values():
        [claim] = pod.spec.resource_claims
        assert claim.resource_claim_name == f"dsv4-cell-0-prefill-imex-{tray}"
        assert [c.name for c in pod.spec.containers[0].resources.claims] == [claim.name]

    def shared() -> dict[str, Any]:
        return json_object(
            custom.get_namespaced_custom_object(
                "resource.k8s.io",
                "v1",
                namespace,
                "resourceclaims",
                f"dsv4-cell-0-prefill-imex-{tray}",
            )
        )

    channel = eventually(shared, timeout=30)
    [config] = channel["spec"]["devices"]["config"]
    assert config["opaque"]["driver"] == "compute-domain.nvidia.com"
    assert config["opaque"]["parameters"]["domainID"] == uid
    [request] = channel["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "compute-domain-default-channel.nvidia.com"
    assert channel["metadata"]["ownerReferences"][0]["name"] == "dsv4"

    def claims() -> list[str]:
        listed = json_object(
            custom.list_namespaced_custom_object(
                "resource.k8s.io", "v1", namespace, "resourceclaims"
            )
        )
        return [c["metadata"]["name"] for c in listed["items"]]

    # no prefill left in the cell: its tray's claim goes
    patch_model_deployment_spec(api, namespace, "dsv4", {"cell": {"prefill": {"instances": 0}}})
    eventually(lambda: not pods(api, namespace, "prefill") and not claims(), timeout=60)
