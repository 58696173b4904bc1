"""Prometheus metrics of the EPLB service (prefix ``baton_eplb_``), on a registry passed in.

Agent mode (the service decides and switches) and plugin mode (the engines do, and report each
window: ``eplb.engine_reports``) export the same balance, move and byte series.

Balance figures are *window balances* (sum over layers of mean rank load / sum of max rank load,
the load summed over a window), the quantity the algorithm predicts, except
``baton_eplb_step_balance``, which is vLLM's per-step balancedness averaged over the last window.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["EplbMetrics"]

_FAST = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class EplbMetrics:
    def __init__(self, registry: CollectorRegistry, *, per_layer: bool = False) -> None:
        labels = ("group", "model")
        self.balance = Gauge(
            "baton_eplb_balance",
            "Window balance at the last decision: stage=before (placement in force), "
            "predicted (new placement, same window), achieved (new placement, first full "
            "window after the switch)",
            (*labels, "stage"),
            registry=registry,
        )
        self.step_balance = Gauge(
            "baton_eplb_step_balance",
            "Mean per-step balancedness (vLLM's figure) over the last complete window",
            labels,
            registry=registry,
        )
        self.rebalances = Counter(
            "baton_eplb_rebalances",
            "Rebalance decisions by outcome: committed, gain_too_small, incomplete_window, "
            "switch_pending, "
            "prepare_failed, prepare_timeout, commit_failed",
            (*labels, "outcome"),
            registry=registry,
        )
        self.decision_seconds = Histogram(
            "baton_eplb_decision_seconds",
            "Time to compute one model's placement and prediction",
            labels,
            buckets=_FAST,
            registry=registry,
        )
        self.switch_seconds = Histogram(
            "baton_eplb_switch_round_trip_seconds",
            "Prepare to every agent, all acks, Commit to every agent: wall time",
            labels,
            buckets=_FAST,
            registry=registry,
        )
        self.experts_moved = Counter(
            "baton_eplb_experts_moved",
            "Experts copied onto a rank by committed switches",
            labels,
            registry=registry,
        )
        self.bytes_moved = Counter(
            "baton_eplb_bytes_moved",
            "Expert weight bytes copied over NVLink by committed switches",
            labels,
            registry=registry,
        )
        self.engine_windows = Counter(
            "baton_eplb_engine_windows",
            "Rebalances vLLM engines made themselves (plugin mode), by who placed: baton, or "
            "vllm_default (the spec's policy, or after a fallback)",
            (*labels, "policy"),
            registry=registry,
        )
        self.plugin_inactive = Gauge(
            "baton_eplb_plugin_inactive",
            "1 while a group's engines run vLLM's own policy because Baton's plugin is not "
            "active there (reason: unsupported_vllm_version)",
            ("group", "reason", "vllm_version"),
            registry=registry,
        )
        self.reports_dropped = Counter(
            "baton_eplb_reports_dropped",
            "Load reports dropped: stale, unknown_version, wrong_shape",
            (*labels, "reason"),
            registry=registry,
        )
        self.group_synced = Gauge(
            "baton_eplb_group_synced",
            "1 while the service follows every agent of a group (synced: agents described, "
            "windows open), 0 while it connects or reconnects after losing one (agent mode)",
            ("group",),
            registry=registry,
        )
        self.switches_recovered = Counter(
            "baton_eplb_switches_recovered",
            "Switches an earlier service left, settled at sync: aborted (staged, never "
            "committed), committed (committed on some agents only), reunified (agents switched "
            "back to the group's newest placement), restored (a restarted group switched back "
            "to the placement in force before)",
            ("group", "action"),
            registry=registry,
        )
        self.window_restarts = Counter(
            "baton_eplb_window_restarts",
            "Group windows restarted: agent_lost, incarnation_changed",
            ("group", "reason"),
            registry=registry,
        )
        self.layer_balance = (
            Gauge(
                "baton_eplb_layer_balance",
                "Window balance per MoE layer of the placement in force (last complete window)",
                (*labels, "layer"),
                registry=registry,
            )
            if per_layer
            else None
        )
