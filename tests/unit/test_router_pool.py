"""router/pool.py without I/O: decode flags, the pool file, the breaker and load accounting."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.policy import (
    AffinityKey,
    RoutingPolicy,
    affinity_key,
    choose_prefill,
    conversation_digest,
    head_bytes,
    prompt_bytes,
    prompt_prefix,
)
from router.pool import (
    CONVERSATIONS_PER_KEY,
    Breaker,
    DecodeServerSpec,
    Pool,
    PoolCell,
    PoolSpec,
    load_pool_file,
    parse_decode_flag,
)

P0, P1, P2 = "http://p0:1", "http://p1:1", "http://p2:1"
D0, D1 = "http://d0:1", "http://d1:1"


def spec(*cells: tuple[str, tuple[str, ...], tuple[DecodeServerSpec, ...]]) -> tuple[PoolCell, ...]:
    return tuple(PoolCell(name=n, prefill=p, decode=d) for n, p, d in cells)


def ranks(url: str, *numbers: int) -> DecodeServerSpec:
    return DecodeServerSpec(url=url, ranks=numbers)


# ---- parse_decode_flag


@pytest.mark.parametrize(
    ("flag", "url", "ranks_"),
    [
        ("http://d:8000", "http://d:8000", ()),
        ("http://d:8000/", "http://d:8000", ()),
        ("http://d:8000@3", "http://d:8000", (3,)),
        ("http://d:8000@0-3", "http://d:8000", (0, 1, 2, 3)),
        ("http://d:8000@0,1,2,3", "http://d:8000", (0, 1, 2, 3)),
        ("http://d:8000@0-1,6", "http://d:8000", (0, 1, 6)),
    ],
    ids=["url", "trailing-slash", "one-rank", "range", "list", "range-and-list"],
)
def test_decode_flag_forms(flag: str, url: str, ranks_: tuple[int, ...]) -> None:
    assert parse_decode_flag(flag) == DecodeServerSpec(url=url, ranks=ranks_)


@pytest.mark.parametrize(
    "flag", ["http://d@x", "http://d@1-", "http://d@-1", "http://d@1,,2", "http://d@1-x"]
)
def test_malformed_ranks_name_the_flag_and_the_forms(flag: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_decode_flag(flag)
    assert str(caught.value) == f"--decode {flag}: ranks must look like @3, @0-3 or @0,1,2,3"


def test_decode_flag_needs_an_http_url() -> None:
    with pytest.raises(ValueError, match=r"--decode ftp://d@0: .*is not an http:// URL"):
        parse_decode_flag("ftp://d@0")


def test_reversed_rank_range_is_an_error() -> None:
    with pytest.raises(ValueError, match="--decode http://d@3-1"):
        parse_decode_flag("http://d@3-1")


# ---- Breaker


def test_breaker_opens_at_the_threshold_of_consecutive_failures() -> None:
    breaker = Breaker(threshold=3, cooldown_s=5.0)
    breaker.failure(now=100.0)
    breaker.failure(now=100.0)
    assert breaker.allows(now=100.0)
    breaker.failure(now=100.0)
    assert not breaker.allows(now=100.0)
    assert not breaker.allows(now=104.999)


def test_success_resets_the_failure_count() -> None:
    breaker = Breaker(threshold=3, cooldown_s=5.0)
    breaker.failure(now=100.0)
    breaker.failure(now=100.0)
    breaker.success()
    breaker.failure(now=100.0)
    breaker.failure(now=100.0)
    assert breaker.allows(now=100.0)


def test_breaker_lets_a_trial_through_after_the_cooldown_and_a_success_closes_it() -> None:
    breaker = Breaker(threshold=3, cooldown_s=5.0)
    for _ in range(3):
        breaker.failure(now=100.0)
    assert breaker.allows(now=105.0)
    breaker.success()
    assert breaker.allows(now=105.0)
    breaker.failure(now=105.0)
    assert breaker.allows(now=105.0)  # one failure after closing does not reopen it


def test_failed_trial_reopens_the_breaker_for_a_full_cooldown() -> None:
    breaker = Breaker(threshold=3, cooldown_s=5.0)
    for _ in range(3):
        breaker.failure(now=100.0)
    breaker.failure(now=105.0)  # the trial
    assert not breaker.allows(now=109.999)
    assert breaker.allows(now=110.0)


# ---- Pool: targets, load and snapshots (no I/O: nothing is started)


def pool() -> Pool:
    return Pool(
        spec(("c0", (P0, P1), (ranks(D0, 0, 1),)), ("c1", (P2,), (DecodeServerSpec(url=D1),))),
        probe_interval_s=2.0,
    )


def test_pool_names_decode_targets_by_url_and_rank() -> None:
    assert sorted(pool().decode) == [f"{D0}#0", f"{D0}#1", D1]
    view = {rank.name: rank for rank in pool().snapshot().decode}
    assert (view[f"{D0}#1"].url, view[f"{D0}#1"].dp_rank, view[f"{D0}#1"].cell) == (D0, 1, "c0")
    assert (view[D1].url, view[D1].dp_rank, view[D1].cell) == (D1, -1, "c1")


def test_snapshot_reflects_in_flight_accounting() -> None:
    p = pool()
    p.begin_prefill(P0, 700)
    p.begin_prefill(P0, 300)
    p.end_prefill(P0, 700)
    p.begin_decode(f"{D0}#1")
    p.begin_decode(f"{D0}#1")
    p.end_decode(f"{D0}#1")
    snap = p.snapshot()
    assert {v.name: v.outstanding_tokens for v in snap.prefill} == {P0: 300, P1: 0, P2: 0}
    assert {r.name: r.in_flight for r in snap.decode} == {f"{D0}#0": 0, f"{D0}#1": 1, D1: 0}
    assert p.in_flight() == {P0: 1, P1: 0, P2: 0, f"{D0}#0": 0, f"{D0}#1": 1, D1: 0}


def decode_pool(*urls: str) -> Pool:
    return Pool(
        spec(("c0", (P0,), tuple(DecodeServerSpec(url=url) for url in urls))),
        probe_interval_s=2.0,
        breaker=lambda: Breaker(threshold=2),
    )


def test_failures_up_to_the_threshold_eject_a_target_from_the_snapshot() -> None:
    p = decode_pool(D0, D1)
    p.failed(D0)
    assert all(r.healthy for r in p.snapshot().decode)
    p.failed(D0)
    assert [r.healthy for r in p.snapshot().decode] == [False, True]


def test_below_half_healthy_a_pool_panics_and_routes_to_every_target_not_known_dead() -> None:
    p = decode_pool(D0, D1, "http://d2:1")
    for _ in range(2):
        p.failed(D0)
        p.failed(D1)
    # one of three healthy: in panic, the two whose circuits opened take requests again
    assert [r.healthy for r in p.snapshot().decode] == [True, True, True]
    p.decode["http://d2:1"].up = False
    p.decode["http://d2:1"].dead = True  # its server refused a health check: never in panic
    assert [r.healthy for r in p.snapshot().decode] == [True, True, False]


def test_update_keeps_the_load_of_unchanged_targets_and_drops_removed_ones() -> None:
    p = pool()
    p.begin_prefill(P0, 500)
    p.begin_prefill(P2, 100)
    p.begin_decode(f"{D0}#0")
    p.begin_decode(D1)
    p.update(spec(("c0", (P0, "http://p3:1"), (ranks(D0, 0, 1, 2),))))
    assert p.in_flight() == {P0: 1, "http://p3:1": 0, f"{D0}#0": 1, f"{D0}#1": 0, f"{D0}#2": 0}
    assert {v.name: v.outstanding_tokens for v in p.snapshot().prefill} == {
        P0: 500,
        "http://p3:1": 0,
    }


def test_ending_a_request_on_a_removed_target_is_harmless() -> None:
    p = pool()
    p.begin_prefill(P2, 100)
    p.begin_decode(D1)
    p.update(spec(("c0", (P0,), (ranks(D0, 0),))))
    p.end_prefill(P2, 100)
    p.end_decode(D1)
    assert p.in_flight() == {P0: 0, f"{D0}#0": 0}


def test_target_moved_to_another_cell_keeps_its_load_in_the_new_cell() -> None:
    p = pool()
    p.begin_decode(D1)
    p.update(spec(("c0", (P0,), (ranks(D0, 0),)), ("c9", (P2,), (DecodeServerSpec(url=D1),))))
    view = {r.name: r for r in p.snapshot().decode}[D1]
    assert (view.cell, view.in_flight) == ("c9", 1)


# ---- what each affinity key holds cached, and uncached tokens in flight


def session(name: str) -> AffinityKey:
    return affinity_key({"x-session-id": name}, {}, "r")


def keyed_to(p: Pool, instance: str, count: int) -> list[AffinityKey]:
    """``count`` session keys whose affinity choice in ``p`` is ``instance``."""
    found = []
    for index in range(64):  # half of them for each of two instances
        k = session(f"s{index}")
        choice = choose_prefill(p.snapshot(), k, 0, RoutingPolicy())
        if choice is not None and choice.view.name == instance:
            found.append(k)
    assert len(found) >= count
    return found[:count]


def two_instances() -> Pool:
    return Pool(spec(("c0", (P0, P1), (ranks(D0, 0),))), probe_interval_s=2.0)


def conversation(*contents: str, system: str | None = None) -> dict[str, object]:
    """A chat body: user and assistant messages in turn, after ``system`` when given."""
    roles = ("user", "assistant")
    messages = [{"role": roles[i % 2], "content": text} for i, text in enumerate(contents)]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return {"messages": messages}


def remember(p: Pool, k: AffinityKey, instance: str, tokens: int, body: dict[str, object]) -> None:
    """``body``'s prefill of ``tokens`` prompt tokens under ``k`` ran on ``instance``."""
    prompt = prompt_bytes(body)
    conversation_ = conversation_digest(body) or b""
    p.prefix_cached(
        k,
        conversation_,
        instance,
        tokens,
        prompt_prefix(prompt),
        prompt_prefix(prompt, head_bytes(body)),
    )


