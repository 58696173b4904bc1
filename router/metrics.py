"""The gateway's Prometheus metrics (prefix ``baton_gateway_``, units in the names).

No per-request or per-session labels. Every series names the ModelDeployment whose engines it
measures (``modeldeployment``, NAMESPACE/NAME; empty for engines given by flags or a pool file,
and for requests refused before their model was known), since one gateway may serve several;
per-target gauges are labelled by target and role besides (a cell has a few dozen targets).
Handlers bind label children once per request, never per chunk.

Under ``baton gateway --workers N`` each worker records into prometheus_client's multiprocess
files (``router/workers.py``) and a scrape answered by any worker reads them all: counters and
histograms add up, and each gauge says how its workers' values combine (``multiprocess_mode``,
ignored by one process). The per-target gauges come from each worker's pool, which only that
worker sees, so every worker writes them on the pool's interval as well as when it is scraped.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector

from router.pool import Pool

__all__ = ["CHAT_ROUTE", "COMPLETIONS_ROUTE", "GatewayMetrics"]

CHAT_ROUTE = "/v1/chat/completions"
COMPLETIONS_ROUTE = "/v1/completions"
# Every outcome and reason known in advance is exported at 0 from the start: a series that
# appears with its first failure already counted gives Prometheus no increase to take a rate
# of, so the first failures would never show in a rate or an alert.
# error: the gateway's own 5xx; rejected: its 4xx (bad input, auth); engine_error: an engine's
# 4xx relayed; stream_error: a stream ended by an SSE error event.
OUTCOMES = ("ok", "rejected", "error", "engine_error", "stream_error", "client_disconnect")
UPSTREAM_REASONS = ("error", "status", "timeout", "connection")  # router.errors' UpstreamErrors
EJECTION_REASONS = ("failed_health_check", "unanswered_health_checks")  # router.pool's
ADMISSION_WAITS = ("waited", "saturated")  # router.prober's decode_place, past "free"
# router.kv_subscriber's batches: applied, or not vLLM's format (counted, skipped)
KV_EVENT_OUTCOMES = ("applied", "undecodable")
_DEPLOYMENT = "modeldeployment"
FALLBACK_REASONS = (
    *UPSTREAM_REASONS,
    "malformed",
    "no_kv_transfer_params",
    "short_block_ids",
    "decode_retry",
)

# Agentic TTFT reaches minutes (long prefills queued behind others); ITL sits below 10 ms.
TTFT_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
)
ITL_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
)
E2E_BUCKETS = (
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
    640.0,
    1280.0,
)
PHASE_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)


class GatewayMetrics:
    """Every metric the gateway exports, in its own registry; ``multiprocess``: a worker's, whose
    values prometheus_client keeps in ``PROMETHEUS_MULTIPROC_DIR`` with every other worker's.

    An instance records for one ModelDeployment (``deployment``; :meth:`for_deployment` gives
    another's view of the same families): its bound children and :meth:`child` fill the
    ``modeldeployment`` label."""

    def __init__(
        self, registry: CollectorRegistry | None = None, *, multiprocess: bool = False
    ) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.multiprocess = multiprocess
        # what /metrics serves: this registry, or every worker's files
        self.exposed = self.registry
        if multiprocess:
            self.exposed = CollectorRegistry()
            MultiProcessCollector(self.exposed)
        r = self.registry
        self.requests = Counter(
            "baton_gateway_requests",
            "Requests by route and outcome.",
            [_DEPLOYMENT, "route", "outcome"],
            registry=r,
        )
        self.ttft_histogram = Histogram(
            "baton_gateway_time_to_first_token_seconds",
            "Time from request arrival to the first generated token.",
            [_DEPLOYMENT],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl_histogram = Histogram(
            "baton_gateway_inter_token_latency_seconds",
            "Mean time between tokens of one request after the first.",
            [_DEPLOYMENT],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e_histogram = Histogram(
            "baton_gateway_e2e_request_latency_seconds",
            "Time from request arrival to its last byte.",
            [_DEPLOYMENT],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.phase = Histogram(
            "baton_gateway_phase_seconds",
            "Time per phase: route (arrival to the first leg: tokenizing, admission, "
            "the choice), prefill (call), handoff (prefill done to first decode byte), "
            "decode (first to last decode byte).",
            [_DEPLOYMENT, "phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "baton_gateway_retries",
            "Retries on another target.",
            [_DEPLOYMENT, "phase", "reason"],
            registry=r,
        )
        self.fallbacks = Counter(
            "baton_gateway_fallbacks",
            "Requests served by decode alone after a prefill failure.",
            [_DEPLOYMENT, "reason"],
            registry=r,
        )
        self.aborts = Counter(
            "baton_gateway_aborts",
            "Requests ended early, by phase and reason.",
            [_DEPLOYMENT, "phase", "reason"],
            registry=r,
        )
        self.routes = Counter(
            "baton_gateway_routing_decisions",
            "P/D routing paths taken: pd (prefill then decode) or decode_only.",
            [_DEPLOYMENT, "path"],
            registry=r,
        )
        self.affinity = Counter(
            "baton_gateway_affinity",
            "Prefill choices that stayed where the affinity key's cache is, else on its "
            "first choice (hit), or spilled over to the other candidate (miss), by key source.",
            [_DEPLOYMENT, "source", "result"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "baton_gateway_prompt_tokens",
            "Prompt tokens by whether prefill found them cached.",
            [_DEPLOYMENT, "kind"],
            registry=r,
        )
        self.not_reused = Counter(
            "baton_gateway_prompt_tokens_not_reused",
            "Prompt tokens a prefill rank had been sent before that prefill computed again, "
            "by cause: routed_away (the prefill went to a rank holding less of the prompt "
            "than another), absent (the chosen rank had been sent them: evicted, or still "
            "being computed for an earlier request).",
            [_DEPLOYMENT, "cause"],
            registry=r,
        )
        self.indexed_tokens_counter = Counter(
            "baton_gateway_prompt_tokens_indexed",
            "Prompt tokens the prefix index said the chosen prefill rank held: what the gateway "
            'expected prefill to find cached (compare with prompt_tokens{kind="cached"}).',
            [_DEPLOYMENT],
            registry=r,
        )
        self.output_tokens_counter = Counter(
            "baton_gateway_output_tokens", "Generated tokens returned.", [_DEPLOYMENT], registry=r
        )
        self.first_tokens_from_prefill_counter = Counter(
            "baton_gateway_first_tokens_from_prefill",
            "Streamed completions whose first token the client had from the prefill leg, before "
            "the KV handoff; the decode leg continued after it.",
            [_DEPLOYMENT],
            registry=r,
        )
        self.prompts_as_ids_counter = Counter(
            "baton_gateway_prompts_as_token_ids",
            "Completion prompts sent to the engines as the token ids the gateway computed with "
            "their tokenizer, which they then need not tokenize again.",
            [_DEPLOYMENT],
            registry=r,
        )
        # Workers: the gateway's requests are the sum of each worker's exact count; those of a
        # worker that died went with it.
        self.in_flight = Gauge(
            "baton_gateway_in_flight_requests",
            "Requests this gateway has in flight per target.",
            [_DEPLOYMENT, "role", "target"],
            registry=r,
            multiprocess_mode="livesum",
        )
        # Workers: each counts its sibling workers among the other replicas, so each estimate is
        # high by its siblings' requests; the smallest is the nearest to other gateways' load.
        self.peer_in_flight = Gauge(
            "baton_gateway_peer_in_flight_requests",
            "Requests other gateway replicas hold per decode rank, estimated from the engines'"
            " metrics at the last load sync.",
            [_DEPLOYMENT, "target"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.missed_health_checks = Counter(
            "baton_gateway_health_checks_missed",
            "Health checks an engine API server left unanswered (timed out); three in a row "
            "with no other sign of life eject it.",
            [_DEPLOYMENT, "server"],
            registry=r,
        )
        self.ejections = Counter(
            "baton_gateway_ejections",
            "Engine API servers ejected by their health checks: failed_health_check (refused, "
            "reset or an error answer: dead), unanswered_health_checks (three in a row with no "
            "other sign of life).",
            [_DEPLOYMENT, "reason"],
            registry=r,
        )
        self.admission_waits = Counter(
            "baton_gateway_admission_waits",
            "Requests that found every decode rank at --max-requests-per-rank: placed after a "
            "wait (waited), or answered 429 when none freed a place in --queue-timeout "
            "(saturated).",
            [_DEPLOYMENT, "result"],
            registry=r,
        )
        self.waiting_requests = Gauge(
            "baton_gateway_waiting_requests",
            "Requests waiting now for a decode rank below --max-requests-per-rank.",
            [_DEPLOYMENT],
            registry=r,
            multiprocess_mode="livesum",
        )
        # Workers: each judges panic on its own; the one that sees panic, as an alert wants.
        self.panic = Gauge(
            "baton_gateway_panic",
            "1 while fewer than half of a role's targets are healthy and the gateway routes to "
            "every target of that role not known dead (Envoy's panic threshold).",
            [_DEPLOYMENT, "role"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.peer_outstanding_tokens = Gauge(
            "baton_gateway_peer_outstanding_tokens",
            "Uncached prompt tokens other gateway replicas have in flight per prefill instance, "
            "estimated at the last load sync: the engine's requests less this replica's, at this "
            "replica's mean uncached tokens per prefill.",
            [_DEPLOYMENT, "target"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.prefill_dp_ranks = Gauge(
            "baton_gateway_prefill_dp_ranks",
            "DP ranks each prefill instance reports (its metrics' engine labels) at the last load "
            "sync; a key's prefills go to one of them by X-data-parallel-rank, none while 0.",
            [_DEPLOYMENT, "target"],
            registry=r,
            multiprocess_mode="livemax",
        )
        # Workers: each checks health on its own; the one that sees the most healthy targets, as
        # the alerts take the replica that sees the most (deploy/prometheus/baton-rules.yaml).
        self.healthy_targets = Gauge(
            "baton_gateway_healthy_targets",
            "Targets this gateway would route to now (health check passed, circuit closed) per "
            "role and cell; 0 for a cell whose targets are all down.",
            [_DEPLOYMENT, "role", "cell"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.kv_event_batches = Counter(
            "baton_gateway_kv_event_batches",
            "Batches of KV events read from the prefill engines' publishers (vLLM's "
            "--kv-events-config): applied to the prefix index, or undecodable (skipped).",
            [_DEPLOYMENT, "outcome"],
            registry=r,
        )
        self.kv_event_gaps = Counter(
            "baton_gateway_kv_event_gaps",
            "Gaps in a publisher's sequence numbers (batches dropped on the way): the rank's "
            "blocks are forgotten until it reports them again.",
            [_DEPLOYMENT],
            registry=r,
        )
        self.kv_event_blocks = Gauge(
            "baton_gateway_kv_event_blocks",
            "KV blocks each prefill DP rank (target#rank) holds, as its KV events reported them "
            "to this gateway (the GPU tier's blocks of the prefix cache).",
            [_DEPLOYMENT, "target"],
            registry=r,
            multiprocess_mode="livemax",
        )
        # label values set on the pool gauges so far (workers only: see set_pool_gauges)
        self._pool_series: dict[Gauge, set[tuple[str, ...]]] = {}
        self.deployment = ""
        self._bind()

    def for_deployment(self, deployment: str) -> GatewayMetrics:
        """The same families, recording for ``deployment`` (NAMESPACE/NAME)."""
        view = copy.copy(self)
        view.deployment = deployment
        view._bind()
        return view

    def _bind(self) -> None:
        # children bound once: handlers never look labels up on the hot path
        self._children: dict[tuple[object, ...], Any] = {}
        self.ttft = self.child(self.ttft_histogram)
        self.itl = self.child(self.itl_histogram)
        self.e2e = self.child(self.e2e_histogram)
        self.output_tokens = self.child(self.output_tokens_counter)
        self.prompts_as_ids = self.child(self.prompts_as_ids_counter)
        self.first_tokens_from_prefill = self.child(self.first_tokens_from_prefill_counter)
        self.cached_tokens = self.child(self.prompt_tokens, "cached")
        self.indexed_tokens = self.child(self.indexed_tokens_counter)
        self.uncached_tokens = self.child(self.prompt_tokens, "uncached")
        # both causes served from the start, at 0: a share of them is a ratio from the first scrape
        self.routed_away_tokens = self.child(self.not_reused, "routed_away")
        self.absent_tokens = self.child(self.not_reused, "absent")
        self.route_seconds = self.child(self.phase, "route")
        self.prefill_seconds = self.child(self.phase, "prefill")
        self.handoff_seconds = self.child(self.phase, "handoff")
        self.decode_seconds = self.child(self.phase, "decode")
        self.pd_routes = self.child(self.routes, "pd")
        self.decode_only_routes = self.child(self.routes, "decode_only")
        # labels known only per request (route, outcome, key source) are looked up once each
        for route in (CHAT_ROUTE, COMPLETIONS_ROUTE):
            for outcome in OUTCOMES:
                self.child(self.requests, route, outcome)
        for reason in FALLBACK_REASONS:
            self.child(self.fallbacks, reason)
        for reason in UPSTREAM_REASONS:
            self.child(self.retries, "decode", reason)
        for reason in EJECTION_REASONS:
            self.child(self.ejections, reason)
        for result in ADMISSION_WAITS:
            self.child(self.admission_waits, result)
        for outcome in KV_EVENT_OUTCOMES:
            self.child(self.kv_event_batches, outcome)
        self.child(self.kv_event_gaps)

    def child(self, metric: MetricWrapperBase, *labels: str) -> Any:
        """``metric.labels(deployment, *labels)``, remembered: prometheus_client's lookup costs
        microseconds per call, and every request makes a few."""
        key = (metric, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(self.deployment, *labels)
        return child

    def set_pool_gauges(self, pools: Mapping[str, Pool]) -> None:
        """The per-target gauges as each ModelDeployment's pool (``pools``, by NAMESPACE/NAME)
        has them now. One process: rebuilt, so targets that left a pool leave the gauges. A
        worker: prometheus_client cannot delete a series from its file, so a target that left is
        set to 0 instead."""
        series: dict[Gauge, dict[tuple[str, ...], float]] = {
            gauge: {} for gauge in (*self._per_target, self.waiting_requests)
        }
        for deployment, pool in pools.items():
            for gauge, values in self._pool_values(pool).items():
                series[gauge].update({(deployment, *labels): v for labels, v in values.items()})
            series[self.waiting_requests][(deployment,)] = pool.waiting_for_place
            # Every server's missed-check count exists from the start, at 0: a scrape shows
            # the family and rate() has a first point before the first miss.
            for url in pool.server_urls():
                self.missed_health_checks.labels(deployment, url)
        for gauge, values in series.items():
            if self.multiprocess:
                seen = self._pool_series.setdefault(gauge, set())
                for labels in seen - values.keys():
                    gauge.labels(*labels).set(0)
                seen.update(values)
            else:
                gauge.clear()
            for labels, value in values.items():
                gauge.labels(*labels).set(value)

    def _pool_values(self, pool: Pool) -> dict[Gauge, dict[tuple[str, ...], float]]:
        """One pool's per-target gauge values, without the deployment label."""
        return {
            self.in_flight: {
                ("prefill" if name in pool.prefill else "decode", name): count
                for name, count in pool.in_flight().items()
            },
            self.peer_in_flight: {(name,): n for name, n in pool.peer_in_flight().items()},
            self.peer_outstanding_tokens: {
                (name,): tokens for name, tokens in pool.peer_outstanding_tokens().items()
            },
            self.prefill_dp_ranks: {(name,): n for name, n in pool.prefill_dp_ranks().items()},
            self.healthy_targets: {labels: n for labels, n in pool.healthy_targets().items()},
            self.panic: {(role,): float(panic) for role, panic in pool.panic.items()},
            self.kv_event_blocks: {(rank,): n for rank, n in pool.kv_blocks_held().items()},
        }

    @property
    def _per_target(self) -> tuple[Gauge, ...]:
        return (
            self.in_flight,
            self.peer_in_flight,
            self.peer_outstanding_tokens,
            self.prefill_dp_ranks,
            self.healthy_targets,
            self.panic,
            self.kv_event_blocks,
        )

    def stream_ended(
        self,
        route: str,
        usage: Mapping[str, object] | None,
        ended: str,
        *,
        started: float,
        first_token: float,
        now: float,
    ) -> None:
        """Record a finished decode stream: the request's outcome (``ok``, ``client_disconnect``,
        or ``stream_error`` when it ended with an SSE error event), how it ended, its timings on
        the ``perf_counter`` clock, its tokens."""
        if ended == "ok":
            outcome = "ok"
        else:
            self.child(self.aborts, "decode", ended).inc()
            outcome = "client_disconnect" if ended == "client_disconnect" else "stream_error"
        self.child(self.requests, route, outcome).inc()
        self.e2e.observe(now - started)
        self.decode_seconds.observe(now - first_token)
        tokens = usage.get("completion_tokens") if usage is not None else None
        if isinstance(tokens, int) and tokens:
            self.output_tokens.inc(tokens)
            if tokens > 1:
                self.itl.observe((now - first_token) / (tokens - 1))
