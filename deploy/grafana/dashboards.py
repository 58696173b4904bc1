"""Baton's Grafana dashboards, as code with Grafana's own SDK (``grafana-foundation-sdk``).

``python -m deploy.grafana.dashboards`` (``make dashboards``) writes each dashboard's JSON into
``deploy/grafana/dashboards/`` and the chart's ``files/dashboards/``, and copies the Prometheus
rules (``deploy/prometheus/baton-rules.yaml``) into the chart's ``files/prometheus/``; the JSON
is never edited by hand (``tests/unit/test_dashboards.py`` fails on any drift).

Every panel queries the ``datasource`` variable's Prometheus. Quantiles come from histogram
buckets summed over every series (``histogram_quantile(q, sum by (le) (rate(...)))``), and
every rate is over Grafana's ``$__rate_interval``: nothing is a lifetime average. A GPU is a DP
rank (one engine rank per GPU), counted from the engines' ``vllm:num_requests_running``.

Each dashboard shows the ModelDeployments its ``namespace``, ``deployment`` and ``model``
variables choose (all, by default): every selector of an engine's, a gateway's or an EPLB
service's series is narrowed by its ``modeldeployment`` label (``NAMESPACE/NAME``, which the
chart's monitors and ``baton up`` set) in one place, :func:`scoped`; the controller's series of
a deployment by their own ``namespace`` and ``name``. The controller's own work is not narrowed.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, statetimeline, timeseries
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model

from baton.core.labels import MODELDEPLOYMENT_SERIES_LABEL

__all__ = [
    "DASHBOARDS",
    "DATASOURCE",
    "GPU_HOUR_PRICE",
    "Query",
    "dashboard_json",
    "generated_files",
    "main",
    "scoped",
]

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "deploy" / "grafana" / "dashboards"
CHART_FILES = ROOT / "helm" / "baton" / "files"
RULES = ROOT / "deploy" / "prometheus" / "baton-rules.yaml"

# The one datasource every panel reads, chosen per Grafana by this variable.
DATASOURCE = "datasource"
PROMETHEUS = model.DataSourceRef(type_val="prometheus", uid="${" + DATASOURCE + "}")
# What a GPU costs per hour (USD), for $ per million tokens; the default is a placeholder the
# user overrides with their own price.
GPU_HOUR_PRICE = "gpu_hour_price"
GPU_HOUR_PRICE_DEFAULT = "6"

RATE = "[$__rate_interval]"
GPUS = "count(vllm:num_requests_running)"

# The deployments shown: variables read off the engines' series, every one "All" by default.
NAMESPACE, DEPLOYMENT, MODEL = "namespace", "deployment", "model"
_DEPLOYMENT_SELECTED = f'{MODELDEPLOYMENT_SERIES_LABEL}=~"${NAMESPACE}/${DEPLOYMENT}"'
_SELECTED = {
    "engine": f'{_DEPLOYMENT_SELECTED}, model_name=~"${MODEL}"',
    "served": _DEPLOYMENT_SELECTED,  # the gateway's and the EPLB service's
    "controller": f'namespace=~"${NAMESPACE}", name=~"${DEPLOYMENT}"',
}
_SERIES = re.compile(
    r"\b(?P<name>vllm:\w+|baton_(?P<kind>gateway|eplb|modeldeployment)_\w+)(?:\{(?P<matchers>[^}]*)\})?"
)


def scoped(expr: str) -> str:
    """``expr`` with every selector of a deployment's series narrowed to the deployments the
    dashboard's variables choose."""

    def narrow(series: re.Match[str]) -> str:
        kind = series["kind"]
        selected = _SELECTED[
            "engine" if kind is None else "controller" if kind == "modeldeployment" else "served"
        ]
        matchers = ", ".join(m for m in (series["matchers"], selected) if m)
        return f"{series['name']}{{{matchers}}}"

    return _SERIES.sub(narrow, expr)


@dataclass(frozen=True, slots=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True, slots=True)
class PanelSpec:
    """One panel: the question it answers (its description) and its queries."""

    title: str
    question: str
    queries: tuple[Query, ...]
    unit: str
    kind: str = "timeseries"  # or "stat", "state-timeline"
    stacked: bool = False
    bars: bool = False


