"""``baton bench trace``'s pure parts: reading a Mooncake trace, the prompts it builds, the reuse
the trace allows, the sessions a client would name, where reuse was lost, and the TTFT no router
could beat."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from baton.core.perf import lone_prefill_seconds
from baton.core.profile import load_profile
from baton.core.sim_tokenizer import count_tokens
from bench.trace import (
    BLOCK_TOKENS,
    TraceError,
    TraceRequest,
    compare,
    load_trace,
    prompt_digest,
    prompt_text,
    reusable_tokens,
    reuse_lost,
    sessions,
    ttft_floor_ms,
)


def _request(line: int, length: int, *ids: int, at: int = 0) -> TraceRequest:
    return TraceRequest(line, at, length, 10, ids)


def _write(path: Path, *records: dict[str, Any] | str) -> Path:
    path.write_text(
        "\n".join(r if isinstance(r, str) else orjson.dumps(r).decode() for r in records) + "\n"
    )
    return path


def test_a_window_of_the_trace_is_read_in_arrival_order(tmp_path: Path) -> None:
    trace = _write(
        tmp_path / "t.jsonl",
        {"timestamp": 2500, "input_length": 600, "output_length": 5, "hash_ids": [0, 2]},
        {"timestamp": 1000, "input_length": 512, "output_length": 7, "hash_ids": [0]},
        "",
        {"timestamp": 9000, "input_length": 100, "output_length": 1, "hash_ids": [3]},
    )
    window = load_trace(trace, start_s=1.0, duration_s=5.0)
    assert [(r.line, r.timestamp_ms) for r in window] == [(2, 1000), (1, 2500)]
    assert window[1].hash_ids == (0, 2) and window[1].output_length == 5
    assert len(load_trace(trace)) == 3


@pytest.mark.parametrize(
    ("line", "complaint"),
    [
        ("not json", "not a JSON object"),
        (
            '{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
            "'timestamp'",
        ),
        ('{"timestamp": 0, "input_length": 5, "hash_ids": [1]}', "'output_length' is None"),
        (
            '{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}',
            "'hash_ids' must hold 3 integers",
        ),
    ],
)
def test_a_bad_line_is_named_with_its_field_and_fix(
    tmp_path: Path, line: str, complaint: str
) -> None:
    trace = _write(tmp_path / "t.jsonl", line)
    with pytest.raises(TraceError) as caught:
        load_trace(trace)
    assert f"{trace}:1:" in str(caught.value) and complaint in str(caught.value)


def test_an_empty_window_says_so(tmp_path: Path) -> None:
    trace = _write(
        tmp_path / "t.jsonl",
        {"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]},
    )
    with pytest.raises(TraceError, match="no request arrives in the window 60 s"):
        load_trace(trace, start_s=60, duration_s=10)


def test_equal_block_ids_are_equal_text_and_every_block_is_its_tokens() -> None:
    first = _request(1, 2 * BLOCK_TOKENS + 100, 7, 8, 9)
    second = _request(2, BLOCK_TOKENS + 3, 7, 4)
    a, b = prompt_text(first).encode(), prompt_text(second).encode()
    assert count_tokens(a) == first.input_length and count_tokens(b) == second.input_length
    span = BLOCK_TOKENS * 4  # four bytes a token
    assert a[:span] == b[:span] and a[span : 2 * span] != b[span : 2 * span]
    assert prompt_digest(prompt_text(first)) == prompt_digest(prompt_text(first))


def test_reuse_is_what_an_infinite_cache_would_serve_of_leading_blocks() -> None:
    requests = [
        _request(1, 1200, 1, 2, 3),
        _request(2, 1500, 1, 2, 5),  # two blocks seen: 1024 tokens
        _request(3, 700, 6, 2),  # block 2 seen, but behind a new first block: nothing
        _request(4, 1024, 1, 2),  # the whole prompt seen: all but the token computed anyway
    ]
    assert reusable_tokens(requests) == [0, 1024, 0, 1023]


def test_a_session_is_a_prompt_continuing_an_earlier_one_not_a_shared_system_prompt() -> None:
    requests = [
        _request(1, 1100, 0, 1, 2),  # a conversation's first turn: two full blocks
        _request(2, 1900, 0, 1, 3, 4),  # its second turn: continues both, and more
        _request(3, 900, 0, 5),  # another conversation: the same system prompt only
        _request(4, 1600, 0, 5, 6, 7),  # continues request 3's one full block: too short
        _request(5, 2600, 0, 1, 3, 8, 9, 10),  # the first conversation's third turn
    ]
    assert sessions(requests) == ["trace-1", "trace-1", "trace-3", "trace-4", "trace-1"]


def _log(
    request: TraceRequest,
    rank: tuple[str, int],
    scheduled: float,
    first: float,
    cached: int,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "server": rank[0],
        "dp_rank": rank[1],
        "arrival": scheduled,
        "scheduled": scheduled,
        "first_token": first,
        "prompt_tokens": request.input_length,
        "cached_tokens": cached,
        "external_tokens": 0,
        "remote_decode": True,
        "prompt": prompt_digest(prompt_text(request)),
    } | extra


def test_reuse_lost_is_told_apart_by_where_and_when_the_prefix_was() -> None:
    a, b = ("p0", 0), ("p1", 0)
    first = _request(1, 2048, 1, 2, 3, 4)
    concurrent = _request(2, 2048, 1, 2, 3, 5)  # looked up before first was computed
    elsewhere = _request(3, 2048, 1, 2, 3, 6)  # on b, which never had the prefix
    evicted = _request(4, 2048, 1, 2, 3, 7)  # on a, which kept one block of three
    found = _request(5, 2048, 1, 2, 3, 8)  # on a while first ran: two blocks already there
    log = [
        _log(first, a, 0.0, 1.0, 0),
        _log(concurrent, a, 0.5, 1.5, 0),
        _log(elsewhere, b, 2.0, 3.0, 0),
        _log(evicted, a, 4.0, 5.0, 512),
        _log(found, a, 0.8, 1.8, 1024),
        # the decode side of a handoff computes nothing: not counted
        _log(first, ("d0", 3), 1.0, 1.1, 2048, external_tokens=2048, remote_decode=False),
    ]
    lost = reuse_lost([first, concurrent, elsewhere, evicted, found], log)
    assert lost is not None
    total = 5 * 2048
    assert lost["in_flight"] == pytest.approx(2 * 1536 / total)  # concurrent and found
    assert lost["elsewhere"] == pytest.approx(1536 / total)
    assert lost["evicted"] == pytest.approx(1024 / total)
    assert lost["found_in_flight"] == pytest.approx(1024 / total)
    assert lost["requests_matched"] == 1.0


def test_a_prefix_held_only_by_another_dp_rank_is_lost_elsewhere() -> None:
    a, b = ("p0", 0), ("p0", 1)  # two DP ranks of one instance: two prefix caches
    first = _request(1, 1536, 1, 2, 3)
    second = _request(2, 1536, 1, 2, 4)
    lost = reuse_lost([first, second], [_log(first, a, 0, 1, 0), _log(second, b, 2, 3, 0)])
    assert lost is not None
    assert lost["elsewhere"] == pytest.approx(1024 / 3072) and lost["in_flight"] == 0


def test_no_request_of_the_trace_in_the_log_gives_no_causes() -> None:
    assert reuse_lost([_request(1, 600, 1, 2)], []) is None


def test_the_ttft_floor_is_each_measured_requests_prefill_alone_on_what_it_cannot_reuse() -> None:
    profile = load_profile()
    requests = [
        _request(1, 20_000, *range(1, 41), at=0),  # in the warm-up: not measured
        _request(2, 20_000, *range(1, 40), 99, at=5_000),  # 39 blocks cached, 32 tokens new
        _request(3, 20_000, *range(100, 140), at=6_000),  # nothing cached: a cold prefill
    ]
    floor = ttft_floor_ms(requests, reusable_tokens(requests), profile, warmup_s=5.0)
    warm = lone_prefill_seconds(profile, 20_000 - 39 * 512, 39 * 512) * 1000
    cold = lone_prefill_seconds(profile, 20_000, 0) * 1000
    assert warm < cold  # one chunk against three
    # nearest-rank percentiles, as the measured TTFT's
    assert floor == {
        "requests": 2,
        "p50": pytest.approx(warm),
        "p90": pytest.approx(cold),
        "p99": pytest.approx(cold),
    }


def test_reuse_bounds_the_ttft_and_throughput_ratios_any_router_could_reach() -> None:
    def point(router: str, p90: float) -> dict[str, Any]:
        return {
            "router": router,
            "speedup": 8.0,
            "session_header": False,
            "ttft_ms": {"p90": p90},
            "tokens_per_s_per_gpu": 100.0,
            "p90_tokens_per_s_per_user": 10.0,
            "prefix_reuse_achieved": 0.2,
            "prefix_reuse_theoretical": 0.25,
        }

    (row,) = compare([point("baton", 300.0), point("vllm-router", 400.0)], {"p90": 260.0})
    assert row["ttft_p90_ratio"] == pytest.approx(0.75)
    assert row["floor_p90_ratio"] == pytest.approx(0.65)
    # vllm-router computed 80% of the prompt; with all of the reusable 25% reused, 75%
    assert row["prefill_bound_throughput_ratio_max"] == pytest.approx(0.8 / 0.75)
