"""router/policy.py: affinity keys, prefill and decode choices, the P/D decider, pure."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from itertools import pairwise

import orjson
import pytest

from baton.core.model import BYTES_PER_TOKEN
from router.policy import (
    PROMPT_KEY_BYTES,
    SESSION_HEADERS,
    AffinityKey,
    AffinitySource,
    DecodeRankView,
    PoolSnapshot,
    PrefillPolicy,
    PrefillView,
    RoutingPolicy,
    affinity_key,
    choose_decode_rank,
    choose_prefill,
    conversation_digest,
    estimate_prompt_tokens,
    needs_prefill,
    prompt_bytes,
    uncached_tokens,
)

SYSTEM = {"role": "system", "content": "You are a careful coding agent."}
POLICY = RoutingPolicy(imbalance_tokens=1000)
PROMPT = 2000  # a request's estimated prompt tokens, cached nowhere unless a test says so


def prefill(
    name: str,
    cell: str = "c0",
    *,
    tokens: int = 0,
    cached: int = 0,
    healthy: bool = True,
    dp_rank: int = -1,
) -> PrefillView:
    return PrefillView(name, cell, healthy, tokens, cached, dp_rank)


def instance(name: str, dp_ranks: int) -> list[PrefillView]:
    """A prefill instance's views as the pool gives them: one per DP rank, or one for the whole
    instance with one rank or before its ranks are known."""
    if dp_ranks <= 1:
        return [prefill(name)]
    return [prefill(name, dp_rank=rank) for rank in range(dp_ranks)]


def rank(
    url: str, dp_rank: int, cell: str = "c0", *, in_flight: int = 0, healthy: bool = True
) -> DecodeRankView:
    return DecodeRankView(f"{url}#{dp_rank}", url, cell, dp_rank, healthy, in_flight)


def snapshot(
    prefills: list[PrefillView], ranks: list[DecodeRankView] | None = None
) -> PoolSnapshot:
    cells = sorted({view.cell for view in prefills}) or ["c0"]
    default = [rank(f"http://decode-{cell}", 0, cell) for cell in cells]
    return PoolSnapshot(prefill=tuple(prefills), decode=tuple(default if ranks is None else ranks))


def key(text: str) -> AffinityKey:
    return affinity_key({"x-session-id": text}, {}, "r")


def chosen(
    snap: PoolSnapshot, k: AffinityKey, policy: RoutingPolicy = POLICY, **kw: Sequence[str]
) -> str:
    choice = choose_prefill(snap, k, PROMPT, policy, **kw)
    assert choice is not None
    return choice.view.name


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


FOUR = [prefill(f"http://p{i}") for i in range(4)]


# ---- affinity_key: sources and priorities


@pytest.mark.parametrize(
    ("headers", "body", "source"),
    [
        ({"x-session-id": "s"}, {"user": "u", "messages": [user("hi")]}, AffinitySource.SESSION),
        ({"x-session-id": ""}, {"user": "u", "messages": [user("hi")]}, AffinitySource.USER),
        ({}, {"user": "u", "messages": [user("hi")]}, AffinitySource.USER),
        ({}, {"user": "", "messages": [user("hi")]}, AffinitySource.CONVERSATION),
        ({}, {"messages": [user("hi")], "prompt": "p"}, AffinitySource.CONVERSATION),
        ({}, {"prompt": "a prompt"}, AffinitySource.PROMPT),
        ({}, {"prompt": [1, 2, 3]}, AffinitySource.PROMPT),
        ({}, {"prompt": ""}, AffinitySource.REQUEST),
        ({}, {"messages": []}, AffinitySource.REQUEST),
        ({}, {}, AffinitySource.REQUEST),
    ],
    ids=[
        "session-over-user",
        "empty-session-skipped",
        "user-over-conversation",
        "empty-user-skipped",
        "conversation-over-prompt",
        "prompt-text",
        "prompt-token-ids",
        "empty-prompt-is-request",
        "no-messages-is-request",
        "nothing-is-request",
    ],
)
def test_affinity_key_source_follows_priority(
    headers: dict[str, str], body: dict[str, object], source: AffinitySource
) -> None:
    assert affinity_key(headers, body, "req-1").source is source


def test_session_headers_are_read_in_their_priority_order() -> None:
    for earlier, later in pairwise(SESSION_HEADERS):
        both = affinity_key({later: "second", earlier: "first"}, {}, "r")
        assert both == affinity_key({earlier: "first"}, {}, "r"), (earlier, later)


def test_same_session_value_keys_the_same_whichever_header_carries_it() -> None:
    keys = {affinity_key({name: "agent-7"}, {}, "r") for name in SESSION_HEADERS}
    assert len(keys) == 1


def test_session_and_user_with_the_same_value_have_different_keys() -> None:
    assert key("abc").digest != affinity_key({}, {"user": "abc"}, "r").digest


def test_later_turns_of_a_conversation_share_the_first_turns_key() -> None:
    first = [SYSTEM, user("fix the bug in pool.py")]
    second = [*first, assistant("done"), user("now add a test")]
    third = [*second, assistant("added"), user("run it")]
    keys = {
        affinity_key({}, {"messages": turn}, f"r{i}")
        for i, turn in enumerate([first, second, third])
    }
    assert len(keys) == 1


def test_conversations_sharing_only_a_system_prompt_have_different_keys() -> None:
    one = affinity_key({}, {"messages": [SYSTEM, user("task one")]}, "r")
    two = affinity_key({}, {"messages": [SYSTEM, user("task two")]}, "r")
    assert one.digest != two.digest


def test_conversation_key_ignores_key_order_inside_a_message() -> None:
    shuffled = {"content": "fix the bug", "role": "user"}
    assert affinity_key({}, {"messages": [shuffled]}, "r") == affinity_key(
        {}, {"messages": [user("fix the bug")]}, "r"
    )


def test_prompts_sharing_their_head_share_a_key() -> None:
    head = "x" * PROMPT_KEY_BYTES
    assert affinity_key({}, {"prompt": head + "tail one"}, "r1") == affinity_key(
        {}, {"prompt": head + "tail two"}, "r2"
    )
    assert affinity_key({}, {"prompt": "a" + head}, "r") != affinity_key(
        {}, {"prompt": "b" + head}, "r"
    )


def test_token_prompts_sharing_their_head_share_a_key() -> None:
    head = list(range(PROMPT_KEY_BYTES // BYTES_PER_TOKEN))
    assert affinity_key({}, {"prompt": [*head, 1]}, "r1") == affinity_key(
        {}, {"prompt": [*head, 2]}, "r2"
    )


def test_request_id_keys_differ_per_request() -> None:
    assert affinity_key({}, {}, "r1") != affinity_key({}, {}, "r2")
    assert affinity_key({}, {}, "r1") == affinity_key({}, {}, "r1")


# ---- choose_prefill


def test_prefill_choice_is_deterministic_and_independent_of_snapshot_order() -> None:
    k = key("session-1")
    forward, backward = snapshot(FOUR), snapshot(FOUR[::-1])
    assert chosen(forward, k) == chosen(forward, k) == chosen(backward, k)


def test_prefill_choice_spreads_keys_over_every_instance() -> None:
    counts = Counter(chosen(snapshot(FOUR), key(f"s{i}")) for i in range(1000))
    assert set(counts) == {view.name for view in FOUR}
    assert all(150 <= n <= 350 for n in counts.values()), counts  # 250 each on average


def test_removing_an_instance_moves_only_its_own_keys() -> None:
    keys = [key(f"s{i}") for i in range(300)]
    before = {k: chosen(snapshot(FOUR), k) for k in keys}
    gone = FOUR[2].name
    after = {k: chosen(snapshot([v for v in FOUR if v.name != gone]), k) for k in keys}
    assert {k for k in keys if before[k] != after[k]} == {k for k in keys if before[k] == gone}


def test_a_keys_prefills_go_to_one_dp_rank_of_its_instance() -> None:
    """Each DP rank has its own prefix cache: a session's turns must all reach the rank that
    holds its history, whatever the instance's ranks are doing."""
    dep2 = [view for i in range(4) for view in instance(f"http://p{i}", 2)]
    k = key("session-1")
    ranks = set()
    for tokens in (0, 5_000, 900):  # the instance's load changes between the turns
        views = [replace(view, outstanding_tokens=tokens) for view in dep2]
        choice = choose_prefill(snapshot(views), k, PROMPT, POLICY)
        assert choice is not None
        ranks.add(choice.view.unit)
    assert len(ranks) == 1 and ranks.pop().endswith(("#0", "#1"))