def quantiles(metric: str, by: str = "", qs: Sequence[float] = (0.5, 0.9, 0.99)) -> list[Query]:
    """``histogram_quantile`` of ``metric``'s buckets summed over every series (per ``by``)."""
    group = f"le, {by}" if by else "le"
    suffix = f" {{{{{by}}}}}" if by else ""
    return [
        Query(
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{RATE})))",
            f"p{round(q * 100)}{suffix}",
        )
        for q in qs
    ]


def rate_by(metric: str, by: str, selector: str = "") -> Query:
    labels = ", ".join(f"{{{{{label.strip()}}}}}" for label in by.split(","))
    return Query(f"sum by ({by}) (rate({metric}{selector}{RATE}))", labels)


def increase_by(metric: str, by: str, selector: str = "") -> Query:
    labels = " ".join(f"{{{{{label.strip()}}}}}" for label in by.split(","))
    return Query(f"sum by ({by}) (increase({metric}{selector}{RATE}))", labels)


def _tokens_per_gpu(selector: str, metric: str = "baton_gateway_prompt_tokens_total") -> str:
    return f"sum(rate({metric}{selector}{RATE})) / scalar({GPUS})"


def _dollars_per_million(tokens: str) -> str:
    return f"${GPU_HOUR_PRICE} / 3600 * {GPUS} * 1e6 / ({tokens})"


_ALL_TOKENS = (
    f"sum(rate(baton_gateway_prompt_tokens_total{RATE}))"
    f" + sum(rate(baton_gateway_output_tokens_total{RATE}))"
)
_OUTPUT_TOKENS = f"sum(rate(baton_gateway_output_tokens_total{RATE}))"
_ITL_BUCKETS = f"sum by (le) (rate(baton_gateway_inter_token_latency_seconds_bucket{RATE}))"

OVERVIEW = (
    PanelSpec(
        "Throughput per GPU",
        "How many tokens each GPU serves per second, split into prompt tokens prefill found "
        "cached, prompt tokens it computed, and generated tokens.",
        (
            Query(_tokens_per_gpu('{kind="cached"}'), "cached input"),
            Query(_tokens_per_gpu('{kind="uncached"}'), "uncached input"),
            Query(_tokens_per_gpu("", "baton_gateway_output_tokens_total"), "output"),
        ),
        unit="suffix: tok/s/GPU",
        stacked=True,
    ),
    PanelSpec(
        "Cost per million tokens",
        "What a million tokens cost at the GPU-hour price of the gpu_hour_price variable, for "
        "every token (input and output) and for output tokens alone.",
        (
            Query(_dollars_per_million(_ALL_TOKENS), "all tokens"),
            Query(_dollars_per_million(_OUTPUT_TOKENS), "output tokens"),
        ),
        unit="currencyUSD",
    ),
    PanelSpec(
        "Time to first token",
        "How long users wait for their first token (gateway arrival to first generated token).",
        tuple(quantiles("baton_gateway_time_to_first_token_seconds")),
        unit="s",
    ),
    PanelSpec(
        "Inter-token latency",
        "How long a user waits between tokens after the first (each request's mean).",
        tuple(quantiles("baton_gateway_inter_token_latency_seconds")),
        unit="s",
    ),
    PanelSpec(
        "Per-user tokens/s",
        "How fast users see tokens stream: the median user, and the P90 user (faster than 90% "
        "of users: the inverse of the 10th percentile inter-token latency).",
        (
            Query(f"1 / histogram_quantile(0.5, {_ITL_BUCKETS})", "p50"),
            Query(f"1 / histogram_quantile(0.1, {_ITL_BUCKETS})", "p90"),
        ),
        unit="suffix: tok/s",
    ),
    PanelSpec(
        "Request outcomes",
        "How requests end: ok, error (the gateway's own 5xx) or engine_error (the engine's "
        "status relayed), per route.",
        (rate_by("baton_gateway_requests_total", "outcome, route"),),
        unit="reqps",
        stacked=True,
    ),
)

