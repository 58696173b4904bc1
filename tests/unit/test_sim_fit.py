"""Fitting the performance model to measured step times (sim/fit.py): samples the model itself
produced give its constants back; noisy ones give a fit whose error is the noise's size."""

from __future__ import annotations

import random

import pytest

from baton.core.perf import lone_prefill_chunks, lone_prefill_seconds
from baton.core.profile import Profile, load_profile
from sim.fit import (
    DecodeSample,
    HandoffSample,
    PrefillSample,
    decode_seconds,
    fit_profile,
    residuals,
)

CHUNK = 8192
KV_BYTES = 6912


def _truth() -> Profile:
    base = load_profile()
    return base.model_copy(
        update={
            "decode": base.decode.model_copy(update={"reference_balance": 1.0}),
            # a chunk reading its context: 0.3 ms per 65,536 tokens, as a Hopper's does
            "prefill": base.prefill.model_copy(update={"context_read_per_token_s": 5e-9}),
        }
    )


def _samples(
    profile: Profile, noise: float = 0.0, seed: int = 0
) -> tuple[list[PrefillSample], list[DecodeSample], list[HandoffSample]]:
    draw = random.Random(seed)

    def jitter(seconds: float) -> float:
        return seconds * (1 + draw.uniform(-noise, noise))

    shapes = [
        (512, 0),
        (2048, 0),
        (8192, 0),
        (32768, 0),
        (1024, 16384),
        (2048, 65536),
        (8192, 98304),
    ]
    prefill = [PrefillSample(n, c, jitter(lone_prefill_seconds(profile, n, c))) for n, c in shapes]
    decode = [
        DecodeSample(b, c, jitter(decode_seconds(profile, DecodeSample(b, c, 0.0))))
        for b, c in [(1, 1024), (16, 1024), (128, 1024), (16, 32768), (64, 8192)]
    ]
    nvlink = profile.nvlink
    handoff = [
        HandoffSample(size, jitter(nvlink.latency_s + size / nvlink.bandwidth_bytes_per_s))
        for size in (7e6, 56e6, 220e6)
    ]
    return prefill, decode, handoff


def _fit(
    profile: Profile,
    prefill: list[PrefillSample],
    decode: list[DecodeSample],
    handoff: list[HandoffSample],
) -> Profile:
    return fit_profile(
        profile,
        prefill=prefill,
        decode=decode,
        handoff=handoff,
        chunk_tokens=CHUNK,
        model="test",
        hardware="H100",
        kv_bytes_per_token=KV_BYTES,
        kv_cache_bytes=8 * 2**30,
        expert_bytes=17.3e6,
    )


def test_a_long_prompt_is_prefilled_in_chunks_of_the_batch_budget_on_the_growing_context() -> None:
    chunks = lone_prefill_chunks(20000, 1000, CHUNK)
    assert [(c.new_tokens, c.context_tokens) for c in chunks] == [
        (8192, 1000),
        (8192, 9192),
        (3616, 17384),
    ]


def test_samples_the_model_produced_give_its_constants_back() -> None:
    truth = _truth()
    fitted = _fit(truth, *_samples(truth))
    for field in (
        "step_overhead_s",
        "per_token_s",
        "per_token_context_s",
        "context_read_per_token_s",
    ):
        assert getattr(fitted.prefill, field) == pytest.approx(getattr(truth.prefill, field))
    d, t = fitted.decode, truth.decode
    assert d.moe_fixed_s + d.rest_fixed_s == pytest.approx(t.moe_fixed_s + t.rest_fixed_s)
    assert d.moe_per_token_s + d.rest_per_token_s == pytest.approx(
        t.moe_per_token_s + t.rest_per_token_s
    )
    assert d.attention_per_context_token_s == pytest.approx(t.attention_per_context_token_s)
    assert fitted.nvlink.bandwidth_bytes_per_s == pytest.approx(truth.nvlink.bandwidth_bytes_per_s)
    assert fitted.nvlink.latency_s == pytest.approx(truth.nvlink.latency_s)
    # what one GPU cannot tell apart is split as the starting profile splits it
    assert d.moe_fixed_s / d.rest_fixed_s == pytest.approx(t.moe_fixed_s / t.rest_fixed_s)
    assert (d.reference_balance, d.draft_fixed_s, d.draft_per_token_s) == (1.0, 0.0, 0.0)
    assert (fitted.kv_bytes_per_token, fitted.prefill.max_num_batched_tokens) == (KV_BYTES, CHUNK)


def test_a_noisy_measurement_is_fitted_within_the_noise() -> None:
    truth = _truth()
    prefill, decode, handoff = _samples(truth, noise=0.03, seed=7)
    fitted = _fit(truth, prefill, decode, handoff)
    errors = residuals(fitted, prefill=prefill, decode=decode, handoff=handoff)
    assert len(errors) == len(prefill) + len(decode) + len(handoff)
    assert max(abs(r.error) for r in errors) < 0.06
    assert {r.kind for r in errors} == {"prefill", "decode", "handoff"}


def test_no_term_of_the_fit_is_negative() -> None:
    # decode steps that do not grow with context: the attention term is held at 0, not made
    # negative to follow the noise
    flat = [DecodeSample(b, c, 0.004 + 2e-5 * b) for b in (1, 8, 64) for c in (1024, 32768)]
    flat[-1] = DecodeSample(64, 32768, (0.004 + 2e-5 * 64) * 0.97)
    prefill, _, handoff = _samples(_truth())
    fitted = _fit(_truth(), prefill, flat, handoff)
    assert fitted.decode.attention_per_context_token_s == 0.0
    assert fitted.decode.rest_per_token_s > 0


def test_too_few_samples_are_refused_with_what_is_missing() -> None:
    prefill, decode, handoff = _samples(_truth())
    with pytest.raises(ValueError, match="decode: 2 samples; the fit needs at least 3"):
        _fit(_truth(), prefill, decode[:2], handoff)


def test_a_slow_first_repeat_of_a_shape_does_not_move_the_fit() -> None:
    truth = _truth()
    prefill, decode, handoff = _samples(truth)
    # each size: a first pull six times as slow (NIXL registering memory), two as modelled
    repeated = [
        sample
        for pull in handoff
        for sample in (HandoffSample(pull.bytes, pull.seconds * 6), pull, pull)
    ]
    fitted = _fit(truth, prefill, decode, repeated)
    assert fitted.nvlink.bandwidth_bytes_per_s == pytest.approx(truth.nvlink.bandwidth_bytes_per_s)
    # every repeat still gets its residual
    errors = residuals(fitted, prefill=prefill, decode=decode, handoff=repeated)
    assert sum(r.kind == "handoff" for r in errors) == 9