def cached(p: Pool, k: AffinityKey, body: dict[str, object]) -> dict[str, int]:
    snapshot = p.snapshot(k, prompt_bytes(body), conversation_digest(body) or b"")
    return {v.name: v.cached_tokens for v in snapshot.prefill}


def test_a_cached_turn_in_flight_counts_its_uncached_tokens_and_keeps_the_next_session() -> None:
    """The agentic case end to end: a session with 195K tokens cached on its instance sends a
    200K-token turn; while it runs, a second session keyed to the same instance, with 60K of
    history cached there, sends a 62K-token turn. Counting whole prompts put 200K outstanding
    on the instance and spilled the second session off its cache; counted uncached, both stay."""
    p = two_instances()
    first, second = keyed_to(p, P0, 2)
    remember(p, first, P0, 195_000, conversation("first task"))
    remember(p, second, P0, 60_000, conversation("second task"))
    body = conversation("first task", "done", "next")
    snapshot = p.snapshot(first, prompt_bytes(body), conversation_digest(body) or b"")
    turn = choose_prefill(snapshot, first, 200_000, RoutingPolicy())
    assert turn is not None and turn.view.name == P0 and turn.uncached_tokens == 5_000
    p.begin_prefill(P0, turn.uncached_tokens)
    assert {v.name: v.outstanding_tokens for v in p.snapshot().prefill} == {P0: 5_000, P1: 0}
    body = conversation("second task", "done", "next")
    snapshot = p.snapshot(second, prompt_bytes(body), conversation_digest(body) or b"")
    next_turn = choose_prefill(snapshot, second, 62_000, RoutingPolicy())
    assert next_turn is not None and next_turn.view.name == P0 and not next_turn.spilled
    assert next_turn.uncached_tokens == 2_000