PD_HANDOFF = (
    PanelSpec(
        "Phase times (p50, p90)",
        "Where a request's time goes: prefill (the call), handoff (prefill done to decode's "
        "first byte, mostly the KV pull) and decode (first to last byte).",
        tuple(quantiles("baton_gateway_phase_seconds", "phase", (0.5, 0.9))),
        unit="s",
    ),
    PanelSpec(
        "Routing paths",
        "How many requests go prefill then decode (pd) and how many decode alone (short prompts).",
        (rate_by("baton_gateway_routing_decisions_total", "path"),),
        unit="reqps",
        stacked=True,
    ),
    PanelSpec(
        "Fallbacks to decode alone, by reason",
        "How often a handoff is given up and decode prefills by itself: prefill failed or timed "
        "out, answered without KV parameters, or the KV could not be pulled (decode_retry).",
        (rate_by("baton_gateway_fallbacks_total", "reason"),),
        unit="reqps",
        bars=True,
    ),
    PanelSpec(
        "Retries, by phase and reason",
        "How often a decode rank failed before the first token and another took the request.",
        (rate_by("baton_gateway_retries_total", "phase, reason"),),
        unit="reqps",
        bars=True,
    ),
    PanelSpec(
        "Expired and failed KV transfers",
        "How often prefilled KV expired on a prefill engine before decode pulled it, and how "
        "often a NIXL transfer failed (engine counters).",
        (
            Query(f"sum(rate(vllm:nixl_num_kv_expired_reqs_total{RATE}))", "expired"),
            Query(f"sum(rate(vllm:nixl_num_failed_transfers_total{RATE}))", "failed transfers"),
        ),
        unit="reqps",
    ),
    PanelSpec(
        "KV transfer time",
        "How long decode engines take to pull a request's KV over NIXL.",
        tuple(quantiles("vllm:nixl_xfer_time_seconds", qs=(0.5, 0.9))),
        unit="s",
    ),
)

_DECODE = '{role="decode"}'
CELLS_AND_RANKS = (
    PanelSpec(
        "In flight per decode DP rank (gateways)",
        "How many requests the gateways hold on each decode DP rank, summed over replicas.",
        (
            Query(
                f"sum by (target) (baton_gateway_in_flight_requests{_DECODE})",
                "{{target}}",
            ),
        ),
        unit="short",
    ),
    PanelSpec(
        "Running per DP rank (engines)",
        "How many requests each decode DP rank runs in its batch, by the engine's own count.",
        (
            Query(
                f"sum by (cell, instance, engine) (vllm:num_requests_running{_DECODE})",
                "{{cell}} {{instance}} rank {{engine}}",
            ),
        ),
        unit="short",
    ),
    PanelSpec(
        "DP imbalance",
        "How much busier the busiest decode DP rank of each cell is than the cell's mean "
        "(1 is even; the busiest rank sets the pace of every lockstep step).",
        (
            Query(
                f"max by (cell) (vllm:num_requests_running{_DECODE})"
                f" / avg by (cell) (vllm:num_requests_running{_DECODE})",
                "{{cell}}",
            ),
        ),
        unit="short",
    ),
    PanelSpec(
        "Peers' load per decode rank",
        "What each gateway replica believes the other replicas hold on each decode rank, from "
        "the engines' counts at the last load sync (the largest estimate).",
        (Query("max by (target) (baton_gateway_peer_in_flight_requests)", "{{target}}"),),
        unit="short",
    ),
    PanelSpec(
        "Waiting per DP rank",
        "Which ranks queue requests they cannot batch yet (KV capacity or deferred loads).",
        (
            Query(
                "sum by (cell, role, instance, engine) (vllm:num_requests_waiting)",
                "{{cell}} {{role}} {{instance}} rank {{engine}}",
            ),
        ),
        unit="short",
    ),
    PanelSpec(
        "KV cache usage per DP rank",
        "How full each rank's KV cache is.",
        (
            Query(
                "max by (cell, role, instance, engine) (vllm:kv_cache_usage_perc)",
                "{{cell}} {{role}} {{instance}} rank {{engine}}",
            ),
        ),
        unit="percentunit",
    ),
    PanelSpec(
        "Healthy targets per cell",
        "How many prefill instances and decode ranks each cell has that a gateway routes to.",
        (Query("max by (cell, role) (baton_gateway_healthy_targets)", "{{cell}} {{role}}"),),
        unit="short",
    ),
    PanelSpec(
        "Panic per role",
        "1 while fewer than half of a role's targets pass their health checks and a gateway "
        "routes to every one not known dead (a busy host, or most engines down).",
        (Query("max by (role) (baton_gateway_panic)", "{{role}}"),),
        unit="short",
    ),
    PanelSpec(
        "Ejections and admission waits",
        "Engine servers ejected by their health checks, by reason, and requests that waited "
        "for a decode rank below --max-requests-per-rank (waited) or got 429 (saturated).",
        (
            rate_by("baton_gateway_ejections_total", "reason"),
            rate_by("baton_gateway_admission_waits_total", "result"),
        ),
        unit="reqps",
        bars=True,
    ),
)

