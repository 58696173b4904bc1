"""Engines sharing one GPU's time (``baton sim --shared-gpu``): the rule, the engines' record of
each other's steps, and two engines' steps stretched while both run."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest

from baton.core.perf import StepTime
from baton.core.profile import SharedGpuProfile, load_profile
from sim.config import EngineConfig
from sim.engine import DPGroup, SimClock
from sim.request import SimRequest, make_request
from sim.shared_gpu import SharedGpu, prefill_part, step_piece, step_stretch

pytestmark = pytest.mark.unit


def test_a_step_alone_runs_at_full_speed_and_beside_three_peers_at_a_quarter() -> None:
    even = SharedGpuProfile()
    assert step_stretch(even, 1.0, []) == 1.0
    assert step_piece(0.004, 1.0, 0.01) == (0.004, 0.004)  # a decode step: one piece
    assert step_piece(0.2, step_stretch(even, 1.0, [1.0, 0.0, 0.0]), 0.01) == pytest.approx(
        (0.01, 0.0025)
    )
    # the last piece of a step beside one peer
    assert step_piece(0.001, step_stretch(even, 0.0, [0.0]), 0.01) == pytest.approx((0.002, 0.001))


def test_an_engine_counts_the_peers_whose_step_has_not_ended(tmp_path: Path) -> None:
    mine, peer, idle = SharedGpu(tmp_path), SharedGpu(tmp_path), SharedGpu(tmp_path)
    try:
        now = time.monotonic()
        assert mine.peers_busy(now) == []  # every file says 0.0: nobody is stepping
        peer.busy_until(now + 5, 0.75)
        idle.busy_until(now - 5, 1.0)
        assert mine.peers_busy(now) == [0.75]  # the busy peer's step, three quarters prefill
        assert peer.peers_busy(now) == []  # its own step is not a peer's
        peer.close()  # an engine that stopped leaves the GPU
        assert not peer.path.exists()
        assert mine.peers_busy(now + 2) == []  # listed again after a second
    finally:
        mine.close()
        idle.close()


def test_each_busy_peer_adds_what_its_kind_adds_to_a_step_of_this_kind() -> None:
    # as measured on an H100: a prefill slows beside a prefill and less beside a decode; a
    # decode step, mostly the host's, does not slow
    h100 = SharedGpuProfile(
        prefill_beside_prefill=0.72,
        prefill_beside_decode=0.41,
        decode_beside_prefill=0.0,
        decode_beside_decode=0.0,
    )
    assert step_stretch(h100, 1.0, [1.0]) == pytest.approx(1.72)
    assert step_stretch(h100, 1.0, [1.0, 0.0, 0.0]) == pytest.approx(1 + 0.72 + 2 * 0.41)
    assert step_stretch(h100, 0.0, [1.0, 1.0, 0.0]) == 1.0
    # a step half prefill beside a peer half prefill: each pair weighed by time
    mixed = 0.25 * (0.72 + 0.41)
    assert step_stretch(h100, 0.5, [0.5]) == pytest.approx(1 + mixed)


def test_a_steps_prefill_part_is_its_prefill_time_over_its_whole() -> None:
    mixed = StepTime(total_s=0.04, moe_s=0.005, rest_s=0.005, draft_s=0.0, prefill_s=0.03)
    assert prefill_part(mixed) == pytest.approx(0.75)
    assert prefill_part(StepTime(0.0, 0.0, 0.0, 0.0, 0.0)) == 0.0


def _modelled_prefills(
    directory: Path, engines: int, shared: SharedGpuProfile | None = None
) -> list[float]:
    """Each of ``engines`` one-rank engines on one shared GPU prefills a long prompt, all at
    once: the simulated seconds each one's steps took."""
    profile = load_profile()
    if shared is not None:
        profile = profile.model_copy(update={"shared_gpu": shared})
    base = EngineConfig(model="m", served_model_names=("m",), profile=profile)
    config = replace(base, shared_gpu=str(directory))
    prompt = b"shared gpu " * 30_000  # about 82,000 tokens: ten prefill steps

    async def run() -> list[float]:
        groups = [DPGroup(config, SimClock(time_scale=1.0), range(1)) for _ in range(engines)]
        finished: list[str] = []
        all_done = asyncio.Event()

        def done(request: SimRequest) -> None:
            finished.append(request.external_id)
            if len(finished) == engines:
                all_done.set()

        for group in groups:
            group.on_finished.append(done)
            group.start()
        for index, group in enumerate(groups):
            group.submit(
                make_request(
                    bytes([index]) + prompt,
                    external_id=f"r{index}",
                    max_tokens=1,
                    block_size=16,
                    arrival=0.0,
                ),
                0,
            )
        await asyncio.wait_for(all_done.wait(), timeout=120)
        for group in groups:
            await group.stop()
        assert not any(g.has_work for g in groups)
        return [g.modelled_s for g in groups]

    return asyncio.run(run())


def test_two_engines_prefilling_at_once_each_take_about_twice_as_long(tmp_path: Path) -> None:
    [alone] = _modelled_prefills(tmp_path / "alone", 1)
    both = _modelled_prefills(tmp_path / "both", 2)
    # Each gets half the GPU while both step; whichever finishes first leaves the other
    # alone for its last pieces (a host busy elsewhere delays the pieces, not the shares).
    for modelled in both:
        assert 1.5 * alone < modelled < 2.2 * alone, (alone, both)
    assert sum(both) == pytest.approx(4 * alone, rel=0.2)


def test_prefills_that_each_add_half_to_the_other_each_take_about_one_and_a_half_times(
    tmp_path: Path,
) -> None:
    half = SharedGpuProfile(prefill_beside_prefill=0.5)
    [alone] = _modelled_prefills(tmp_path / "alone", 1, half)
    both = _modelled_prefills(tmp_path / "both", 2, half)
    for modelled in both:
        assert 1.25 * alone < modelled < 1.7 * alone, (alone, both)
    assert sum(both) == pytest.approx(3 * alone, rel=0.2)
