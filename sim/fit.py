"""Fitting a performance profile to step times measured on real engines.

Pure: measured samples in, profile constants out. ``baton bench gpu --step profile`` measures a
real vLLM engine's prefill and decode times (from its own histograms, one shape at a time) and
its NIXL pulls; this module fits the performance model's constants (``baton.core.perf``) to them by
non-negative least squares on relative error (a short step counts as much as a long one), over
the median of each shape's repeats, and reports each sample's error under the fit.

What one GPU running the whole model can and cannot tell apart: a prefill step's fixed cost, its
cost per token and per token of attended context; a decode step's fixed cost, its cost per query
token and per (context x query) token. With every expert on the one GPU there is no expert
imbalance and no all-to-all, so the split of a decode step between the MoE and the rest is not
observable: the fitted profile splits each decode term in the proportions of the profile it
starts from (``base``), with ``reference_balance`` 1 (one rank holds every expert).
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from baton.core.perf import (
    RankBatch,
    lone_prefill_chunks,
    lone_prefill_seconds,
    step_seconds,
)
from baton.core.profile import DecodeProfile, NVLinkProfile, PrefillProfile, Profile

__all__ = [
    "DecodeSample",
    "HandoffSample",
    "PrefillSample",
    "Residual",
    "decode_seconds",
    "fit_profile",
    "residuals",
]


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One request's prefill, alone on the engine: ``new_tokens`` computed on ``context_tokens``
    served from the prefix cache, in ``seconds`` (scheduled to first token)."""

    new_tokens: int
    context_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class DecodeSample:
    """``batch`` requests decoding together at a mean context of ``context_tokens``: a mean
    ``seconds`` between tokens (one token a step, no draft)."""

    batch: int
    context_tokens: float
    seconds: float


@dataclass(frozen=True, slots=True)
class HandoffSample:
    """One NIXL pull of ``bytes`` of KV by a decode engine, in ``seconds``."""

    bytes: float
    seconds: float


@dataclass(frozen=True, slots=True)
class Residual:
    kind: str
    shape: str
    measured_s: float
    modelled_s: float

    @property
    def error(self) -> float:
        return self.modelled_s / self.measured_s - 1


S = TypeVar("S", PrefillSample, DecodeSample, HandoffSample)


def decode_seconds(profile: Profile, sample: DecodeSample) -> float:
    """The simulator's step time for a one-rank decode batch with no draft (balance 1)."""
    batch = RankBatch(
        decode_requests=sample.batch,
        decode_query_tokens=sample.batch,
        decode_context_query_product=sample.batch * sample.context_tokens,
    )
    return step_seconds(profile, [batch]).total_s