EPLB = (
    PanelSpec(
        "Expert balance per group and model",
        "How even the experts' load is over the ranks (window balance: mean rank load over max "
        "rank load, 1 is even): the placement in force, the one predicted for the next window, "
        "and the one achieved after the last switch.",
        (
            Query(
                "max by (group, model, stage) (baton_eplb_balance)",
                "{{group}} {{model}} {{stage}}",
            ),
        ),
        unit="percentunit",
    ),
    PanelSpec(
        "Rebalances by outcome",
        "How often each group rebalanced. Agent mode: the service's decisions by outcome "
        "(committed, or why not: gain too small, incomplete window, a failed prepare or "
        "commit); plugin mode: the engines' own rebalances, by who placed the experts.",
        (
            Query(
                f"sum by (group, outcome) (increase(baton_eplb_rebalances_total{RATE}))"
                " or sum by (group, outcome) (label_replace(increase("
                f'baton_eplb_engine_windows_total{RATE}), "outcome", "in-engine: $1", '
                '"policy", "(.*)"))',
                "{{group}} {{outcome}}",
            ),
        ),
        unit="short",
        bars=True,
    ),
    PanelSpec(
        "Experts moved",
        "How many experts the switches copied onto another rank (each copy costs NVLink "
        "bandwidth while decode runs).",
        (increase_by("baton_eplb_experts_moved_total", "group, model"),),
        unit="short",
        bars=True,
    ),
    PanelSpec(
        "Bytes moved",
        "How many bytes of expert weights the switches copied over NVLink.",
        (rate_by("baton_eplb_bytes_moved_total", "group, model"),),
        unit="Bps",
    ),
    PanelSpec(
        "Engine rebalances by policy (plugin mode)",
        "Who placed the experts at each in-engine rebalance: Baton's plugin, or vLLM's own "
        "policy (vllm_default: as the spec's eplb.policy says, or after a fallback).",
        (increase_by("baton_eplb_engine_windows_total", "group, policy"),),
        unit="short",
        bars=True,
    ),
)