def test_a_conversation_counts_as_cached_only_where_its_last_prefill_ran() -> None:
    p = two_instances()
    k = session("agent-7")
    remember(p, k, P0, 10_000, conversation("task"))
    assert cached(p, k, conversation("task", "done", "next")) == {P0: 10_000, P1: 0}
    # its next turn spilled: the newest cache is there
    remember(p, k, P1, 12_000, conversation("task", "done", "next"))
    assert cached(p, k, conversation("task", "done", "next", "ok", "go on")) == {P0: 0, P1: 12_000}
    # another key, or none, has nothing cached
    assert cached(p, session("other"), conversation("task", "done", "next")) == {P0: 0, P1: 0}
    assert {v.name: v.cached_tokens for v in p.snapshot().prefill} == {P0: 0, P1: 0}


def test_a_key_counts_as_cached_only_for_a_prompt_continuing_one_of_its_conversations() -> None:
    """One key, several conversations (a user's): only a prompt that starts with one cached finds
    it cached, each conversation where its own last turn ran."""
    p = two_instances()
    k = affinity_key({}, {"user": "alice"}, "r")
    remember(p, k, P0, 10_000, conversation("plan the trip"))
    remember(p, k, P1, 4_000, conversation("fix my code"))
    assert cached(p, k, conversation("plan the trip", "done", "book it")) == {P0: 10_000, P1: 0}
    assert cached(p, k, conversation("plan the trip"))[P0] == 10_000  # the same prompt again
    assert cached(p, k, conversation("fix my code", "done", "test it")) == {P0: 0, P1: 4_000}
    assert cached(p, k, conversation("write a poem")) == {P0: 0, P1: 0}  # another conversation
    assert cached(p, k, conversation("plan the trip to Rome", "done"))[P0] == 0  # edited
    assert cached(p, k, {"messages": []})[P0] == 0