def _nnls(rows: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative error, exact for the few terms fitted here: the
    best unconstrained fit over every subset of the terms, keeping those with no negative one."""
    weights = 1 / seconds
    a = rows * weights[:, None]
    b = seconds * weights
    terms = rows.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for size in range(1, terms + 1):
        for subset in itertools.combinations(range(terms), size):
            solution, *_ = np.linalg.lstsq(a[:, subset], b, rcond=None)
            if (solution < 0).any():
                continue
            full = np.zeros(terms)
            full[list(subset)] = solution
            cost = float(np.sum((a @ full - b) ** 2))
            if best is None or cost < best[0]:
                best = (cost, full)
    if best is None:
        raise ValueError("no non-negative fit")
    return best[1]


def _medians(samples: Sequence[S], shape: Callable[[S], tuple[float, ...]]) -> list[S]:
    """One sample a shape, its time the median of the shape's repeats."""
    repeats: dict[tuple[float, ...], list[S]] = {}
    for sample in samples:
        repeats.setdefault(shape(sample), []).append(sample)
    return [
        dataclasses.replace(group[0], seconds=statistics.median(s.seconds for s in group))
        for group in repeats.values()
    ]


def _need(samples: Sequence[object], count: int, what: str) -> None:
    if len(samples) < count:
        raise ValueError(f"{what}: {len(samples)} samples; the fit needs at least {count}")


def fit_profile(
    base: Profile,
    *,
    prefill: Sequence[PrefillSample],
    decode: Sequence[DecodeSample],
    handoff: Sequence[HandoffSample],
    chunk_tokens: int,
    model: str,
    hardware: str,
    kv_bytes_per_token: int,
    kv_cache_bytes: float,
    expert_bytes: float,
) -> Profile:
    """``base`` with its prefill, decode and NVLink constants fitted to the samples (the KV
    sizes, the expert's bytes and the names as given; no draft)."""
    # repeats of a shape are fitted as their median: a first pull's registration or a neighbour's
    # burst on a shared GPU moves one repeat, not the fit
    prefill = _medians(prefill, lambda s: (s.new_tokens, s.context_tokens))
    decode = _medians(decode, lambda s: (s.batch, s.context_tokens))
    handoff = _medians(handoff, lambda s: (s.bytes,))
    _need(prefill, 3, "prefill")
    _need(decode, 3, "decode")
    _need(handoff, 2, "handoff")
    rows = []
    for sample in prefill:
        chunks = lone_prefill_chunks(sample.new_tokens, sample.context_tokens, chunk_tokens)
        rows.append(
            [
                len(chunks),
                sample.new_tokens,
                sum(c.new_tokens * (c.context_tokens + c.new_tokens / 2) for c in chunks),
                sum(c.context_tokens for c in chunks),
            ]
        )
    overhead, per_token, per_context, context_read = _nnls(
        np.array(rows, dtype=float), np.array([s.seconds for s in prefill])
    )
    fixed, per_query, attention = _nnls(
        np.array([[1, s.batch, s.batch * s.context_tokens] for s in decode], dtype=float),
        np.array([s.seconds for s in decode]),
    )
    latency, per_byte = _nnls(
        np.array([[1, s.bytes] for s in handoff], dtype=float),
        np.array([s.seconds for s in handoff]),
    )
    if per_byte <= 0:
        raise ValueError(
            "handoff: the pulls took no longer for more bytes; measure pulls of sizes further apart"
        )
    d = base.decode
    moe_fixed_share = d.moe_fixed_s / (d.moe_fixed_s + d.rest_fixed_s)
    moe_token_share = d.moe_per_token_s / (d.moe_per_token_s + d.rest_per_token_s)
    return Profile(
        model=model,
        hardware=hardware,
        kv_bytes_per_token=kv_bytes_per_token,
        kv_cache_bytes_per_gpu=kv_cache_bytes,
        mean_output_tokens=base.mean_output_tokens,
        prefill=PrefillProfile(
            step_overhead_s=float(overhead),
            per_token_s=float(per_token),
            per_token_context_s=float(per_context),
            context_read_per_token_s=float(context_read),
            max_num_batched_tokens=chunk_tokens,
        ),
        decode=DecodeProfile(
            moe_fixed_s=float(fixed * moe_fixed_share),
            moe_per_token_s=float(per_query * moe_token_share),
            rest_fixed_s=float(fixed * (1 - moe_fixed_share)),
            rest_per_token_s=float(per_query * (1 - moe_token_share)),
            attention_per_context_token_s=float(attention),
            reference_balance=1.0,
            draft_fixed_s=0.0,
            draft_per_token_s=0.0,
            acceptance_rate=d.acceptance_rate,
            expert_bytes=expert_bytes,
        ),
        nvlink=NVLinkProfile(
            bandwidth_bytes_per_s=1 / per_byte
            if per_byte > 0
            else base.nvlink.bandwidth_bytes_per_s,
            latency_s=float(latency),
        ),
    )


def residuals(
    profile: Profile,
    *,
    prefill: Sequence[PrefillSample],
    decode: Sequence[DecodeSample],
    handoff: Sequence[HandoffSample],
) -> list[Residual]:
    """Each sample's measured time against the profile's."""
    nvlink = profile.nvlink
    return [
        *(
            Residual(
                "prefill",
                f"{s.new_tokens} on {s.context_tokens}",
                s.seconds,
                lone_prefill_seconds(profile, s.new_tokens, s.context_tokens),
            )
            for s in prefill
        ),
        *(
            Residual(
                "decode",
                f"batch {s.batch} at {s.context_tokens:.0f}",
                s.seconds,
                decode_seconds(profile, s),
            )
            for s in decode
        ),
        *(
            Residual(
                "handoff",
                f"{s.bytes / 2**20:.1f} MiB",
                s.seconds,
                nvlink.latency_s + s.bytes / nvlink.bandwidth_bytes_per_s,
            )
            for s in handoff
        ),
    ]