CONTROLLER = (
    PanelSpec(
        "Placements",
        "When cells were placed in an NVLink domain.",
        (Query(f"sum(increase(baton_controller_placements_total{RATE}))", "placements"),),
        unit="short",
        bars=True,
    ),
    PanelSpec(
        "Decode group restarts",
        "When a decode group restarted as a whole after a pod failed or lost its tray.",
        (Query(f"sum(increase(baton_controller_group_restarts_total{RATE}))", "group restarts"),),
        unit="short",
        bars=True,
    ),
    PanelSpec(
        "Tray quarantines",
        "When a tray was quarantined after repeated pod failures.",
        (
            Query(
                f"sum(increase(baton_controller_tray_quarantines_total{RATE}))", "tray quarantines"
            ),
        ),
        unit="short",
        bars=True,
    ),
    PanelSpec(
        "Degraded trays",
        "Which trays carry baton.dev/degraded (a GPU holding back its decode group, marked by "
        "the straggler watch or by hand); the series' reason label says why.",
        (Query("max by (tray) (baton_tray_degraded)", "{{tray}}"),),
        unit="bool",
        kind="state-timeline",
    ),
    PanelSpec(
        "Straggler marks and group moves",
        "When the straggler watch marked a tray degraded, and when a decode group restarted off "
        "one (drained first, once the slowdown had cost more than a restart).",
        (
            Query(f"sum(increase(baton_controller_trays_degraded_total{RATE}))", "trays marked"),
            Query(f"sum(increase(baton_controller_group_moves_total{RATE}))", "groups moved"),
        ),
        unit="short",
        bars=True,
    ),
    PanelSpec(
        "Slowest GPU's SM clock per tray",
        "dcgm-exporter's SM clock of each tray's slowest GPU against the median of all GPUs: "
        "one GPU well below the others holds back its whole decode group.",
        (
            Query("min by (Hostname) (DCGM_FI_DEV_SM_CLOCK)", "{{Hostname}}"),
            Query("quantile(0.5, DCGM_FI_DEV_SM_CLOCK)", "median of all GPUs"),
        ),
        unit="suffix: MHz",
    ),
    PanelSpec(
        "Reconciles by outcome",
        "How often the controller reconciles, and how often a reconcile fails (retried with "
        "backoff).",
        (rate_by("baton_controller_reconciles_total", "outcome"),),
        unit="ops",
        stacked=True,
    ),
    PanelSpec(
        "Reconcile latency",
        "How long one reconcile of a namespace takes.",
        tuple(quantiles("baton_controller_reconcile_duration_seconds")),
        unit="s",
    ),
    PanelSpec(
        "ModelDeployment conditions",
        "Which conditions each ModelDeployment has True over time (Placed, Ready, Progressing, "
        "Degraded).",
        (
            Query(
                'max by (namespace, name, type) (baton_modeldeployment_condition{status="true"})',
                "{{namespace}}/{{name}} {{type}}",
            ),
        ),
        unit="bool",
        kind="state-timeline",
    ),
    PanelSpec(
        "Leader and work queue",
        "Whether one replica leads, and how many namespaces wait for a reconcile.",
        (
            Query("sum(baton_controller_leader)", "leaders"),
            Query("max(baton_controller_queue_depth)", "queued namespaces"),
        ),
        unit="short",
        kind="stat",
    ),
    PanelSpec(
        "API writes by verb and resource",
        "What the controller writes to the Kubernetes API.",
        (rate_by("baton_controller_api_requests_total", "verb, resource"),),
        unit="ops",
        stacked=True,
    ),
)


@dataclass(frozen=True, slots=True)
class DashboardSpec:
    uid: str
    title: str
    description: str
    panels: tuple[PanelSpec, ...]
    priced: bool = False  # has the gpu_hour_price variable


DASHBOARDS = (
    DashboardSpec(
        "baton-overview",
        "Baton / Overview",
        "Throughput, cost per token, latency and request outcomes of the whole deployment.",
        OVERVIEW,
        priced=True,
    ),
    DashboardSpec(
        "baton-pd-handoff",
        "Baton / P/D handoff",
        "Prefill, handoff and decode times; fallbacks, retries and KV transfers.",
        PD_HANDOFF,
    ),
    DashboardSpec(
        "baton-cells-ranks",
        "Baton / Cells and DP ranks",
        "Load per decode DP rank, imbalance within a cell, and the peers' load estimates.",
        CELLS_AND_RANKS,
    ),
    DashboardSpec(
        "baton-eplb",
        "Baton / EPLB",
        "Expert balance per decode group, rebalances, experts and bytes moved, fallbacks.",
        EPLB,
    ),
    DashboardSpec(
        "baton-controller",
        "Baton / Controller",
        "Placements, decode group restarts, quarantines, reconciles and conditions.",
        CONTROLLER,
    ),
)


def _targets(panel: PanelSpec) -> list[prometheus.Dataquery]:
    return [
        prometheus.Dataquery()
        .expr(scoped(query.expr))
        .legend_format(query.legend)
        .ref_id(chr(ord("A") + index))
        .datasource(PROMETHEUS)
        for index, query in enumerate(panel.queries)
    ]


