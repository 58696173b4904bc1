"""The simulated engine: DP ranks with continuous batching, stepping in wide-EP lockstep.

A :class:`DPGroup` is one vLLM DP group (a DEP2 prefill instance, a DEP32 decode group). Each
step it asks every rank for a batch (:class:`DPRank.schedule`), asks the performance model how
long the step takes (the slowest rank sets the pace, MoE time follows expert balance), sleeps
that long in simulated time, then applies the step (tokens emitted, prompts advanced).

Time: simulated seconds = wall seconds / ``time_scale``. Every figure the engine reports
(metrics, usage timings) is in simulated seconds. If the host falls behind, steps stretch:
``overruns`` counts the steps that ended late and ``lag_s`` adds up by how much (wall seconds),
so a benchmark can tell whether the simulator kept its timeline. Past a bound the debt is given
up (``lag_given_up_s``): the clients see the delay, but inter-token latencies, which describe
the modelled engine's steps, leave it out (a busy host running the simulator is not a slow
engine; the straggler watch reads them).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

from baton.core.perf import PrefillChunk, RankBatch, StepTime, step_seconds
from baton.core.sim_tokenizer import BYTES_PER_TOKEN, word_for
from sim.config import EngineConfig
from sim.kv_publisher import KVEventPublisher
from sim.kvcache import PrefixCache, chain_hash
from sim.moe import MoERuntime, MoEStep
from sim.request import FinishReason, RequestFailed, RequestState, SimRequest
from sim.shared_gpu import (
    PIECE_S,
    STEP_GAP_S,
    SharedGpu,
    prefill_part,
    step_piece,
    step_stretch,
)
from sim.stats import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, Buckets

__all__ = ["DPGroup", "DPRank", "SimClock", "VirtualClock"]

log = logging.getLogger("baton.sim.engine")
_MAX_LAG_S = 0.05


class VirtualClock:
    """Simulated time advanced by hand: for offline runs (calibration, benchmarks)."""

    time_scale = 0.0

    def __init__(self) -> None:
        self.time = 0.0

    def now(self) -> float:
        return self.time


class SimClock:
    """Simulated time for one process: wall time divided by the time scale."""

    def __init__(self, time_scale: float) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.time_scale = time_scale
        self._loop = asyncio.get_running_loop()
        self._origin = self._loop.time()

    def now(self) -> float:
        return (self._loop.time() - self._origin) / self.time_scale

    def wall_deadline(self, sim_time: float) -> float:
        return self._origin + sim_time * self.time_scale

    async def sleep(self, sim_seconds: float) -> None:
        await asyncio.sleep(max(0.0, sim_seconds * self.time_scale))


class DPRank:
    """One DP rank: a waiting queue, running requests bounded by max_num_seqs, its KV cache."""

    def __init__(self, dp_rank: int, config: EngineConfig, rng: random.Random) -> None:
        self.dp_rank = dp_rank
        self.config = config
        self.cache = PrefixCache(
            config.kv_capacity_blocks,
            config.block_size,
            journal=config.kv_events.publishes,
        )
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.loading: list[SimRequest] = []  # pulling KV from a prefill engine
        self.rng = rng
        self.stalled_until = 0.0
        # Fault: the rank's GPU runs at this share of its nominal SM clock until clock_until
        # (simulated seconds); the DCGM exporter reports it
        self.clock_share = 1.0
        self.clock_until = 0.0
        # Fault: the rank's GPU's NVLinks replay at this rate (errors a simulated second) from
        # link_errors_from until link_errors_until, on top of link_errors_before
        self.link_error_rate = 0.0
        self.link_errors_from = 0.0
        self.link_errors_until = 0.0
        self.link_errors_before = 0.0
        # Counters with vLLM's meaning, read by the metrics collector.
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prompt_tokens_by_source = {
            "local_compute": 0,
            "local_cache_hit": 0,
            "external_kv_transfer": 0,
        }
        self.success = {reason.value: 0 for reason in FinishReason}
        self.preemptions = 0
        self.ttft = Buckets(TTFT_BUCKETS)
        self.itl = Buckets(ITL_BUCKETS)
        self.e2e = Buckets(E2E_BUCKETS)
        self.queue_time = Buckets(E2E_BUCKETS)
        self.prefill_time = Buckets(E2E_BUCKETS)  # scheduled to first token, as vLLM times it
        self._batch: list[tuple[SimRequest, int]] = []  # (request, tokens) scheduled this step

    @property
    def num_requests(self) -> int:
        """Requests this rank owns in any state: what vLLM's internal LB balances."""
        return len(self.waiting) + len(self.running) + len(self.loading)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now: float, speculative_tokens: int) -> RankBatch:
        """Choose this step's work: decode tokens for running requests, then prefill chunks."""
        budget = self.config.max_num_batched_tokens
        self._batch = []
        decode_requests = 0
        query_tokens = 0
        context_product = 0.0
        chunks: list[PrefillChunk] = []
        for request in self.running:
            if not request.prefill_done:
                continue
            query = 1 + speculative_tokens
            context = request.prompt_tokens + request.output_tokens
            if request.allocation is None or not self.cache.grow(
                request.allocation, context + query
            ):
                self.preemptions += 1  # no room to grow this step; it waits
                continue
            self._batch.append((request, 0))
            decode_requests += 1
            query_tokens += query
            context_product += context * query
            budget -= query
        prompts: list[tuple[SimRequest, int]] = []  # (request, prompt tokens this step)
        for request in self.running:
            if request.prefill_done or budget <= 0:
                continue
            if request.scheduled_at is None:  # its KV pulled: the prompt's last token again
                request.scheduled_at = now
            chunk = min(request.prompt_tokens - request.num_computed, budget)
            prompts.append((request, chunk))
            budget -= chunk
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            allocation = self.cache.allocate(request.hashes, request.prompt_tokens)
            if allocation is None:
                break  # KV full: the head of the queue waits (reason "capacity")
            self.waiting.popleft()
            request.allocation = allocation
            request.num_computed = allocation.cached_tokens
            request.cached_tokens = allocation.cached_tokens
            request.state = RequestState.RUNNING
            request.scheduled_at = now
            self.running.append(request)
            chunk = min(request.prompt_tokens - request.num_computed, budget)
            prompts.append((request, chunk))
            budget -= chunk
        for request, chunk in prompts:
            self._batch.append((request, chunk))
            if chunk == 1:  # a one-token query runs as a decode does (vLLM's decode threshold)
                decode_requests += 1
                query_tokens += 1
                context_product += request.num_computed
            else:
                chunks.append(PrefillChunk(chunk, request.num_computed))
        return RankBatch(
            decode_requests, query_tokens, context_product, tuple(chunks), self.clock_at(now)
        )

    def clock_at(self, now: float) -> float:
        """The share of its nominal SM clock the rank's GPU runs at, at ``now``."""
        return self.clock_share if now < self.clock_until else 1.0

    def link_errors_at(self, now: float) -> float:
        """The NVLink errors the rank's GPU has logged by ``now`` (a counter)."""
        span = max(0.0, min(now, self.link_errors_until) - self.link_errors_from)
        return self.link_errors_before + self.link_error_rate * span

    def fail_links(self, now: float, rate: float, seconds: float) -> None:
        """From ``now``, ``rate`` NVLink errors a second for ``seconds``."""
        self.link_errors_before = self.link_errors_at(now)
        self.link_error_rate, self.link_errors_from = rate, now
        self.link_errors_until = now + seconds

    def apply(
        self,
        now: float,
        speculative_tokens: int,
        acceptance_rate: float,
        lag_given_up_s: float = 0.0,
    ) -> list[SimRequest]:
        """Advance this step's requests; returns those that finished. ``lag_given_up_s``: the
        group's host lag given up so far, left out of inter-token latencies."""
        finished: list[SimRequest] = []
        for request, chunk in self._batch:
            if request.finished:
                continue  # aborted while the step ran
            if chunk:
                request.num_computed += chunk
                assert request.allocation is not None  # scheduled prompt chunks hold KV
                self.cache.register(
                    request.allocation, request.hashes, request.num_computed, request.prompt
                )
                if not request.prefill_done:
                    continue
                self.count_prompt(request)
                emitted = 1  # sampling at the end of prefill yields the first token
            else:
                emitted = 1 + _accepted(speculative_tokens, acceptance_rate, self.rng)
            if request.first_token_at is None:
                self.ttft.observe(now - request.arrival)
                if request.scheduled_at is not None:
                    self.prefill_time.observe(now - request.scheduled_at)
            elif request.last_token_at is not None:
                lag = lag_given_up_s - request.lag_given_up_at_last_token
                self.itl.observe(now - request.last_token_at - lag)
            request.lag_given_up_at_last_token = lag_given_up_s
            self.generation_tokens -= request.output_tokens
            done = _emit(request, emitted, now)
            self.generation_tokens += request.output_tokens
            self._cache_reply(request)
            if done:
                finished.append(request)
        self._batch = []
        for request in finished:
            self.running.remove(request)
        return finished

    def _cache_reply(self, request: SimRequest) -> None:
        """Hash the full blocks the reply completed, so the next turn's prompt hits them.

        The sequence is the prompt's bytes followed by the reply's text; KV exists for every
        token but the last one emitted.
        """
        span = self.config.block_size * BYTES_PER_TOKEN
        prompt_length = len(request.prompt)
        known = len(request.hashes)
        complete = (prompt_length + len(request.text) - BYTES_PER_TOKEN) // span
        for index in range(known, complete):
            start, end = index * span, (index + 1) * span
            if start >= prompt_length:
                block = request.text[start - prompt_length : end - prompt_length].encode()
            else:
                block = request.prompt[start:] + request.text[: end - prompt_length].encode()
            request.hashes.append(chain_hash(request.hashes[-1] if request.hashes else None, block))
        if request.allocation is not None and complete > known:
            computed = request.prompt_tokens + request.output_tokens - 1
            # the reply's tokens, for a journal's events only: a copy of a long prompt a block
            sequence = request.prompt + request.text.encode() if self.cache.journaling else b""
            self.cache.register(request.allocation, request.hashes, computed, sequence)

    def count_prompt(self, request: SimRequest) -> None:
        self.prompt_tokens += request.prompt_tokens
        external = request.external_tokens
        cached = request.cached_tokens - external
        self.prompt_tokens_by_source["external_kv_transfer"] += external
        self.prompt_tokens_by_source["local_cache_hit"] += cached
        self.prompt_tokens_by_source["local_compute"] += (
            request.prompt_tokens - request.cached_tokens
        )


