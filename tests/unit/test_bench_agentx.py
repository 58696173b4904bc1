"""``baton bench agentx``'s figures, as AgentX defines them, from known records."""

from __future__ import annotations

import math

import pytest

from bench.agentx import Record, compare, reuse_lost, summarize
from bench.workload import Request, Session, lane_sessions, requests_of


def _record(start: float, first: float, end: float, prompt: int, output: int) -> Record:
    return Record("s", 1, False, start, first, end, prompt, output)


def test_figures_follow_the_agentx_definitions_in_simulated_time() -> None:
    # Wall seconds at time scale 2: every figure halves them.
    records = [
        _record(0.0, 0.2, 2.2, 1000, 101),  # ITL (2.2 - 0.2) / 100 / 2 = 10 ms
        _record(1.0, 1.4, 5.4, 3000, 201),  # ITL 4.0 / 200 / 2 = 10 ms
        _record(2.0, 2.2, 2.4, 500, 11),  # ITL 0.2 / 10 / 2 = 10 ms
    ]
    figures = summarize(
        records,
        0.5,
        time_scale=2.0,
        warmup_s=0.0,
        gpus=4,
        computed_prompt_tokens=900.0,
        usd_per_gpu_hour=3.6,
    )
    assert figures["duration_s"] == pytest.approx(2.7)  # (5.4 - 0.0) / 2
    total = 1000 + 3000 + 500 + 101 + 201 + 11
    assert figures["tokens_per_s_per_gpu"] == pytest.approx(total / 2.7 / 4)
    assert figures["output_per_s_per_gpu"] == pytest.approx(313 / 2.7 / 4)
    assert figures["p90_tokens_per_s_per_user"] == pytest.approx(100.0)  # 1 / 10 ms
    # TTFTs 0.2, 0.4, 0.2 s wall: 100, 200, 100 ms; nearest-rank percentiles
    assert figures["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert figures["ttft_ms"]["p99"] == pytest.approx(200.0)
    assert figures["prefix_reuse_achieved"] == pytest.approx(1 - 900 / 4500)
    cached = figures["cached_input_per_s_per_gpu"] + figures["uncached_input_per_s_per_gpu"]
    assert cached == pytest.approx(4500 / 2.7 / 4)
    # $/M tokens = $/GPU-hour / (tokens/s/GPU x 3600 / 1e6)
    per_gpu = figures["tokens_per_s_per_gpu"]
    assert figures["usd_per_million_tokens"] == pytest.approx(3.6 / (per_gpu * 3600 / 1e6))


def test_warmups_errors_and_requests_before_the_window_are_not_measured() -> None:
    warm = Record("s", 0, True, 5.0, 5.1, 5.2, 900, 1)
    early = _record(0.5, 0.6, 1.6, 100, 11)
    failed = Record("s", 2, False, 6.0, error="HTTP 503")
    kept = _record(4.0, 4.1, 5.1, 100, 11)
    figures = summarize(
        [warm, early, failed, kept],
        0.0,
        time_scale=1.0,
        warmup_s=2.0,
        gpus=None,
        computed_prompt_tokens=None,
        usd_per_gpu_hour=1.0,
    )
    assert figures["requests"] == 1 and figures["errors"] == 1
    assert figures["error_kinds"] == ["HTTP 503"]
    assert figures["duration_s"] == pytest.approx(1.1)
    assert "tokens_per_s_per_gpu" not in figures  # no GPU count, no per-GPU figure
    assert figures["prefix_reuse_achieved"] is None  # nobody reported cached tokens


def test_baton_is_compared_at_each_concurrency_as_ratios() -> None:
    def point(router: str, rate: float, user: float) -> dict[str, object]:
        return {
            "router": router,
            "concurrency": 8,
            "tokens_per_s_per_gpu": rate,
            "p90_tokens_per_s_per_user": user,
            "prefix_reuse_achieved": 0.9,
            "prefix_reuse_theoretical": 0.96,
        }

    rows = compare([point("baton", 1200.0, 100.0), point("vllm-router", 1000.0, 80.0)])
    assert rows == [
        {
            "concurrency": 8,
            "against": "vllm-router",
            "throughput_per_gpu_ratio": pytest.approx(1.2),
            "p90_per_user_ratio": pytest.approx(1.25),
            "baton_reuse_of_theoretical": pytest.approx(0.9 / 0.96),
        }
    ]
    assert not math.isnan(rows[0]["throughput_per_gpu_ratio"])


def test_reuse_lost_is_split_by_cause_from_the_prefill_engines_cached_counts() -> None:
    """Where a Baton point computed again what the workload let it reuse, as shares of the
    prompt tokens sent: a subagent's first turn (its parent's system prompt), a turn that found
    less than half its history cached (a spill: during the warmup flood or after), the rest
    (the partial last block of each prompt)."""
    parent = next(s for s in lane_sessions(5, 0) if any(t.subagents for t in s.turns))
    sub = next(sub for t in parent.turns for sub in t.subagents)

    def sent(
        session: Session, turn: int, start: float, cached: int, warmup: bool = False
    ) -> tuple[Record, Request]:
        theoretical = next(r for r in requests_of(session) if r.turn == turn).cached_prefix_tokens
        request = Request(session, turn, warmup, 0 if warmup else theoretical)
        prompt = session.prompt_tokens(turn)
        record = Record(session.name, turn, warmup, start, start, start + 1, prompt, 1, cached)
        return record, request

    pairs = [
        sent(parent, 1, 0.0, 0, warmup=True),  # a warmup reuses nothing, loses nothing
        sent(parent, 2, 1.0, 0),  # history lost during the warmup (before 10 s wall)
        sent(parent, 3, 20.0, 0),  # history lost after it
        sent(parent, 4, 30.0, parent.prompt_tokens(3) - 10),  # 10 tokens short: the rest
        sent(sub, 0, 40.0, 0),  # the subagent's first turn computed the system prompt
    ]
    records, requests = [p[0] for p in pairs], [p[1] for p in pairs]
    lost = reuse_lost(records, requests, warmup_wall_s=10.0)
    total = sum(r.prompt_tokens for r in records)
    assert lost == pytest.approx(
        {
            "subagent_first_turn": sub.system_tokens / total,
            "history_during_warmup": parent.prompt_tokens(1) / total,
            "history_after_warmup": parent.prompt_tokens(2) / total,
            "other": 10 / total,
        }
    )
    # a router whose responses do not all report cached tokens has no breakdown
    records[0].cached_tokens = None
    assert reuse_lost(records, requests, warmup_wall_s=10.0) is None