def _panel(panel: PanelSpec) -> Builder[model.Panel]:
    built: timeseries.Panel | stat.Panel | statetimeline.Panel
    if panel.kind == "stat":
        built = stat.Panel()
    elif panel.kind == "state-timeline":
        built = statetimeline.Panel()
    else:
        built = timeseries.Panel().fill_opacity(10)
        if panel.stacked:
            stacking = common_builders.StackingConfig().mode(common.StackingMode.NORMAL)
            built = built.stacking(stacking)
        if panel.bars:
            built = built.draw_style(common.GraphDrawStyle.BARS).fill_opacity(80)
    built = built.title(panel.title).description(panel.question).unit(panel.unit)
    built = built.datasource(PROMETHEUS).height(8).span(12)
    for target in _targets(panel):
        built = built.with_target(target)
    return built


def _variables(spec: DashboardSpec) -> list[Builder[model.VariableModel]]:
    engines = "vllm:num_requests_running"
    variables: list[Builder[model.VariableModel]] = [
        db.DatasourceVariable(DATASOURCE).label("Prometheus").type("prometheus"),
        _chosen(NAMESPACE, "Namespace", f"label_values({engines}, {MODELDEPLOYMENT_SERIES_LABEL})")
        .regex(r"/^([^/]+)\//")
        .description("The namespaces of the ModelDeployments shown"),
        _chosen(
            DEPLOYMENT,
            "ModelDeployment",
            f'label_values({engines}{{{MODELDEPLOYMENT_SERIES_LABEL}=~"${NAMESPACE}/.*"}}, '
            f"{MODELDEPLOYMENT_SERIES_LABEL})",
        )
        .regex(r"/^[^/]+\/(.+)$/")
        .description("The ModelDeployments shown"),
    ]
    if any("vllm:" in query.expr for panel in spec.panels for query in panel.queries):
        variables.append(
            _chosen(
                MODEL, "Model", f"label_values({engines}{{{_DEPLOYMENT_SELECTED}}}, model_name)"
            ).description("The served models shown (the engines' model_name)")
        )
    if spec.priced:
        variables.append(
            db.TextBoxVariable(GPU_HOUR_PRICE)
            .label("GPU-hour price (USD)")
            .description("What one GPU costs per hour, for the cost per million tokens")
            .default_value(GPU_HOUR_PRICE_DEFAULT)
        )
    return variables


def _chosen(name: str, label: str, query: str) -> db.QueryVariable:
    """A variable of values read off the series, several or all of them chosen at once."""
    return (
        db.QueryVariable(name)
        .label(label)
        .datasource(PROMETHEUS)
        .query(query)
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .sort(model.VariableSort.ALPHABETICAL_ASC)
    )


def build(spec: DashboardSpec) -> model.Dashboard:
    dashboard = (
        db.Dashboard(spec.title)
        .uid(spec.uid)
        .description(spec.description)
        .tags(["baton"])
        .time("now-1h", "now")
        .refresh("30s")
        .readonly()
    )
    for variable in _variables(spec):
        dashboard = dashboard.with_variable(variable)
    for panel in spec.panels:
        dashboard = dashboard.with_panel(_panel(panel))
    return dashboard.build()


def dashboard_json(spec: DashboardSpec) -> str:
    return json.dumps(build(spec), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def generated_files() -> dict[Path, str]:
    """Every file ``make dashboards`` writes, with its content."""
    files: dict[Path, str] = {}
    for spec in DASHBOARDS:
        text = dashboard_json(spec)
        files[OUT / f"{spec.uid}.json"] = text
        files[CHART_FILES / "dashboards" / f"{spec.uid}.json"] = text
    files[CHART_FILES / "prometheus" / RULES.name] = RULES.read_text()
    return files


def main() -> int:
    for directory in (OUT, CHART_FILES / "dashboards"):
        shutil.rmtree(directory, ignore_errors=True)  # a dashboard removed here leaves too
    for path, text in generated_files().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