def test_a_subagent_finds_its_parents_system_prompt_cached_and_the_parent_its_history() -> None:
    """A subagent is keyed on its parent (X-Parent-Session-ID) and starts from the parent's
    system prompt: it counts that prompt cached where the parent's last turn ran. Its own turns
    then count their own history, and the parent's next turn still finds its whole history
    cached: the subagent's prefill does not take the parent's place under the key."""
    p = two_instances()
    parent = session("agent-7")
    subagent = affinity_key({"x-session-id": "sub-1", "x-parent-session-id": "agent-7"}, {}, "r")
    assert subagent == parent
    system = "you are a coding agent " * 300
    remember(p, parent, P1, 9_000, conversation("fix the bug", "looking", "result", system=system))
    # the system prompt's share of the parent's 9,000 tokens, by bytes
    share = 9_000 * len(system) / len(prompt_bytes(conversation("fix the bug", system=system)))
    task = cached(p, subagent, conversation("find where tokens are counted", system=system))
    assert task[P0] == 0 and share * 0.9 < task[P1] < 9_000
    remember(p, subagent, P1, 2_500, conversation("find where tokens are counted", system=system))
    subagent_turn = conversation("find where tokens are counted", "found", "read it", system=system)
    assert cached(p, subagent, subagent_turn)[P1] == 2_500
    parent_turn = conversation("fix the bug", "looking", "result", "ok", "go", system=system)
    assert cached(p, parent, parent_turn)[P1] == 9_000
    # a conversation with another system prompt, under the same key, finds nothing
    assert cached(p, parent, conversation("fix the bug", system="you are a poet")) == {P0: 0, P1: 0}


def test_the_pool_remembers_only_the_most_recently_prefilled_conversations() -> None:
    p = Pool(spec(("c0", (P0, P1), (ranks(D0, 0),))), probe_interval_s=2.0, cached_prompts=2)
    one, two, three = session("one"), session("two"), session("three")
    body = conversation("task")
    remember(p, one, P0, 100, body)
    remember(p, two, P0, 200, body)
    remember(p, one, P0, 150, body)  # prefilled again: the newest now
    # over the bound: the oldest, two, is forgotten
    remember(p, three, P1, 300, body)
    totals = [sum(cached(p, k, body).values()) for k in (one, two, three)]
    assert totals == [150, 0, 300]


def test_a_key_remembers_its_most_recent_conversations() -> None:
    p = two_instances()
    k = affinity_key({}, {"user": "alice"}, "r")
    tasks = [f"task {i}" for i in range(CONVERSATIONS_PER_KEY + 1)]
    for index, task in enumerate(tasks):
        remember(p, k, P0, 100 + index, conversation(task))
    assert cached(p, k, conversation(tasks[0]))[P0] == 0  # the oldest, forgotten
    assert cached(p, k, conversation(tasks[-1]))[P0] == 100 + CONVERSATIONS_PER_KEY


def engine_metrics(requests: dict[str, tuple[int, int]]) -> str:
    """A vLLM ``/metrics`` page: (running, waiting) requests per ``engine`` label."""
    lines = []
    for name, column in (("vllm:num_requests_running", 0), ("vllm:num_requests_waiting", 1)):
        lines.append(f"# TYPE {name} gauge")
        lines += [
            f'{name}{{engine="{engine}",model_name="dsv4"}} {counts[column]}'
            for engine, counts in requests.items()
        ]
    return "\n".join(lines) + "\n"


