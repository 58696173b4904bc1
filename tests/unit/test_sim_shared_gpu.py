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
from sim.shared_gpu import SharedGpu, step_gpu_part, step_piece

pytestmark = pytest.mark.unit


def test_a_step_alone_runs_at_full_speed_and_beside_three_peers_at_a_quarter() -> None:
    assert step_piece(0.004, 0, 0.01) == (0.004, 0.004)  # a decode step: one piece
    assert step_piece(0.2, 3, 0.01) == pytest.approx((0.01, 0.0025))
    # the last piece of a step beside one peer
    assert step_piece(0.001, 1, 0.01) == pytest.approx((0.002, 0.001))


def test_an_engine_counts_the_peers_whose_step_has_not_ended(tmp_path: Path) -> None:
    mine, peer, idle = SharedGpu(tmp_path), SharedGpu(tmp_path), SharedGpu(tmp_path)
    try:
        now = time.monotonic()
        assert mine.peers_busy(now) == 0  # every file says 0.0: nobody is stepping
        peer.busy_until(now + 5)
        idle.busy_until(now - 5)
        assert mine.peers_busy(now) == 1
        assert peer.peers_busy(now) == 0  # its own step is not a peer's
        peer.close()  # an engine that stopped leaves the GPU
        assert not peer.path.exists()
        assert mine.peers_busy(now + 2) == 0  # listed again after a second
    finally:
        mine.close()
        idle.close()


def test_only_the_gpu_part_of_a_step_is_shared() -> None:
    # half the step is the host's: beside one peer the step takes 1.5x, beside three 2.5x
    assert step_piece(0.2, 1, 0.01, 0.5) == pytest.approx((0.01, 0.01 / 1.5))
    assert step_piece(0.001, 3, 0.01, 0.5) == pytest.approx((0.0025, 0.001))


def test_a_steps_gpu_part_weighs_its_prefill_and_its_decode_by_their_time() -> None:
    shares = SharedGpuProfile(prefill_gpu_part=0.8, decode_gpu_part=0.4)
    mixed = StepTime(total_s=0.04, moe_s=0.005, rest_s=0.005, draft_s=0.0, prefill_s=0.03)
    assert step_gpu_part(shares, mixed) == pytest.approx((0.03 * 0.8 + 0.01 * 0.4) / 0.04)
    assert step_gpu_part(SharedGpuProfile(), mixed) == 1.0  # the default: all GPU work


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


def test_prefills_whose_steps_are_half_host_work_each_take_about_one_and_a_half_times(
    tmp_path: Path,
) -> None:
    half = SharedGpuProfile(prefill_gpu_part=0.5)
    [alone] = _modelled_prefills(tmp_path / "alone", 1, half)
    both = _modelled_prefills(tmp_path / "both", 2, half)
    for modelled in both:
        assert 1.25 * alone < modelled < 1.7 * alone, (alone, both)
    assert sum(both) == pytest.approx(3 * alone, rel=0.2)
