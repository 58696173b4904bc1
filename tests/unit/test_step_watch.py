"""A decode group's step against the performance model (``controller.stragglers``): the
Prometheus answers read as the group's step, the prediction, the slow-window runs, and the tray
blamed for a slow group by its GPUs' NVLink errors."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from baton.core.perf import RankBatch, step_seconds
from baton.core.profile import load_profile
from controller.stragglers import (
    LINK_ERROR_COUNTERS,
    GpuLinkErrors,
    GroupStep,
    SlowGroup,
    StepWatch,
    degraded_marks,
    expected_step_seconds,
    group_step_from,
    link_culprit,
    link_error_queries,
    link_errors_from,
    step_queries,
)

PROFILE = load_profile()


def sample(value: float, **labels: str) -> dict[str, Any]:
    return {"metric": labels, "value": [1.0, str(value)]}


def test_the_queries_select_the_groups_decode_engines_as_the_podmonitor_labels_them() -> None:
    queries = step_queries("prod/dsv4", "dsv4-cell-0", 60)
    group = 'modeldeployment="prod/dsv4",cell="dsv4-cell-0",role="decode"'
    balance = queries.pop("balance")
    assert all(group in promql for promql in queries.values())
    assert balance == 'min by (model) (baton_eplb_step_balance{group="dsv4-cell-0"})'
    assert queries["itl_sum"].startswith("sum(increase(vllm:inter_token_latency_seconds_sum{")
    assert queries["running"].endswith("[60s])")


def test_a_window_reads_as_the_mean_step_and_each_ranks_batch_and_context() -> None:
    engines = [("10.0.0.1:8000", "0"), ("10.0.0.1:8000", "1"), ("10.0.0.2:8000", "0")]
    results = {
        "itl_sum": [sample(3.0, instance=i) for i in ("10.0.0.1:8000", "10.0.0.2:8000")],
        "itl_count": [sample(150.0, instance=i) for i in ("10.0.0.1:8000", "10.0.0.2:8000")],
        "running": [
            sample(r, instance=i, engine=e) for (i, e), r in zip(engines, (4, 2, 2), strict=True)
        ],
        "kv_usage": [sample(0.5, instance=i, engine=e) for i, e in engines],
        "cache": [
            sample(1.0, instance=i, engine=e, num_gpu_blocks="100", block_size="16")
            for i, e in engines
        ],
        "balance": [sample(0.8, model="target"), sample(0.7, model="draft")],
    }
    step = group_step_from(results)
    assert step is not None
    assert step.step_s == 6.0 / 300.0 and step.steps == 300.0
    assert sorted(step.requests) == [2.0, 2.0, 4.0]
    assert step.context_tokens == 3 * 0.5 * 1600 / 8  # tokens in use over running requests
    assert (step.target_balance, step.draft_balance) == (0.8, 0.7)


def test_a_group_that_emitted_no_token_has_no_step() -> None:
    empty: dict[str, list[dict[str, Any]]] = {
        "itl_sum": [],
        "itl_count": [sample(0.0)],
        "running": [],
        "kv_usage": [],
        "cache": [],
    }
    assert group_step_from(empty) is None


@given(st.integers(1, 128), st.integers(0, 200_000), st.integers(0, 3))
def test_the_prediction_is_the_models_step_for_that_batch(
    requests: int, context: int, draft: int
) -> None:
    step = GroupStep(0.02, 1000, (float(requests),) * 32, float(context), 0.8, 0.7)
    query = 1 + draft
    batch = RankBatch(requests, requests * query, float(requests * context * query))
    model = step_seconds(
        PROFILE, [batch] * 32, num_speculative_tokens=draft, target_balance=0.8, draft_balance=0.7
    )
    assert expected_step_seconds(PROFILE, step, num_speculative_tokens=draft) == model.total_s


def test_a_worse_balance_predicts_a_longer_step_and_none_predicts_nothing() -> None:
    step = GroupStep(0.02, 1000, (64.0,) * 32, 8192.0)
    balanced = expected_step_seconds(PROFILE, replace(step, target_balance=0.95))
    cold = expected_step_seconds(PROFILE, replace(step, target_balance=0.35))
    assert balanced is not None and cold is not None and cold > balanced
    assert expected_step_seconds(PROFILE, step) is None


def window(slowdown: float, steps: float = 1000.0) -> GroupStep:
    return GroupStep(0.02 * slowdown, steps, (64.0,) * 32, 8192.0)


@given(st.lists(st.floats(0.5, 1.249), min_size=1, max_size=30))
def test_a_group_within_the_models_margin_is_never_slow(slowdowns: list[float]) -> None:
    watch = StepWatch(persist=1)
    assert all(watch.observe(t, window(s), 0.02) is None for t, s in enumerate(slowdowns))


@given(st.lists(st.booleans(), min_size=1, max_size=20), st.integers(1, 5))
def test_a_group_is_slow_only_after_persist_slow_windows_in_a_row(
    slow: list[bool], persist: int
) -> None:
    watch = StepWatch(persist=persist)
    run = 0
    for now, is_slow in enumerate(slow):
        verdict = watch.observe(float(now), window(1.5 if is_slow else 1.0), 0.02)
        run = run + 1 if is_slow else 0
        assert (verdict is not None) == (run >= persist)
        if verdict is not None:
            assert verdict.since == now - run + 1
            assert abs(verdict.slowdown - 1.5) < 1e-9


def test_an_idle_window_judges_nothing_and_keeps_the_run() -> None:
    watch = StepWatch(persist=2)
    assert watch.observe(0.0, window(1.5), 0.02) is None
    assert watch.observe(1.0, window(3.0, steps=10), 0.02) is None  # too few steps to judge
    assert watch.observe(2.0, None, 0.02) is None  # no token at all
    verdict = watch.observe(3.0, window(1.5), 0.02)
    assert verdict is not None and verdict.since == 0.0
    assert verdict.message.startswith("decode steps take 30.0 ms, 1.50x the 20.0 ms")


SLOW = SlowGroup(1.3, 0.026, 0.02, since=7.0)


@given(st.lists(st.floats(0.0, 9.99), max_size=32))
def test_links_with_fewer_than_the_minimum_errors_blame_no_tray(errors: list[float]) -> None:
    gpus = [GpuLinkErrors(f"tray-{i // 4}", str(i % 4), e) for i, e in enumerate(errors)]
    assert link_culprit(SLOW, gpus, 60) is None


@given(st.lists(st.floats(0.0, 1e6), min_size=1, max_size=32), st.floats(10.0, 1e7))
def test_the_gpu_whose_links_failed_most_is_blamed_with_the_groups_slowdown(
    others: list[float], worst: float
) -> None:
    gpus = [
        GpuLinkErrors(f"tray-{i // 4}", str(i % 4), min(e, worst)) for i, e in enumerate(others)
    ]
    gpus.append(GpuLinkErrors("tray-9", "2", worst))
    culprit = link_culprit(SLOW, gpus, 60)
    assert culprit is not None and culprit.errors == worst
    assert (culprit.slowdown, culprit.since) == (1.3, 7.0)
    if all(e < worst for e in others):
        assert (culprit.tray, culprit.gpu) == ("tray-9", "2")


def test_a_link_verdict_says_what_failed_and_how_slow_the_group_ran() -> None:
    culprit = link_culprit(SLOW, [GpuLinkErrors("rack-0-tray-3", "1", 3000.0)], 60)
    assert culprit is not None
    assert culprit.message == (
        "GPU 1's NVLinks logged 3000 CRC, replay and recovery errors in 60 s while its decode "
        "group's steps took 1.30x the performance model's prediction"
    )
    marks = degraded_marks(culprit, datetime(2026, 12, 6, tzinfo=UTC))
    assert marks["baton.dev/degraded-slowdown"] == "1.300"


def test_each_gpus_four_nvlink_error_counters_are_summed_over_the_window() -> None:
    queries = link_error_queries(["rack-0-tray-0", "rack-0-tray-1"], 60)
    assert queries[2] == (
        'increase(DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL{Hostname=~"rack-0-tray-0|'
        'rack-0-tray-1"}[60s])'
    )
    assert len(queries) == len(LINK_ERROR_COUNTERS) == 4
    flits = [sample(30.0, Hostname="rack-0-tray-1", gpu="2")]
    replays = [sample(30.0, Hostname="rack-0-tray-1", gpu="2"), sample(0.0, Hostname="t", gpu="0")]
    errors = link_errors_from([flits, [], replays, []])
    assert sorted(errors, key=lambda e: e.errors) == [
        GpuLinkErrors("t", "0", 0.0),
        GpuLinkErrors("rack-0-tray-1", "2", 60.0),
    ]
