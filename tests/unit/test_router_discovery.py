"""router/discovery.py: a ModelDeployment's status as the gateway's cells; the flag's form."""

from __future__ import annotations

import pytest

from baton.core.follow import DeploymentRef
from router.discovery import cells_from_deployment
from router.targets import DecodeServerSpec, PoolCell


def test_ready_cells_of_a_status_become_pool_cells_and_unready_ones_are_left_out() -> None:
    spec = {"cell": {"decode": {"gpusPerPod": 2}}}
    status = {
        "endpoints": {
            "cells": [
                {
                    "name": "dsv4-cell-0",
                    "prefill": ["http://10.0.0.9:8000"],
                    "decode": ["http://10.0.0.1:8000"],
                    "eplbAgents": ["10.0.0.1:50100"],
                },
                {"name": "dsv4-cell-1", "prefill": ["http://10.0.1.9:8000"], "decode": []},
            ]
        }
    }
    assert cells_from_deployment({"spec": spec, "status": status}) == (
        PoolCell(
            name="dsv4-cell-0",
            prefill=("http://10.0.0.9:8000",),
            decode=(DecodeServerSpec(url="http://10.0.0.1:8000", ranks=(0, 1)),),
        ),
    )
    assert cells_from_deployment({"spec": spec}) == ()
    assert cells_from_deployment({"spec": spec, "status": {}}) == ()


def test_model_deployment_flag_names_namespace_and_name() -> None:
    assert DeploymentRef.parse("serving/dsv4", None) == DeploymentRef("serving", "dsv4")
    with pytest.raises(ValueError, match="expected NAMESPACE/NAME"):
        DeploymentRef.parse("dsv4", None)
