"""The simulator's performance model: how long one engine step of a DP group takes.

Pure: profile constants and batch shapes in, simulated seconds out. The engine loop calls it
once per step; the calibration tests call it with the study's shapes (docs/simulator.md).

A step of a DP group (wide-EP lockstep: every rank runs every layer together):

    step = max over ranks of rank_time + MoE time + draft time + EPLB copy   (decode tokens present)
    rank_time = rest_fixed + rest_per_token * q + attention * sum(context * query tokens)
                + prefill_overhead + sum over chunks n * (per_token + per_token_context * (c + n/2))
                                                      + context_read * c
    MoE = moe_fixed + moe_per_token * (mean routed tokens per rank / balance) * reference_balance

``q`` is the rank's decode query tokens (1 + draft tokens per request); an idle rank still pays
``rest_fixed`` (vLLM runs a dummy batch so the collectives line up), so uneven requests per rank
cost throughput. MoE is set by the most loaded expert rank: mean / balance is that rank's load,
and the figure was measured at ``reference_balance``. The draft (DSpark MTP) forward runs once per
draft token over every request.

A step that carries an EPLB switch's copy of one layer's expert weights (``sim.moe``) is longer
by the copy's NVLink time (``expert_copy_seconds``: the most experts any one rank receives in
that layer, times an expert's bytes, over one GPU's NVLink bandwidth). The copy shares the links
the MoE's dispatch and combine use, and at decode batch sizes those are latency-bound exchanges
that a bulk copy on the same links delays by about its own duration: the assumption is that the
step pays all of it, an upper bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from baton.core.experts import Placement, moves_per_rank
from baton.core.profile import FrontendProfile, Profile

__all__ = [
    "PrefillChunk",
    "RankBatch",
    "StepTime",
    "api_server_ready",
    "expected_tokens_per_step",
    "expert_copy_seconds",
    "lone_prefill_chunks",
    "lone_prefill_seconds",
    "prefill_chunk_seconds",
    "step_seconds",
    "switch_copy_seconds",
]


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """``new_tokens`` prompt tokens computed on top of ``context_tokens`` already in KV."""

    new_tokens: int
    context_tokens: int


@dataclass(frozen=True, slots=True)
class RankBatch:
    """What one DP rank runs in one step."""

    decode_requests: int = 0
    decode_query_tokens: int = 0
    decode_context_query_product: float = 0.0  # sum over requests of context x query tokens
    prefill_chunks: tuple[PrefillChunk, ...] = ()
    # The share of its nominal SM clock the rank's GPU runs at (a throttled GPU: below 1): its
    # compute takes 1/share as long
    clock_share: float = 1.0


@dataclass(frozen=True, slots=True)
class StepTime:
    total_s: float
    moe_s: float
    rest_s: float
    draft_s: float
    prefill_s: float
    eplb_s: float = 0.0  # an EPLB switch's weight copy carried by this step


def prefill_chunk_seconds(profile: Profile, chunk: PrefillChunk) -> float:
    """Compute time of one prefill chunk on one rank (attention grows with the context)."""
    p = profile.prefill
    n = chunk.new_tokens
    return (
        n * (p.per_token_s + p.per_token_context_s * (chunk.context_tokens + n / 2))
        + p.context_read_per_token_s * chunk.context_tokens
    )


def lone_prefill_chunks(
    new_tokens: int, context_tokens: int, chunk_tokens: int
) -> list[PrefillChunk]:
    """The chunks vLLM's scheduler splits a prompt alone on its rank into: ``chunk_tokens`` (its
    ``max_num_batched_tokens``) a step, each on the context the earlier ones left."""
    return [
        PrefillChunk(min(chunk_tokens, new_tokens - done), context_tokens + done)
        for done in range(0, new_tokens, chunk_tokens)
    ]


def lone_prefill_seconds(profile: Profile, new_tokens: int, context_tokens: int) -> float:
    """A prompt's prefill alone on an idle rank: ``new_tokens`` computed on ``context_tokens``
    served from its prefix cache, one step a chunk."""
    chunks = lone_prefill_chunks(new_tokens, context_tokens, profile.prefill.max_num_batched_tokens)
    return sum(step_seconds(profile, [RankBatch(prefill_chunks=(c,))]).total_s for c in chunks)


def _rank_seconds(profile: Profile, batch: RankBatch, decoding: bool) -> tuple[float, float]:
    d = profile.decode
    rest = 0.0
    if decoding:
        rest = (
            d.rest_fixed_s
            + d.rest_per_token_s * batch.decode_query_tokens
            + d.attention_per_context_token_s * batch.decode_context_query_product
        )
    prefill = 0.0
    if batch.prefill_chunks:
        prefill = profile.prefill.step_overhead_s + sum(
            prefill_chunk_seconds(profile, chunk) for chunk in batch.prefill_chunks
        )
    return rest / batch.clock_share, prefill / batch.clock_share


def step_seconds(
    profile: Profile,
    ranks: Sequence[RankBatch],
    *,
    num_speculative_tokens: int = 0,
    target_balance: float = 1.0,
    draft_balance: float = 1.0,
    eplb_copy_s: float = 0.0,
) -> StepTime:
    """Simulated duration of one lockstep step of a DP group running ``ranks``."""
    d = profile.decode
    decoding = any(batch.decode_requests for batch in ranks)
    slowest = 0.0
    slowest_rest = 0.0
    slowest_prefill = 0.0
    for batch in ranks:
        rest, prefill = _rank_seconds(profile, batch, decoding)
        if rest + prefill > slowest:
            slowest, slowest_rest, slowest_prefill = rest + prefill, rest, prefill
    if not decoding:
        return StepTime(slowest, 0.0, 0.0, 0.0, slowest_prefill)
    num_ranks = len(ranks)
    # Every MoE layer's all-to-all waits for the slowest GPU's expert work: one throttled GPU
    # slows the whole group's MoE (the study's lesson: one slow rank sets the group's step).
    slowest_clock = min(batch.clock_share for batch in ranks)
    mean_tokens = sum(batch.decode_query_tokens for batch in ranks) / num_ranks
    moe = (
        d.moe_fixed_s
        + d.moe_per_token_s * mean_tokens * d.reference_balance / max(target_balance, 1e-6)
    ) / slowest_clock
    draft = 0.0
    if num_speculative_tokens:
        mean_requests = sum(batch.decode_requests for batch in ranks) / num_ranks
        draft = (
            num_speculative_tokens
            * (
                d.draft_fixed_s
                + d.draft_per_token_s
                * mean_requests
                * d.reference_balance
                / max(draft_balance, 1e-6)
            )
            / slowest_clock
        )
    total = slowest + moe + draft + eplb_copy_s
    return StepTime(total, moe, slowest_rest, draft, slowest_prefill, eplb_copy_s)


def api_server_ready(
    frontend: FrontendProfile, now: float, tokenizer_free_at: float, prompt_tokens: int | None
) -> tuple[float, float]:
    """When a request that arrived at ``now`` reaches its engine core's queue, and when the API
    server's one tokenizing thread is free again: ``prompt_tokens`` of text to tokenize (None:
    the prompt came as ids) wait for the thread behind the prompts already on it."""
    if prompt_tokens is None or not frontend.tokenize_per_token_s:
        return now + frontend.request_s, tokenizer_free_at
    tokenized = max(now, tokenizer_free_at) + prompt_tokens * frontend.tokenize_per_token_s
    return tokenized + frontend.request_s, tokenized


def expected_tokens_per_step(num_speculative_tokens: int, acceptance_rate: float) -> float:
    """Mean tokens a request emits per step with MTP: 1 + sum over positions of a^i."""
    return 1.0 + sum(acceptance_rate**i for i in range(1, num_speculative_tokens + 1))


def expert_copy_seconds(profile: Profile, experts: int) -> float:
    """NVLink time for one GPU to receive ``experts`` routed experts' weights."""
    return experts * profile.decode.expert_bytes / profile.nvlink.bandwidth_bytes_per_s


def switch_copy_seconds(profile: Profile, previous: Placement, new: Placement) -> np.ndarray:
    """Each layer's copy time in a switch from ``previous`` to ``new``, ``[layers]``: the most
    experts any rank receives in that layer (they arrive over its own links in parallel)."""
    largest: np.ndarray = moves_per_rank(previous, new).max(axis=1)
    return largest * (profile.decode.expert_bytes / profile.nvlink.bandwidth_bytes_per_s)