def test_other_replicas_prefills_are_priced_at_this_gateways_mean_uncached_tokens() -> None:
    p = two_instances()
    p.record_engine_load(P0, engine_metrics({"0": (1, 1), "1": (1, 0)}))
    # no prefill of its own yet: nothing to price the engine's three requests at
    assert p.peer_outstanding_tokens() == {P0: 0, P1: 0}
    p.begin_prefill(P1, 2_000)
    p.end_prefill(P1, 2_000)
    p.begin_prefill(P0, 4_000)  # mean 3K uncached tokens per prefill
    # the engine's three requests (both ranks) less this gateway's one there: two, at 3K each
    p.record_engine_load(P0, engine_metrics({"0": (1, 1), "1": (1, 0)}))
    p.record_engine_load(P1, engine_metrics({"0": (0, 0), "1": (0, 0)}))
    assert p.peer_outstanding_tokens() == {P0: 6_000, P1: 0}
    assert {v.name: v.outstanding_tokens for v in p.snapshot().prefill} == {P0: 10_000, P1: 0}
    assert p.in_flight()[P0] == 1  # its own count stays exact


def test_an_engine_behind_this_gateways_own_count_means_no_peer_load() -> None:
    p = two_instances()
    p.begin_prefill(P0, 4_000)
    p.begin_prefill(P0, 4_000)
    # one of its two requests has not reached the engine yet: never a negative peer load
    p.record_engine_load(P0, engine_metrics({"0": (1, 0)}))
    assert p.peer_outstanding_tokens() == {P0: 0, P1: 0}


def test_a_prefill_instance_s_dp_ranks_are_learned_from_its_engine_labels() -> None:
    p = two_instances()
    assert {v.name: v.dp_ranks for v in p.snapshot().prefill} == {P0: 0, P1: 0}
    p.record_engine_load(P0, engine_metrics({"0": (1, 0), "1": (0, 0)}))  # DEP2
    p.record_engine_load(P1, engine_metrics({"0": (0, 0)}))
    assert {v.name: v.dp_ranks for v in p.snapshot().prefill} == {P0: 2, P1: 1}
    assert p.prefill_dp_ranks() == {P0: 2, P1: 1}


def test_an_engine_s_kv_block_size_is_read_from_its_cache_config_info() -> None:
    p = two_instances()
    assert p.block_size(P0) == 0  # before its first sync: not known
    info = (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="128",enable_prefix_caching="True",engine="0"} 1.0\n'
    )
    p.record_engine_load(P0, engine_metrics({"0": (0, 0)}) + info)
    assert (p.block_size(P0), p.block_size(P1)) == (128, 0)
    p.record_engine_load(P0, engine_metrics({"0": (0, 0)}))  # a page without it keeps it
    assert p.block_size(P0) == 128


# ---- load_pool_file


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pool.yaml"
    path.write_text(text)
    return path


def test_pool_file_loads_cells_with_normalised_urls(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "cells:\n- name: c0\n  prefill: ['http://p:1/']\n"
        "  decode: [{url: 'http://d:1/', ranks: [0, 1]}]\n",
    )
    assert load_pool_file(path) == PoolSpec(
        cells=spec(("c0", ("http://p:1",), (ranks("http://d:1", 0, 1),)))
    )


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("cells: [unclosed\n", "not valid YAML"),
        ("cells:\n- name: c0\n  prefill: ['http://p']\n", "field 'cells.0.decode': Field required"),
        (
            "cells:\n- name: c0\n  prefill: ['ftp://p']\n  decode: [{url: 'http://d'}]\n",
            "field 'cells.0.prefill': Value error, 'ftp://p' is not an http:// URL",
        ),
        (
            "cells:\n- name: c0\n  decode: [{url: 'http://d', rank: 3}]\n",
            "field 'cells.0.decode.0.rank': Extra inputs are not permitted",
        ),
        ("cells: []\n", "field 'cells': Tuple should have at least 1 item"),
    ],
    ids=["yaml", "missing-decode", "bad-url", "unknown-field", "no-cells"],
)
def test_pool_file_errors_name_the_file_and_the_field(
    tmp_path: Path, text: str, needle: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as caught:
        load_pool_file(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ")
    assert needle in message


def test_missing_pool_file_is_named_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(ValueError) as caught:
        load_pool_file(path)
    assert str(caught.value) == f"{path}: cannot read the pool file (No such file or directory)"