def dp_rank(ranks: int, k: AffinityKey) -> int:
    choice = choose_prefill(snapshot(instance("http://p0", ranks)), k, PROMPT, POLICY)
    assert choice is not None
    return choice.view.dp_rank


def test_keys_spread_over_an_instances_dp_ranks() -> None:
    counts = Counter(dp_rank(4, key(f"s{i}")) for i in range(800))
    assert set(counts) == {0, 1, 2, 3}
    assert all(120 <= n <= 280 for n in counts.values()), counts  # 200 each on average


def test_no_dp_rank_is_named_for_one_rank_or_before_the_ranks_are_known() -> None:
    assert dp_rank(0, key("s")) == dp_rank(1, key("s")) == -1


def test_affinity_choice_holds_up_to_the_imbalance_bound() -> None:
    k = key("hot-session")
    first = chosen(snapshot(FOUR), k)
    second = chosen(snapshot(FOUR), k, exclude=[first])
    loads = {first: 5000 + POLICY.imbalance_tokens, second: 5000}
    views = [replace(v, outstanding_tokens=loads.get(v.name, 0)) for v in FOUR]
    choice = choose_prefill(snapshot(views), k, PROMPT, POLICY)
    assert choice is not None and choice.view.name == first and not choice.spilled


def test_affinity_spills_to_the_second_rendezvous_choice_beyond_the_bound() -> None:
    k = key("hot-session")
    first = chosen(snapshot(FOUR), k)
    second = chosen(snapshot(FOUR), k, exclude=[first])
    # the others are idle: the spill goes to the key's second choice, not the least loaded
    loads = {first: 5001 + POLICY.imbalance_tokens, second: 5000}
    views = [replace(v, outstanding_tokens=loads.get(v.name, 0)) for v in FOUR]
    choice = choose_prefill(snapshot(views), k, PROMPT, POLICY)
    assert choice is not None and choice.view.name == second and choice.spilled


