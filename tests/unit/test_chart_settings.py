"""The chart's gateway.settings are baton gateway's tunables: the same names, types and choices.

The chart passes each as the flag of that name (the Deployment) or as the Serve application's
argument (rayService), and leaves an unset one at the gateway's default, so no default is written
twice; its values schema names every tunable, so a typo fails at `helm install`."""

from __future__ import annotations

import json
from typing import Any

from router.policy import PrefillPolicy
from router.settings import GatewaySettings
from tests.helpers import ROOT

SCHEMA = ROOT / "helm" / "baton" / "values.schema.json"


def wanted_schema() -> dict[str, dict[str, Any]]:
    """What the values schema should say of each tunable."""
    wanted: dict[str, dict[str, Any]] = {}
    for name, field in GatewaySettings.model_fields.items():
        default = field.default
        entry: dict[str, Any]
        if isinstance(default, PrefillPolicy):
            entry = {"type": "string", "enum": [policy.value for policy in PrefillPolicy]}
        elif isinstance(default, bool):
            entry = {"type": "boolean"}
        elif isinstance(default, str):
            entry = {"type": "string"}
        elif isinstance(default, int):
            entry = {"type": "integer"}
        else:
            entry = {"type": "number"}
        wanted[name] = entry | {"description": field.description}
    return wanted


def test_the_charts_gateway_settings_are_the_gateways_tunables() -> None:
    schema = json.loads(SCHEMA.read_text())
    settings = schema["properties"]["gateway"]["properties"]["settings"]
    assert settings["additionalProperties"] is False
    assert settings["properties"] == wanted_schema(), (
        "router/settings.py changed: write wanted_schema() into the chart's values schema"
    )
