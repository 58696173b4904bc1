"""``/metrics`` for one simulated API server, with vLLM 0.33's metric names and labels.

Every series carries ``model_name`` and ``engine`` (the DP rank, as a string); an API server
exposes the ranks it manages. Values are read from the engine at scrape time, so serving a
token costs no metrics call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from sim.engine import DPGroup, DPRank
from sim.nixl import NixlSide
from sim.stats import Buckets

__all__ = ["EngineCollector", "engine_registry"]

_LABELS = ["model_name", "engine"]
RankValue = Callable[[DPRank], float]
RankBuckets = Callable[[DPRank], Buckets]


class EngineCollector(Collector):
    def __init__(self, model_name: str, group: DPGroup, ranks: range, nixl: NixlSide) -> None:
        self.model_name = model_name
        self.group = group
        self.ranks = ranks
        self.nixl = nixl

    def collect(self) -> Iterator[Metric]:
        ranks = [(str(r), self.group.ranks[r]) for r in self.ranks]
        name = self.model_name

        def gauge(metric: str, doc: str, value_of: RankValue) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, doc, labels=_LABELS)
            for engine, rank in ranks:
                family.add_metric([name, engine], value_of(rank))
            return family

        def counter(metric: str, doc: str, value_of: RankValue) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, doc, labels=_LABELS)
            for engine, rank in ranks:
                family.add_metric([name, engine], value_of(rank))
            return family

        def histogram(metric: str, doc: str, buckets_of: RankBuckets) -> HistogramMetricFamily:
            family = HistogramMetricFamily(metric, doc, labels=_LABELS)
            for engine, rank in ranks:
                buckets: Buckets = buckets_of(rank)
                family.add_metric([name, engine], buckets.cumulative(), buckets.total)
            return family

        yield gauge(
            "vllm:num_requests_running",
            "Requests in model execution batches.",
            lambda r: len(r.running),
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Requests waiting to be processed.",
            lambda r: len(r.waiting) + len(r.loading),
        )
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Waiting requests by reason.",
            labels=[*_LABELS, "reason"],
        )
        for engine, rank in ranks:
            by_reason.add_metric([name, engine, "capacity"], len(rank.waiting))
            by_reason.add_metric([name, engine, "deferred"], len(rank.loading))
        yield by_reason
        # vLLM's info gauge of its CacheConfig (every field a label, no model_name); the
        # simulator labels the fields it models. The gateway reads the block size from it.
        cache_info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "enable_prefix_caching", "num_gpu_blocks", "engine"],
        )
        for engine, rank in ranks:
            cache = rank.cache
            cache_info.add_metric(
                [str(cache.block_size), "True", str(cache.capacity_blocks), engine], 1
            )
        yield cache_info
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            lambda r: r.cache.usage,
        )
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", lambda r: r.prompt_tokens
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            lambda r: r.generation_tokens,
        )
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_by_source", "Prompt tokens by source.", labels=[*_LABELS, "source"]
        )
        for engine, rank in ranks:
            for source, value in rank.prompt_tokens_by_source.items():
                by_source.add_metric([name, engine, source], value)
        yield by_source
        yield counter(
            "vllm:prompt_tokens_cached",
            "Prompt tokens served from a cache.",
            lambda r: (
                r.prompt_tokens_by_source["local_cache_hit"]
                + r.prompt_tokens_by_source["external_kv_transfer"]
            ),
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in tokens.",
            lambda r: r.cache.queries,
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", lambda r: r.cache.hits
        )
        yield counter(
            "vllm:num_preemptions", "Cumulative number of preemptions.", lambda r: r.preemptions
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Successfully processed requests.",
            labels=[*_LABELS, "finished_reason"],
        )
        for engine, rank in ranks:
            for reason, value in rank.success.items():
                success.add_metric([name, engine, reason], value)
        yield success
        yield histogram(
            "vllm:time_to_first_token_seconds", "Time to first token in seconds.", lambda r: r.ttft
        )
        yield histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", lambda r: r.itl
        )
        yield histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", lambda r: r.e2e
        )
        yield histogram(
            "vllm:request_queue_time_seconds",
            "Time spent waiting in queue.",
            lambda r: r.queue_time,
        )
        yield histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            lambda r: r.prefill_time,
        )
        yield from self._nixl(ranks)
        yield from self._timeline()
        if self.group.moe is not None:
            # The group's agent, not a rank: every API server of the group exposes the same count.
            dropped = CounterMetricFamily(
                "baton:eplb_agent_load_subscribers_dropped",
                "EPLB agent load-stream subscribers dropped for falling behind.",
                labels=["model_name"],
            )
            dropped.add_metric([name], self.group.moe.load_subscribers_dropped)
            yield dropped
            balance = SummaryMetricFamily(
                "baton:sim_expert_balance",
                "Expert balance of the group's decode steps (mean / max rank load, vLLM's "
                "balancedness), per MoE model: _sum over _count is the mean over an interval.",
                labels=["model_name", "moe_model"],
            )
            for moe_model, state in self.group.moe.models.items():
                balance.add_metric([name, moe_model], state.balance_steps, state.balance_sum)
            yield balance

    def _timeline(self) -> Iterator[Metric]:
        # The group's, not a rank's: every API server of a group shows the same counts.
        name = self.model_name
        for metric, doc, value in (
            ("baton:sim_steps", "Engine steps the simulated DP group ran.", self.group.steps),
            (
                "baton:sim_step_seconds",
                "Simulated seconds the group's steps last by the performance model (stretched "
                "while it shares a GPU), summed.",
                self.group.modelled_s,
            ),
            (
                "baton:sim_late_steps",
                "Steps that ended after their modelled end: the host fell behind.",
                self.group.overruns,
            ),
            (
                "baton:sim_lag_seconds",
                "Wall seconds by which late steps ended late, summed.",
                self.group.lag_s,
            ),
        ):
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            yield family

    def _nixl(self, ranks: list[tuple[str, DPRank]]) -> Iterator[Metric]:
        name = self.model_name
        stats = [(engine, self.nixl.stats[int(engine)]) for engine, _ in ranks]
        for metric, doc, field in (
            ("vllm:nixl_num_failed_transfers", "Failed NIXL KV transfers.", "failed_transfers"),
            (
                "vllm:nixl_num_failed_notifications",
                "Failed NIXL notifications.",
                "failed_notifications",
            ),
            (
                "vllm:nixl_num_kv_expired_reqs",
                "Requests whose held KV expired unread.",
                "expired_requests",
            ),
            (
                "vllm:nixl_num_notifications_after_expiry",
                "Notifications after KV expiry.",
                "notifications_after_expiry",
            ),
        ):
            counter = CounterMetricFamily(metric, doc, labels=_LABELS)
            for engine, stat in stats:
                counter.add_metric([name, engine], getattr(stat, field))
            yield counter
        held = GaugeMetricFamily(
            "baton:sim_kv_held_blocks",
            "KV blocks held for remote decodes, not yet pulled, freed or expired.",
            labels=_LABELS,
        )
        for engine, _ in ranks:
            held.add_metric([name, engine], self.nixl.held_blocks(int(engine)))
        yield held
        for metric, doc, field in (
            ("vllm:nixl_xfer_time_seconds", "NIXL KV transfer time.", "xfer_time"),
            ("vllm:nixl_bytes_transferred", "Bytes per NIXL KV transfer.", "bytes_transferred"),
            ("vllm:nixl_num_descriptors", "Descriptors per NIXL KV transfer.", "descriptors"),
        ):
            histogram = HistogramMetricFamily(metric, doc, labels=_LABELS)
            for engine, stat in stats:
                buckets: Buckets = getattr(stat, field)
                histogram.add_metric([name, engine], buckets.cumulative(), buckets.total)
            yield histogram


def engine_registry(collector: EngineCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