def test_unhealthy_prefill_is_skipped_for_the_next_choice() -> None:
    k = key("session-1")
    first = chosen(snapshot(FOUR), k)
    second = chosen(snapshot(FOUR), k, exclude=[first])
    views = [replace(v, healthy=v.name != first) for v in FOUR]
    assert chosen(snapshot(views), k) == second


def test_prefill_in_a_cell_without_healthy_decode_is_never_chosen() -> None:
    views = [prefill("http://a0", "a"), prefill("http://b0", "b"), prefill("http://b1", "b")]
    ranks = [rank("http://decode-a", 0, "a"), rank("http://decode-b", 0, "b", healthy=False)]
    picks = {chosen(snapshot(views, ranks), key(f"s{i}")) for i in range(50)}
    assert picks == {"http://a0"}


def test_no_prefill_choice_without_a_healthy_candidate() -> None:
    down = [replace(v, healthy=False) for v in FOUR]
    assert choose_prefill(snapshot(down), key("s"), PROMPT, POLICY) is None
    no_decode = snapshot(FOUR, [rank("http://d", 0, healthy=False)])
    assert choose_prefill(no_decode, key("s"), PROMPT, POLICY) is None
    everything = [v.name for v in FOUR]
    assert choose_prefill(snapshot(FOUR), key("s"), PROMPT, POLICY, exclude=everything) is None


