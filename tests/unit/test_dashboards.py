"""The Grafana dashboards (deploy/grafana/dashboards.py): the committed JSON is what the code
generates, Grafana's SDK reads every dashboard back into its models without losing a field,
and every panel reads the one Prometheus datasource variable and no variable the dashboard
lacks. Grafana itself cannot run here; tests/k8s/test_observability.py runs every query
against a real Prometheus."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from grafana_foundation_sdk.cog import plugins
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models import prometheus

from deploy.grafana.dashboards import DASHBOARDS, DATASOURCE, OUT, generated_files

# Grafana's own variables a query may use without the dashboard defining them.
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range"}
VARIABLE = re.compile(r"\$\{?([A-Za-z_]\w*)")


def committed() -> dict[str, dict[str, Any]]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(OUT.glob("*.json"))}


def test_the_committed_dashboards_and_the_charts_copies_are_what_make_dashboards_writes() -> None:
    for path, text in generated_files().items():
        assert path.exists(), f"{path} missing: run make dashboards"
        assert path.read_text() == text, f"{path} differs from the code: run make dashboards"
    for directory in {path.parent for path in generated_files()}:
        written = {path for path in directory.iterdir()}
        assert written <= set(generated_files()), f"stale files in {directory}"


def _contained(part: object, whole: object, where: str = "") -> None:
    """Every key and value of ``part`` is in ``whole`` (which may add defaults)."""
    if isinstance(part, dict):
        assert isinstance(whole, dict), where
        for key, value in part.items():
            assert key in whole, f"{where}.{key} dropped by the SDK's models"
            _contained(value, whole[key], f"{where}.{key}")
    elif isinstance(part, list):
        assert isinstance(whole, list) and len(whole) == len(part), where
        for index, (a, b) in enumerate(zip(part, whole, strict=True)):
            _contained(a, b, f"{where}[{index}]")
    else:
        assert part == whole, f"{where}: {part!r} became {whole!r}"


@pytest.mark.parametrize("uid", [spec.uid for spec in DASHBOARDS])
def test_grafanas_sdk_reads_each_dashboard_into_its_models_losing_nothing(uid: str) -> None:
    plugins.register_default_plugins()  # panel options and queries decode into their types
    data = committed()[uid]
    dashboard = model.Dashboard.from_json(data)
    assert dashboard.uid == uid and dashboard.panels
    for panel in dashboard.panels:
        assert isinstance(panel, model.Panel)
        assert panel.targets and all(isinstance(t, prometheus.Dataquery) for t in panel.targets)
    _contained(data, json.loads(json.dumps(dashboard, cls=JSONEncoder)), uid)


@pytest.mark.parametrize("uid", [spec.uid for spec in DASHBOARDS])
def test_every_panel_reads_the_datasource_variable_and_only_defined_variables(uid: str) -> None:
    data = committed()[uid]
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert variables[DATASOURCE]["type"] == "datasource"
    assert variables[DATASOURCE]["query"] == "prometheus"
    reference = {"type": "prometheus", "uid": "${" + DATASOURCE + "}"}
    used: set[str] = set()
    for panel in data["panels"]:
        title = panel["title"]
        assert panel["datasource"] == reference, title
        assert panel["description"], f"{title}: says no question it answers"
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), title
        for target in panel["targets"]:
            assert target["datasource"] == reference, title
            assert target["expr"] and target["legendFormat"], title
            names = set(VARIABLE.findall(target["expr"]))
            assert names <= set(variables) | GRAFANA_VARIABLES, f"{title}: {names}"
            used |= names
            # rates over Grafana's window, never a lifetime average
            assert "[$__rate_interval]" in target["expr"] or "rate(" not in target["expr"]
    assert set(variables) - {DATASOURCE} <= used, "a variable no panel uses"


def test_quantiles_come_from_buckets_summed_by_le() -> None:
    for spec in DASHBOARDS:
        for panel in spec.panels:
            for query in panel.queries:
                for match in re.finditer(
                    r"histogram_quantile\([\d.]+, sum by \(([^)]*)\)", query.expr
                ):
                    assert "le" in [label.strip() for label in match.group(1).split(",")]
                if "histogram_quantile" in query.expr:
                    assert "_bucket[$__rate_interval]" in query.expr, panel.title


def test_the_dashboards_json_files_are_the_dashboards_listed() -> None:
    assert set(committed()) == {spec.uid for spec in DASHBOARDS}
    assert all(Path(OUT, f"{spec.uid}.json").exists() for spec in DASHBOARDS)


# Every selector of a series: a metric name, then its matchers if it has any.
SELECTOR = re.compile(r"(vllm:\w+|baton_\w+)(?:\{([^}]*)\})?")


@pytest.mark.parametrize("uid", [spec.uid for spec in DASHBOARDS])
def test_every_series_of_a_deployment_is_narrowed_to_the_deployments_the_variables_choose(
    uid: str,
) -> None:
    data = committed()[uid]
    selectors = [
        (name, matchers or "")
        for panel in data["panels"]
        for target in panel["targets"]
        for name, matchers in SELECTOR.findall(target["expr"])
    ]
    assert selectors
    for name, matchers in selectors:
        if name.startswith(("vllm:", "baton_gateway_", "baton_eplb_")):
            assert 'modeldeployment=~"$namespace/$deployment"' in matchers, name
        if name.startswith("vllm:"):
            assert 'model_name=~"$model"' in matchers, name
        if name.startswith("baton_modeldeployment_"):
            assert 'namespace=~"$namespace", name=~"$deployment"' in matchers, name
    variables = {v["name"]: v for v in data["templating"]["list"]}
    for name in ("namespace", "deployment"):
        assert variables[name]["type"] == "query"
        assert variables[name]["multi"] and variables[name]["includeAll"]
        assert variables[name]["allValue"] == ".*"