def _accepted(speculative_tokens: int, acceptance_rate: float, rng: random.Random) -> int:
    accepted = 0
    while accepted < speculative_tokens and rng.random() < acceptance_rate:
        accepted += 1
    return accepted


def _emit(request: SimRequest, count: int, now: float) -> bool:
    """Append up to ``count`` tokens; True when the request finished."""
    if request.first_token_at is None:
        request.first_token_at = now
    request.last_token_at = now
    for _ in range(count):
        index = len(request.words)
        word = word_for(request.seed, request.digest, index)
        request.words.append(word)
        request.text += word
        if request.stop:
            tail = request.text[-(len(word) + max(len(s) for s in request.stop)) :]
            hit = next((s for s in request.stop if s in tail), None)
            if hit is not None:
                request.text = request.text[: request.text.rfind(hit)]
                request.finish_reason, request.stop_reason = FinishReason.STOP, hit
                break
        produced = len(request.words)
        if produced >= request.max_tokens:
            request.finish_reason = FinishReason.LENGTH
            break
        if request.eos_after is not None and produced >= max(request.eos_after, request.min_tokens):
            request.finish_reason = FinishReason.STOP
            break
    request.notify()
    return request.finish_reason is not None


class DPGroup:
    """One DP group stepping in lockstep; its ranks are shared by one or more API servers."""

    def __init__(
        self, config: EngineConfig, clock: SimClock | VirtualClock, ranks: Iterable[int]
    ) -> None:
        self.config = config
        self.clock = clock
        self.ranks = {
            rank: DPRank(rank, config, random.Random(config.seed * 1_000 + rank)) for rank in ranks
        }
        self.moe = MoERuntime(config) if config.enable_expert_parallel else None
        self.steps = 0
        self.modelled_s = 0.0  # the steps' durations by the performance model, summed
        self.overruns = 0
        self.lag_s = 0.0
        self.lag_given_up_s = 0.0  # simulated seconds the timeline skipped to catch up
        self.dead = False
        # Fault: every step takes ``slow_factor`` times as long until ``slow_until``.
        self.slow_factor = 1.0
        self.slow_until = 0.0
        self.last_step: StepTime | None = None
        self.on_finished: list[Callable[[SimRequest], None]] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.gpu: SharedGpu | None = None  # the GPU this engine shares with others (served)
        self.kv_publishers: dict[int, KVEventPublisher] = {}  # by DP rank (served)

    def start(self) -> None:
        if self.config.shared_gpu is not None:
            self.gpu = SharedGpu(Path(self.config.shared_gpu))
        if self.config.kv_events.publishes:
            self.kv_publishers = {
                rank: KVEventPublisher(self.config.kv_events, rank) for rank in self.ranks
            }
        self._task = asyncio.get_running_loop().create_task(self._run(), name="dp-group")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.gpu is not None:
            self.gpu.close()
            self.gpu = None
        for publisher in self.kv_publishers.values():
            publisher.close()
        self.kv_publishers = {}

    def publish_kv_events(self) -> None:
        """Each rank's KV events since the last publish, one batch a rank, as vLLM's engine
        publishes after each step."""
        for rank, publisher in self.kv_publishers.items():
            publisher.publish(self.ranks[rank].cache.take_events())

    def least_loaded_rank(self, candidates: Iterable[int]) -> int:
        """vLLM's internal LB when no rank is named: fewest waiting + running, lowest index."""
        return min(candidates, key=lambda rank: (self.ranks[rank].num_requests, rank))

    def submit(self, request: SimRequest, dp_rank: int) -> None:
        if self.dead:
            raise RequestFailed(
                500, "EngineCore encountered an issue. See stack trace for the root cause."
            )
        request.dp_rank = dp_rank
        request.queued_at = self.clock.now()
        rank = self.ranks[dp_rank]
        if request.state is RequestState.WAITING_FOR_REMOTE_KVS:
            rank.loading.append(request)
        else:
            rank.waiting.append(request)
        self._wakeup.set()

    def admit_loaded(self, request: SimRequest) -> None:
        """KV arrived from the prefill engine: from the next step, the request computes its
        prompt's last token again to sample the first (vLLM's scheduler rewinds a full hit by
        one token), then decodes."""
        rank = self.ranks[request.dp_rank]
        rank.loading.remove(request)
        request.state = RequestState.RUNNING
        request.num_computed = request.prompt_tokens - 1
        rank.running.append(request)
        self._wakeup.set()

    def requeue_for_recompute(self, request: SimRequest) -> None:
        """A failed KV pull under ``recompute``: prefill locally from the cached prefix."""
        rank = self.ranks[request.dp_rank]
        rank.loading.remove(request)
        if request.allocation is not None:
            rank.cache.free(request.allocation)
        request.allocation = None
        request.external_tokens = 0
        request.state = RequestState.WAITING
        rank.waiting.append(request)
        self._wakeup.set()

    def finish(
        self, request: SimRequest, reason: FinishReason, failure: RequestFailed | None = None
    ) -> None:
        """End a request outside the step (abort, failure): frees its KV, wakes its reader."""
        if request.finished:
            return
        rank = self.ranks[request.dp_rank]
        for queue in (rank.waiting, rank.running, rank.loading):
            if request in queue:
                queue.remove(request)
        request.finish_reason = reason
        request.failure = failure
        self._close(request)

    def _close(self, request: SimRequest) -> None:
        rank = self.ranks[request.dp_rank]
        request.state = RequestState.FINISHED
        request.finished_at = self.clock.now()
        assert request.finish_reason is not None  # every path to a close sets why
        # vLLM's API server drops a request its client left before the engine's statistics see
        # it finish: a disconnect counts in no request_success and no latency histogram.
        if request.finish_reason is not FinishReason.ABORT:
            rank.success[request.finish_reason.value] += 1
            rank.e2e.observe(request.finished_at - request.arrival)
            if request.scheduled_at is not None and request.queued_at is not None:
                rank.queue_time.observe(request.scheduled_at - request.queued_at)
        for callback in self.on_finished:
            callback(request)
        # A request held for a remote decode keeps its blocks; the NIXL side frees them.
        if request.allocation is not None and not request.kv_block_ids:
            rank.cache.free(request.allocation)
        request.notify()

    def kill(self) -> None:
        """Fault: the engine dies; every request fails as vLLM's do on EngineDeadError."""
        self.dead = True
        failure = RequestFailed(
            500, "EngineCore encountered an issue. See stack trace for the root cause."
        )
        for rank in self.ranks.values():
            for request in [*rank.waiting, *rank.running, *rank.loading]:
                self.finish(request, FinishReason.ERROR, failure)
        self._wakeup.set()

    @property
    def has_work(self) -> bool:
        return any(rank.has_work for rank in self.ranks.values())

    @property
    def sim_clock(self) -> SimClock:
        """The process's clock: a served engine has one; an offline run steps a virtual one
        by hand and never waits."""
        if not isinstance(self.clock, SimClock):
            raise RuntimeError("an offline engine has no clock to wait on")
        return self.clock

    def begin_step(self, now: float) -> float:
        """Schedule every rank for one step; returns its simulated duration."""
        spec = self.config.speculative.num_speculative_tokens
        batches = [rank.schedule(now, spec) for rank in self.ranks.values()]
        moe = MoEStep(1.0, 1.0, 0.0)
        decode_tokens = sum(batch.decode_query_tokens for batch in batches)
        if self.moe is not None and decode_tokens:
            draft_tokens = spec * sum(batch.decode_requests for batch in batches)
            moe = self.moe.step_balances(decode_tokens, draft_tokens)
        step = step_seconds(
            self.config.profile,
            batches,
            num_speculative_tokens=spec,
            target_balance=moe.target_balance,
            draft_balance=moe.draft_balance,
            eplb_copy_s=moe.copy_s,
        )
        self.last_step = step
        stall = max(rank.stalled_until for rank in self.ranks.values()) - now
        slow = self.slow_factor if now < self.slow_until else 1.0
        return step.total_s * slow + max(0.0, stall)

    def end_step(self, now: float) -> None:
        """Apply the step begun last: tokens emitted, prompts advanced, requests finished."""
        spec = self.config.speculative.num_speculative_tokens
        for rank in self.ranks.values():
            for request in rank.apply(now, spec, self.config.acceptance_rate, self.lag_given_up_s):
                self._close(request)

    async def _run(self) -> None:
        start = self.clock.now()
        while not self.dead:
            if not self.has_work:
                self._wakeup.clear()
                await self._wakeup.wait()
                start = self.clock.now()
                continue
            # Back-to-back steps start at the previous step's end in simulated time, so the
            # host's own work between steps does not stretch the modelled timeline; a host that
            # falls further behind than _MAX_LAG_S gives up the debt (and counts an overrun).
            caught_up = max(start, self.clock.now() - _MAX_LAG_S)
            self.lag_given_up_s += caught_up - start
            start = caught_up
            duration = self.begin_step(start)
            assert self.last_step is not None  # begin_step has set it
            prefill = prefill_part(self.last_step)
            if self.gpu is not None:
                end = await self._share_gpu(self.gpu, start, duration, prefill)
            else:
                end = start + duration
                await self._until(end)
            self.steps += 1
            self.modelled_s += end - start
            self.end_step(end)
            self.publish_kv_events()
            if self.gpu is not None and self.has_work:
                # The next step starts at this one's end in simulated time: peers looking
                # while this host streams tokens and schedules see the GPU still in use.
                self.gpu.busy_until(self.sim_clock.wall_deadline(end) + STEP_GAP_S, prefill)
            start = end

    async def _until(self, end: float) -> None:
        """Sleep until simulated time ``end``; a host already past it counts an overrun."""
        delay = self.sim_clock.wall_deadline(end) - asyncio.get_running_loop().time()
        if delay < 0:
            self.overruns += 1
            self.lag_s -= delay
        await asyncio.sleep(max(0.0, delay))

    async def _share_gpu(
        self, gpu: SharedGpu, start: float, work_s: float, prefill: float
    ) -> float:
        """Run a step of ``work_s`` (its time alone on the GPU), ``prefill`` of it prefill, in
        pieces, each stretched by the peers stepping then; returns when it ends."""
        clock = self.sim_clock
        loop = asyncio.get_running_loop()
        shares = self.config.profile.shared_gpu
        now, left = start, work_s
        piece_s = PIECE_S / clock.time_scale
        while True:
            peers = gpu.peers_busy(loop.time())  # the loop's clock: the peers' too
            stretch = step_stretch(shares, prefill, peers)
            length, done = step_piece(left, stretch, piece_s)
            now, left = now + length, left - done
            # a peer looking now sees this step's end as if the sharing stays as it is
            gpu.busy_until(clock.wall_deadline(now + left * stretch), prefill)
            if left <= 1e-12:
                await self._until(now)
                return now
            await asyncio.sleep(max(0.0, clock.wall_deadline(now) - loop.time()))