def test_least_loaded_policy_takes_the_fewest_outstanding_tokens_whatever_the_key() -> None:
    policy = RoutingPolicy(prefill=PrefillPolicy.LEAST_LOADED)
    views = [
        replace(v, outstanding_tokens=t) for v, t in zip(FOUR, [900, 300, 100, 700], strict=True)
    ]
    picks = {chosen(snapshot(views), key(f"s{i}"), policy) for i in range(50)}
    assert picks == {"http://p2"}


def test_least_loaded_policy_breaks_ties_by_the_keys_first_choice() -> None:
    policy = RoutingPolicy(prefill=PrefillPolicy.LEAST_LOADED)
    for i in range(20):
        k = key(f"s{i}")
        choice = choose_prefill(snapshot(FOUR), k, PROMPT, policy)
        assert choice is not None
        assert choice.view.name == chosen(snapshot(FOUR), k) and not choice.spilled


# ---- the load bound counts uncached tokens


def candidates(k: AffinityKey) -> tuple[str, str]:
    """The key's first and second rendezvous choices among FOUR."""
    first = chosen(snapshot(FOUR), k)
    return first, chosen(snapshot(FOUR), k, exclude=[first])


def views_with(loads: dict[str, tuple[int, int]]) -> list[PrefillView]:
    """FOUR with (outstanding, cached) tokens by instance name; the others idle, cached nothing."""
    views = []
    for view in FOUR:
        outstanding, cached = loads.get(view.name, (0, 0))
        views.append(replace(view, outstanding_tokens=outstanding, cached_tokens=cached))
    return views


def test_a_cached_turn_in_flight_does_not_push_another_cached_session_off_its_instance() -> None:
    """The agentic case: a 200K-token turn with 195K of it cached runs on the key's first
    choice, so 5K tokens are outstanding there; a session whose 60K history is cached there
    sends its next turn, 62K tokens. Counting whole prompts (200K outstanding) spilled it; its
    2K uncached tokens stay."""
    policy = RoutingPolicy()  # the default allowance, 8192 tokens
    k = key("second-session")
    first, _ = candidates(k)
    views = views_with({first: (5_000, 60_000)})
    choice = choose_prefill(snapshot(views), k, 62_000, policy)
    assert choice is not None and choice.view.name == first and not choice.spilled
    assert choice.uncached_tokens == 2_000


def test_the_bound_compares_each_candidates_load_with_the_request() -> None:
    # 3K of a 5K prompt cached on the first choice: the request adds 2K there, 5K on the second
    k = key("hot-session")
    first, second = candidates(k)

    def pick(first_outstanding: int) -> tuple[str, bool, int]:
        views = views_with({first: (first_outstanding, 3_000)})
        choice = choose_prefill(snapshot(views), k, 5_000, POLICY)
        assert choice is not None
        return choice.view.name, choice.spilled, choice.uncached_tokens

    # 4K + 2K is the second's 0 + 5K plus the allowance (1K): still the first's
    assert pick(4_000) == (first, False, 2_000)
    # one token more spills, and the request's whole prompt is uncached on the second
    assert pick(4_001) == (second, True, 5_000)


def test_a_spill_onto_a_busy_rank_must_gain_the_prefix_it_leaves_once_per_queued_prefill() -> None:
    """20K of a 25K prompt cached on the first choice. Onto an idle second choice the request
    spills once its wait there is shorter by the allowance; onto a busy one only once it is
    shorter by the allowance and the 20K it would compute again once for each prefill queued
    there, as many as will queue after it and wait for them (on GPU engines under load, such
    spills were where the reuse went: baton_gateway_prompt_tokens_not_reused_total
    {cause="routed_away"})."""
    k = key("agent-session")
    first, second = candidates(k)

    def pick(first_outstanding: int, second_queued: tuple[int, int]) -> tuple[str, int]:
        views = views_with({first: (first_outstanding, 20_000)})
        tokens, requests = second_queued
        views = [
            replace(v, outstanding_tokens=tokens, outstanding_requests=requests)
            if v.name == second
            else v
            for v in views
        ]
        choice = choose_prefill(snapshot(views), k, 25_000, POLICY)
        assert choice is not None
        return choice.view.name, choice.routed_away_tokens

    # idle second: 20K + 5K against 0 + 25K, plus the allowance (1K)
    assert pick(21_000, (0, 0)) == (first, 0)
    assert pick(21_001, (0, 0)) == (second, 20_000)
    # one prefill (10K) queued on the second: the 20K left behind count once
    assert pick(31_001, (10_000, 1)) == (first, 0)
    assert pick(51_000, (10_000, 1)) == (first, 0)
    assert pick(51_001, (10_000, 1)) == (second, 20_000)
    # three queued there: as many will queue behind the request, each waiting for the 20K
    assert pick(91_000, (10_000, 3)) == (first, 0)
    assert pick(91_001, (10_000, 3)) == (second, 20_000)


