"""Admission refuses what the controller would: the CRD's CEL rules (``x-kubernetes-validations``)
on the real API server, for every rule the schema alone cannot express, with the message the
controller gives for the same spec (its InvalidSpec condition and event)."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from baton.core.api import ModelDeploymentSpec
from rigs.devcluster import create_model_deployment, install_crd
from tests.k8s.helpers import MODEL

REFUSED: dict[str, dict[str, Any]] = {
    "decode ranks not whole trays": {"cell": {"decode": {"dep": 30}}},
    "decode pods not the trays' size": {"cell": {"decode": {"dep": 32, "gpusPerPod": 8}}},
    "baton's command on vLLM's image": {"engine": {"command": ["baton", "sim"]}},
    "vllm's command on Baton's image": {"engine": {"image": "ghcr.io/baton-dev/baton:0.2.0"}},
    "EPLB window longer than its interval": {"eplb": {"windowSize": 5000, "stepInterval": 3000}},
    "EPLB agents without a token": {"eplb": {"mode": "agent"}},
    "EPLB over NCCL": {"eplb": {"communicator": "pynccl"}},
    "EPLB agents beside vLLM": {
        "eplb": {"mode": "agent", "tokenSecret": {"name": "eplb", "key": "token"}}
    },
    "GPUs asked in engine.resources": {
        "engine": {"resources": {"limits": {"nvidia.com/gpu": "4"}}}
    },
    "two model volumes": {
        "modelSource": {"pvc": {"claimName": "w"}, "hostPath": {"path": "/mnt/models"}}
    },
    "a model path without a volume": {"modelSource": {"path": "dsv4"}},
    "a model path out of its volume": {
        "modelSource": {"pvc": {"claimName": "w"}, "path": "a/../.."}
    },
    "a mount out of its volume": {
        "engine": {
            "volumes": [{"name": "c", "emptyDir": {}}],
            "volumeMounts": [{"name": "c", "mountPath": "/c", "subPath": "../x"}],
        }
    },
    "an env var with value and valueFrom": {
        "engine": {
            "env": [
                {
                    "name": "A",
                    "value": "1",
                    "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}},
                }
            ]
        }
    },
    "a compile cache in two places": {
        "engine": {"compileCache": {"hostPath": "/c", "pvc": {"claimName": "c"}}}
    },
    "a compile cache in none": {"engine": {"compileCache": {}}},
    "an Exists toleration with a value": {
        "engine": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}
    },
}

# Wrong types and shapes: the schema itself refuses them, in its own words.
MALFORMED: dict[str, dict[str, Any]] = {
    "a quantity that is not one": {"engine": {"resources": {"requests": {"cpu": "lots"}}}},
    "a toleration operator Kubernetes lacks": {
        "engine": {"tolerations": [{"key": "k", "operator": "Maybe"}]}
    },
    "a claim name that is a number": {"modelSource": {"pvc": {"claimName": 5}}},
    "a relative host path": {"modelSource": {"hostPath": {"path": "models"}}},
    "a node selector of lists": {"engine": {"nodeSelector": {"pool": ["a", "b"]}}},
    "a volume without a name": {"engine": {"volumes": [{"emptyDir": {}}]}},
}

ACCEPTED: dict[str, dict[str, Any]] = {
    "the study's shape": {},
    "8-GPU trays": {
        "cell": {"decode": {"dep": 32, "gpusPerPod": 8}},
        "topology": {"gpusPerTray": 8},
    },
    "the simulator": {
        "engine": {"command": ["baton", "sim"], "image": "ghcr.io/baton-dev/baton:0.1.0"}
    },
    "EPLB off, agent mode named": {"eplb": {"enabled": False, "mode": "agent"}},
    "a command by path": {"engine": {"command": ["/usr/local/bin/vllm", "serve"]}},
    "a real rack's pods": {
        "modelSource": {
            "pvc": {"claimName": "dsv4-weights"},
            "path": "deepseek-ai/DeepSeek-V4.1-Flash",
            "tokenSecret": {"name": "hf", "key": "token"},
        },
        "engine": {
            "resources": {
                "requests": {"cpu": "32", "memory": "512Gi", "hugepages-2Mi": "8Gi"},
                "limits": {"hugepages-2Mi": "8Gi", "rdma/ib": "1"},
            },
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-GB300"},
            "tolerations": [{"key": "example.com/reserved", "operator": "Exists"}],
            "priorityClassName": "inference-critical",
            "env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
            "volumes": [{"name": "hf-cache", "hostPath": {"path": "/var/cache/hf"}}],
            "volumeMounts": [{"name": "hf-cache", "mountPath": "/root/.cache/huggingface"}],
        },
    },
    "EPLB agents beside the simulator": {
        "engine": {"command": ["baton", "sim"], "image": "ghcr.io/baton-dev/baton:0.1.0"},
        "eplb": {"mode": "agent", "tokenSecret": {"name": "eplb", "key": "token"}},
    },
}


def _controller_says(spec: dict[str, Any]) -> str:
    """The message the controller's InvalidSpec gives for ``spec`` (its pydantic validator)."""
    with pytest.raises(ValidationError) as refused:
        ModelDeploymentSpec.model_validate({"model": MODEL, **spec})
    [error] = refused.value.errors()
    return str(error["msg"]).removeprefix("Value error, ")


@pytest.mark.parametrize("case", REFUSED)
def test_the_api_server_refuses_what_the_controller_would_with_its_message(
    api: client.ApiClient, namespace: str, case: str
) -> None:
    install_crd(api)
    spec = {"model": MODEL, **REFUSED[case]}
    with pytest.raises(ApiException) as refused:
        create_model_deployment(api, namespace, "refused", spec)
    assert refused.value.status == 422
    assert _controller_says(REFUSED[case]) in str(refused.value.body)


@pytest.mark.parametrize("case", ACCEPTED)
def test_specs_the_controller_takes_are_admitted(
    api: client.ApiClient, namespace: str, case: str
) -> None:
    install_crd(api)
    ModelDeploymentSpec.model_validate({"model": MODEL, **ACCEPTED[case]})
    created = create_model_deployment(api, namespace, "taken", {"model": MODEL, **ACCEPTED[case]})
    assert created["metadata"]["name"] == "taken"


@pytest.mark.parametrize("case", MALFORMED)
def test_the_schema_refuses_wrong_types_as_the_controller_does(
    api: client.ApiClient, namespace: str, case: str
) -> None:
    install_crd(api)
    with pytest.raises(ValidationError):
        ModelDeploymentSpec.model_validate({"model": MODEL, **MALFORMED[case]})
    with pytest.raises(ApiException) as refused:
        create_model_deployment(api, namespace, "malformed", {"model": MODEL, **MALFORMED[case]})
    assert refused.value.status == 422