def test_a_key_cached_on_its_second_choice_follows_its_cache_there() -> None:
    # its last turn spilled: recomputing 50K on the idle first choice loses to 2K on the second
    k = key("spilled-session")
    _, second = candidates(k)
    views = views_with({second: (0, 48_000)})
    choice = choose_prefill(snapshot(views), k, 50_000, POLICY)
    assert choice is not None and choice.view.name == second and not choice.spilled
    assert choice.uncached_tokens == 2_000


def test_the_allowance_favours_the_candidate_holding_the_cache_whichever_rank_it_has() -> None:
    """A session whose cache sits on its second choice (its last turn spilled) stays there
    until leaving the cache gains more than the allowance: 45K queued + 2K to compute beats
    recomputing 50K. Checked from the first choice's side, the bound sent it back to the idle
    first choice once the queue passed 39,808 tokens, and its history was lost."""
    k = key("spilled-session")
    first, second = candidates(k)

    def pick(queued: int) -> tuple[str, bool]:
        choice = choose_prefill(snapshot(views_with({second: (queued, 48_000)})), k, 50_000, POLICY)
        assert choice is not None
        return choice.view.name, choice.spilled

    assert pick(45_000) == (second, False)
    # the cache's 45K + 2K plus the allowance is the first's 50K: still the cache's
    assert pick(50_000 + POLICY.imbalance_tokens - 2_000) == (second, False)
    # one token more spills back to the first choice, the whole prompt uncached there
    assert pick(50_001 + POLICY.imbalance_tokens - 2_000) == (first, True)


def test_the_instances_holding_the_longest_prefixes_are_the_candidates_whatever_their_rank() -> (
    None
):
    # a prompt sharing a document or an earlier turn with requests of other keys: found where
    # they went, not only among the key's two choices
    k = key("session-1")
    first, second = candidates(k)
    third, fourth = (v.name for v in FOUR if v.name not in (first, second))
    views = views_with({third: (0, 40_000), fourth: (0, 20_000)})
    choice = choose_prefill(snapshot(views), k, 50_000, POLICY)
    assert choice is not None and choice.view.name == third and not choice.spilled
    # past the bound it spills to the next-longest prefix, not to the key's first choice
    views = views_with({third: (60_000, 40_000), fourth: (0, 20_000)})
    choice = choose_prefill(snapshot(views), k, 50_000, POLICY)
    assert choice is not None and choice.view.name == fourth and choice.spilled
    # what the spill leaves behind: the longer prefix less what the next-longest holds
    assert (choice.best_cached_tokens, choice.routed_away_tokens) == (40_000, 20_000)
    # with one holder, the key's first choice is the other candidate
    views = views_with({third: (60_000, 40_000)})
    choice = choose_prefill(snapshot(views), k, 50_000, POLICY)
    assert choice is not None and choice.view.name == first and choice.spilled


def test_the_dp_rank_holding_the_prefix_takes_the_prompt() -> None:
    k = key("session-1")
    keyed = dp_rank(2, k)
    views = instance("http://p0", 2)
    views[1 - keyed] = replace(views[1 - keyed], cached_tokens=4_096)
    choice = choose_prefill(snapshot(views), k, 5_000, POLICY)
    assert choice is not None and choice.view.dp_rank == 1 - keyed and not choice.spilled


def test_conversations_that_share_only_an_opening_spread_by_key_not_onto_its_holders() -> None:
    # Seen replaying a production trace with the engines' KV events: every prompt shared its
    # first 16-token block, so the first two ranks that computed it held a prefix of every
    # prompt, took every prefill and left 16 of 18 instances idle.
    k = key("session-1")
    first = chosen(snapshot(FOUR), k)
    holders = [view for view in FOUR if view.name != first][:2]
    opening = [replace(view, cached_tokens=16) if view in holders else view for view in FOUR]
    assert chosen(snapshot(opening), k) == first
    # a system prompt of 30% of the prompt is not enough either; a third of it is
    system = [replace(v, cached_tokens=PROMPT * 3 // 10) if v in holders else v for v in FOUR]
    assert chosen(snapshot(system), k) == first
    history = [replace(v, cached_tokens=PROMPT // 3 + 1) if v in holders else v for v in FOUR]
    assert chosen(snapshot(history), k) in {view.name for view in holders}
    # a threshold of 0 follows any prefix, however short
    assert chosen(snapshot(opening), k, replace(POLICY, cache_threshold=0.0)) != first


def test_a_prompt_never_queues_on_a_busy_rank_past_the_bound_while_its_sibling_is_idle() -> None:
    # Seen replaying a production trace at 64x: a DP rank holding the prefix had seconds of
    # prefill queued while its sibling rank sat idle, since load was bounded per instance.
    k = key("session-1")
    holder, sibling = instance("http://p0", 2)
    busy = replace(holder, cached_tokens=4_096, outstanding_tokens=6_000)
    choice = choose_prefill(snapshot([busy, sibling]), k, 5_000, POLICY)
    assert choice is not None and choice.view.unit == sibling.unit and choice.spilled
    assert choice.uncached_tokens == 5_000
    # 6,000 + 904 uncached is past 5,000 + 1,000; at 5,000 + 904 the prefix holds it
    within = replace(busy, outstanding_tokens=5_000)
    choice = choose_prefill(snapshot([within, sibling]), k, 5_000, POLICY)
    assert choice is not None and choice.view.unit == holder.unit and not choice.spilled


def test_least_loaded_policy_counts_the_requests_uncached_tokens_on_each_instance() -> None:
    policy = RoutingPolicy(prefill=PrefillPolicy.LEAST_LOADED)
    k = key("session-1")
    # p0 has more outstanding, but the request's 5K prompt is cached there but for 1K
    views = [
        prefill("http://p0", tokens=3_000, cached=4_000),
        prefill("http://p1", tokens=1_000),
        prefill("http://p2", tokens=2_000),
    ]
    choice = choose_prefill(snapshot(views), k, 5_000, policy)
    assert choice is not None and choice.view.name == "http://p0"
    assert choice.uncached_tokens == 1_000


def test_uncached_tokens_are_never_negative() -> None:
    # the engine counted more tokens than the estimate of the next turn: nothing to compute
    assert uncached_tokens(prefill("http://p0", cached=2_100), 2_000) == 0
    assert uncached_tokens(prefill("http://p0", cached=1_500), 2_000) == 500
    assert uncached_tokens(prefill("http://p0"), 2_000) == 2_000


# ---- choose_decode_rank


RANKS = [rank("http://d", i) for i in range(4)]


def test_decode_rank_with_fewest_in_flight_wins() -> None:
    ranks = [replace(r, in_flight=n) for r, n in zip(RANKS, [3, 1, 2, 4], strict=True)]
    choice = choose_decode_rank(snapshot([], ranks), b"k")
    assert choice is not None and choice.dp_rank == 1


def test_decode_rank_stays_in_the_given_cell() -> None:
    ranks = [rank("http://da", 0, "a", in_flight=5), rank("http://db", 0, "b", in_flight=0)]
    choice = choose_decode_rank(snapshot([], ranks), b"k", cell="a")
    assert choice is not None and choice.cell == "a"
    assert choose_decode_rank(snapshot([], ranks), b"k", cell="c") is None


def test_decode_rank_skips_excluded_and_unhealthy_ranks() -> None:
    ranks = [*RANKS[:2], replace(RANKS[2], healthy=False), RANKS[3]]
    exclude = [RANKS[0].name, RANKS[1].name]
    choice = choose_decode_rank(snapshot([], ranks), b"k", exclude=exclude)
    assert choice is not None and choice.name == RANKS[3].name
    everything = [r.name for r in RANKS]
    assert choose_decode_rank(snapshot([], RANKS), b"k", exclude=everything) is None


def test_tied_decode_ranks_are_spread_by_request_key_and_stable_per_key() -> None:
    snap = snapshot([], RANKS)
    picks: Counter[int] = Counter()
    for i in range(400):
        first = choose_decode_rank(snap, f"req-{i}".encode())
        again = choose_decode_rank(snapshot([], RANKS[::-1]), f"req-{i}".encode())
        assert first is not None and again is not None and first.name == again.name
        picks[first.dp_rank] += 1
    assert set(picks) == {0, 1, 2, 3}
    assert all(50 <= n <= 150 for n in picks.values()), picks  # 100 each on average


# ---- the P/D decider and the token estimate


@pytest.mark.parametrize(
    ("tokens", "expected"), [(0, False), (255, False), (256, True), (10_000, True)]
)
def test_prompts_from_the_threshold_up_need_prefill(tokens: int, expected: bool) -> None:
    assert needs_prefill(tokens, RoutingPolicy(pd_threshold_tokens=256)) is expected


@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        ({"prompt": "abcd" * 10}, 11),
        ({"prompt": "é" * 10}, 6),  # bytes, not characters: 20 bytes
        ({"prompt": [5, 6, 7]}, 3),
        ({"prompt": ["abcd" * 10, "abcd"]}, 11 + 2),
        ({"prompt": [[1, 2], [3, 4, 5]]}, 5),
        ({"messages": [user("hi")]}, len(orjson.dumps([user("hi")])) // 4 + 1),
        ({}, 0),
    ],
    ids=["text", "utf8-bytes", "token-ids", "text-batch", "token-batch", "messages", "none"],
)
def test_prompt_tokens_are_estimated_from_bytes_or_counted_from_ids(
    body: dict[str, object], tokens: int
) -> None:
    assert estimate_prompt_tokens(body) == tokens
    # the same from the prompt bytes the gateway made anyway, without serializing again
    assert estimate_prompt_tokens(body, prompt_bytes(body)) == tokens


def test_long_system_prompts_are_told_apart_by_length_and_ends_not_hashed_whole() -> None:
    def keyed(system: str) -> bytes:
        messages = [{"role": "system", "content": system}, user("go")]
        return affinity_key({}, {"messages": messages}, "r").digest

    document = "the cell keeps prefill and decode in one NVLink domain. " * 10_000
    middle = len(document) // 2
    edited = document[:middle] + "X" + document[middle + 1 :]
    assert keyed(document) == keyed(document)
    assert keyed(document + ".") != keyed(document)  # longer
    assert keyed("X" + document[1:]) != keyed(document)  # another start
    assert keyed(document[:-1] + "X") != keyed(document)  # another end
    # by design: an edit deep inside, at the same length, shares the key (a routing choice only)
    assert keyed(edited) == keyed(document)


@pytest.mark.parametrize(
    "body",
    [{"messages": [SYSTEM, user("fix the bug")]}, {"prompt": "a prompt"}, {"prompt": [1, 2, 3]}],
    ids=["chat", "prompt-text", "prompt-token-ids"],
)
def test_a_key_taken_from_the_conversation_is_its_conversation_digest(
    body: dict[str, object],
) -> None:
    # the gateway takes the key's digest as the conversation then, instead of hashing twice
    assert affinity_key({}, body, "r").digest == conversation_digest(body)
    assert affinity_key({"x-session-id": "s"}, body, "r").digest != conversation_digest(body)
