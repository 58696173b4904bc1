"""Which GPU holds back its decode group, and when moving the group off its tray pays. Pure.

Wide-EP decode steps every rank of a DEP32 group together, and every MoE layer waits for the
slowest GPU: one GPU that throttles (heat, a power cap) costs all 32 (the study's unoptimised
DEP32 ran 17.57 ms a step against DEP16's 13.84 ms although its GPU work was faster).

Detection, per window: each GPU's SM clock is the window's median of dcgm-exporter's
``DCGM_FI_DEV_SM_CLOCK`` samples, so that a noisy sample or a short dip does not count. A GPU is
an outlier of its group when its clock is below the group's median both by ``min_drop`` (a
share of the median: GPUs of one rack differ by a few percent in any case) and by ``z``
robust standard deviations (1.4826 times the median absolute deviation). A tray is degraded
once one of its GPUs has been an outlier for ``persist`` windows in a row; one clean window
forgets the run. The verdict names the clock-event reasons DCGM gave (thermal, power).

A straggler that leaves the clocks alone (a slow CPU feeding one rank, NVLink errors and their
replays) shows in the group's step time instead. Per window, the group's mean decode step is
measured from its engines' vLLM series (vLLM records one inter-token latency per request at
every engine step that emits its tokens, so their mean is the mean step) and set against what
the performance model (``baton.core.perf``) predicts for the batch each DP rank ran (its mean
running requests, their mean context from the KV cache in use, the speculative tokens, and the
per-step balance of its experts that the EPLB service measures in agent mode, or the balance
the deployment's status reports; with neither, the step is not judged). A group whose steps
take ``min_slowdown`` times the prediction for ``persist`` windows in a row is slow
(``StepWatch``). With no GPU of it a clock outlier, the tray to blame is the one whose GPU's
NVLinks logged the most CRC, replay and recovery errors in the window (dcgm-exporter's NVLink
error counters), at least ``min_link_errors`` of them (``link_culprit``): it is marked with the
group's measured slowdown. With none, no tray can be named, so the controller reports the group
(an Event and a series) for an operator to find the tray and mark it.

Action: a degraded tray is marked on its Node (``baton.dev/degraded``: why, since, slowdown;
``degraded_marks``) and takes no new pods. Moving the group to the spare tray restarts it (the
weights reload: ``restart_s`` of the whole group's capacity), while staying costs
``1 - 1/slowdown`` of its capacity for as long as the fault lasts. A fault seen for ``T`` is
taken to last about ``T`` more, so the move pays once ``(1 - 1/slowdown) * T`` passes
``restart_s`` (``move_decision``; a tray an operator marked by hand moves at once).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from baton.core.labels import (
    DEGRADED_ANNOTATION,
    DEGRADED_SINCE_ANNOTATION,
    DEGRADED_SLOWDOWN_ANNOTATION,
)
from baton.core.model import DRAFT, TARGET
from baton.core.perf import RankBatch, step_seconds
from baton.core.profile import Profile
from controller.observe import rfc3339
from controller.topology import Degradation

__all__ = [
    "CLOCK_EVENT_REASONS",
    "Degraded",
    "GpuClock",
    "GpuLinkErrors",
    "GroupStep",
    "LinkDegraded",
    "Move",
    "SlowGroup",
    "StepWatch",
    "StragglerWatch",
    "Verdict",
    "clock_outliers",
    "clock_queries",
    "clocks_from",
    "degraded_marks",
    "expected_step_seconds",
    "group_step_from",
    "move_decision",
    "reason_names",
    "step_queries",
    "worth_moving",
]

# NVML's clock-event reasons (``DCGM_FI_DEV_CLOCKS_EVENT_REASONS``) that lower a busy GPU's
# clock; idle, application-clock settings and display clocks say nothing about health.
CLOCK_EVENT_REASONS = {
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
}
_MAD_TO_SIGMA = 1.4826  # the MAD of a normal distribution, in standard deviations


@dataclass(frozen=True, slots=True)
class GpuClock:
    """One GPU over one window: its tray (the node's name), index and median SM clock."""

    tray: str
    gpu: str
    sm_clock_mhz: float
    reasons: int = 0  # every clock-event reason bit seen in the window


@dataclass(frozen=True, slots=True)
class Degraded:
    """A tray one of whose GPUs has held its group back for ``persist`` windows or more."""

    tray: str
    gpu: str
    clock_share: float  # the GPU's clock over its group's median, this window
    reasons: tuple[str, ...]
    since: float  # when its run of outlier windows began (the watch's clock)

    @property
    def message(self) -> str:
        why = ", ".join(self.reasons) or "no clock-event reason reported"
        return (
            f"GPU {self.gpu} runs at {self.clock_share:.0%} of its decode group's median SM "
            f"clock ({why})"
        )

    @property
    def slowdown(self) -> float:
        """How many times as long the group's steps take: every MoE layer waits for this GPU,
        whose work takes ``1 / clock_share`` as long (the step taken as compute-bound: an
        upper bound where part of it waits on memory or the network)."""
        return 1.0 / self.clock_share if self.clock_share > 0 else float("inf")


def clock_queries(trays: Sequence[str], window_s: int) -> tuple[str, str]:
    """The PromQL of one window of a group's GPUs, on dcgm-exporter's series of its ``trays``
    (their ``Hostname``): each GPU's median SM clock over the window, and its clock-event
    reasons now."""
    hosts = "|".join(trays)
    return (
        f'quantile_over_time(0.5, DCGM_FI_DEV_SM_CLOCK{{Hostname=~"{hosts}"}}[{window_s}s])',
        f'DCGM_FI_DEV_CLOCKS_EVENT_REASONS{{Hostname=~"{hosts}"}}',
    )


def clocks_from(
    clocks: Sequence[Mapping[str, Any]], reasons: Sequence[Mapping[str, Any]]
) -> list[GpuClock]:
    """The two queries' instant vectors (Prometheus' JSON ``result``) as one GpuClock per GPU."""
    events = {
        (sample["metric"]["Hostname"], sample["metric"]["gpu"]): int(float(sample["value"][1]))
        for sample in reasons
    }
    return [
        GpuClock(
            sample["metric"]["Hostname"],
            sample["metric"]["gpu"],
            float(sample["value"][1]),
            events.get((sample["metric"]["Hostname"], sample["metric"]["gpu"]), 0),
        )
        for sample in clocks
    ]


def reason_names(reasons: int) -> tuple[str, ...]:
    return tuple(name for bit, name in CLOCK_EVENT_REASONS.items() if reasons & bit)


def clock_outliers(
    clocks: Sequence[GpuClock], *, min_drop: float = 0.05, z: float = 6.0
) -> list[GpuClock]:
    """The GPUs of one group whose clock is below the group's median by ``min_drop`` of it and
    by ``z`` robust standard deviations. Fewer than 4 GPUs have no median worth trusting."""
    if len(clocks) < 4:
        return []
    values = [gpu.sm_clock_mhz for gpu in clocks]
    median = statistics.median(values)
    if median <= 0:
        return []
    sigma = _MAD_TO_SIGMA * statistics.median(abs(v - median) for v in values)
    return [
        gpu
        for gpu in clocks
        if median - gpu.sm_clock_mhz >= min_drop * median and median - gpu.sm_clock_mhz > z * sigma
    ]


@dataclass
class StragglerWatch:
    """Outlier runs per GPU of one decode group, window after window (the caller's clock)."""

    persist: int = 3
    min_drop: float = 0.05
    z: float = 6.0
    _runs: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)

    def observe(self, now: float, clocks: Sequence[GpuClock]) -> list[Degraded]:
        """One window's clocks; the trays degraded as of it, worst GPU first."""
        median = statistics.median(gpu.sm_clock_mhz for gpu in clocks) if clocks else 0.0
        outliers = clock_outliers(clocks, min_drop=self.min_drop, z=self.z)
        runs: dict[tuple[str, str], tuple[int, float]] = {}
        for gpu in outliers:
            key = (gpu.tray, gpu.gpu)
            count, since = self._runs.get(key, (0, now))
            runs[key] = (count + 1, since)
        self._runs = runs  # a GPU absent or clean this window starts over
        degraded = [
            Degraded(
                gpu.tray,
                gpu.gpu,
                gpu.sm_clock_mhz / median,
                reason_names(gpu.reasons),
                runs[(gpu.tray, gpu.gpu)][1],
            )
            for gpu in outliers
            if runs[(gpu.tray, gpu.gpu)][0] >= self.persist
        ]
        return sorted(degraded, key=lambda d: d.clock_share)


class Verdict(Protocol):
    """A tray found holding back its decode group, whatever the cause."""

    @property
    def tray(self) -> str: ...

    @property
    def since(self) -> float: ...

    @property
    def message(self) -> str: ...

    @property
    def slowdown(self) -> float: ...


def degraded_marks(degraded: Verdict, since: datetime) -> dict[str, str]:
    """The Node annotations that mark ``degraded``'s tray (``since``: its ``since`` on the wall
    clock, RFC 3339 in UTC)."""
    return {
        DEGRADED_ANNOTATION: degraded.message,
        DEGRADED_SINCE_ANNOTATION: rfc3339(since),
        DEGRADED_SLOWDOWN_ANNOTATION: f"{degraded.slowdown:.3f}",
    }


@dataclass(frozen=True, slots=True)
class Move:
    """Whether a decode group on a degraded tray moves now; if not, in how long it will pay
    (None: never, a slowdown of 1)."""

    now: bool
    why: str
    pays_in_s: float | None = None


def move_decision(tray: str, degradation: Degradation, now: datetime, restart_s: float) -> Move:
    """``worth_moving`` for a marked tray; one marked by hand (no since or slowdown) moves at
    once: the operator judged it."""
    if degradation.since is None or degradation.slowdown is None:
        return Move(True, f"{tray} marked degraded by hand ({degradation.why})")
    slowdown, degraded_for = degradation.slowdown, (now - degradation.since).total_seconds()
    what = f"{tray} degraded since {rfc3339(degradation.since)} ({degradation.why})"
    if worth_moving(slowdown, degraded_for, restart_s):
        return Move(
            True,
            f"{what}: steps {slowdown:.2f}x as long for {degraded_for:.0f} s cost more than a "
            f"{restart_s:.0f} s restart",
        )
    if slowdown <= 1.0:
        return Move(False, f"{what}: no slowdown to pay for a restart")
    pays_after = restart_s / (1.0 - 1.0 / slowdown)
    at = degradation.since + timedelta(seconds=pays_after)
    return Move(
        False,
        f"{what}: steps {slowdown:.2f}x as long; moving pays at {rfc3339(at)}, against a "
        f"{restart_s:.0f} s restart",
        pays_after - degraded_for,
    )


def worth_moving(slowdown: float, degraded_for_s: float, restart_s: float) -> bool:
    """Whether moving a group whose steps take ``slowdown`` times as long as they should, for
    ``degraded_for_s`` so far, costs less than staying: a restart costs the whole group's
    capacity for ``restart_s``."""
    if slowdown <= 1.0:
        return False
    return (1.0 - 1.0 / slowdown) * degraded_for_s > restart_s


@dataclass(frozen=True, slots=True)
class GroupStep:
    """One decode group over one window, from its engines' vLLM series and the EPLB service's
    balance figures."""

    step_s: float  # the mean decode step: inter-token latencies' sum over their count
    steps: float  # inter-token latencies recorded in the window
    requests: tuple[float, ...]  # each DP rank's mean running requests
    context_tokens: float  # tokens in KV per running request, the group's mean
    # vLLM's per-step balancedness of each MoE model's experts (mean over max rank load); None:
    # no figure, no prediction (the MoE all-to-all's time is set by the busiest rank)
    target_balance: float | None = None
    draft_balance: float | None = None


def step_queries(deployment: str, cell: str, window_s: int) -> dict[str, str]:
    """The PromQL of one window of a decode group's engines, selected as the chart's PodMonitor
    labels them (``deployment``: NAMESPACE/NAME): the inter-token latencies' sum and count, each
    engine's mean running requests and KV cache in use, its cache's size; and the EPLB
    service's per-step balance of each model for the group (the service names it by its
    cell)."""
    group = f'modeldeployment="{deployment}",cell="{cell}",role="decode"'
    itl = "vllm:inter_token_latency_seconds"
    return {
        "itl_sum": f"sum(increase({itl}_sum{{{group}}}[{window_s}s]))",
        "itl_count": f"sum(increase({itl}_count{{{group}}}[{window_s}s]))",
        "running": f"avg_over_time(vllm:num_requests_running{{{group}}}[{window_s}s])",
        "kv_usage": f"avg_over_time(vllm:kv_cache_usage_perc{{{group}}}[{window_s}s])",
        "cache": f"vllm:cache_config_info{{{group}}}",
        "balance": f'min by (model) (baton_eplb_step_balance{{group="{cell}"}})',
    }


def _value(sample: Mapping[str, Any]) -> float:
    return float(sample["value"][1])


def _engine(sample: Mapping[str, Any]) -> tuple[str, str]:
    labels = sample["metric"]
    return labels.get("instance", ""), labels.get("engine", "")


def group_step_from(results: Mapping[str, Sequence[Mapping[str, Any]]]) -> GroupStep | None:
    """The queries' instant vectors (Prometheus' JSON ``result`` per ``step_queries`` key) as
    the group's step; None when its engines emitted no token in the window."""
    count = sum(_value(sample) for sample in results["itl_count"])
    if count <= 0:
        return None
    total = sum(_value(sample) for sample in results["itl_sum"])
    running = {_engine(sample): _value(sample) for sample in results["running"]}
    kv_tokens = 0.0
    usage = {_engine(sample): _value(sample) for sample in results["kv_usage"]}
    for sample in results["cache"]:
        labels = sample["metric"]
        blocks = float(labels.get("num_gpu_blocks") or 0) * float(labels.get("block_size") or 0)
        kv_tokens += usage.get(_engine(sample), 0.0) * blocks
    requests = sum(running.values())
    context = kv_tokens / requests if requests > 0 else 0.0
    balance = {
        sample["metric"].get("model"): _value(sample) for sample in results.get("balance", ())
    }
    return GroupStep(
        total / count,
        count,
        tuple(running.values()),
        context,
        balance.get(TARGET.name),
        balance.get(DRAFT.name),
    )


def expected_step_seconds(
    profile: Profile, step: GroupStep, *, num_speculative_tokens: int = 0
) -> float | None:
    """What the performance model predicts for ``step``'s batch: each rank's mean requests, each
    with ``1 + num_speculative_tokens`` query tokens over the mean context, at its balance (the
    draft's, when unknown, taken as the profile's measured one); None without the target's
    balance."""
    if step.target_balance is None:
        return None
    query = 1 + num_speculative_tokens
    ranks = [
        RankBatch(
            decode_requests=round(requests),
            decode_query_tokens=round(requests * query),
            decode_context_query_product=requests * step.context_tokens * query,
        )
        for requests in step.requests
    ]
    return step_seconds(
        profile,
        ranks,
        num_speculative_tokens=num_speculative_tokens,
        target_balance=step.target_balance,
        draft_balance=step.draft_balance or profile.decode.reference_balance,
    ).total_s


@dataclass(frozen=True, slots=True)
class SlowGroup:
    """A decode group whose steps took ``slowdown`` times the prediction, window after window."""

    slowdown: float  # this window's measured step over the expected one
    step_s: float
    expected_s: float
    since: float  # when its run of slow windows began (the watch's clock)

    @property
    def message(self) -> str:
        return (
            f"decode steps take {self.step_s * 1e3:.1f} ms, {self.slowdown:.2f}x the "
            f"{self.expected_s * 1e3:.1f} ms the performance model predicts for the batch its "
            "ranks run"
        )


@dataclass
class StepWatch:
    """Slow-window runs of one decode group's step against the prediction (the caller's
    clock). A window with fewer than ``min_steps`` inter-token latencies (an idle group, a
    group just started) judges nothing and keeps the run as it is."""

    persist: int = 3
    min_slowdown: float = 1.25
    min_steps: float = 100.0
    _run: int = 0
    _since: float = 0.0

    def observe(
        self, now: float, step: GroupStep | None, expected_s: float | None
    ) -> SlowGroup | None:
        """One window's step and its prediction (None: none could be made); the verdict once
        the group has been slow for ``persist`` windows in a row, else None."""
        if step is None or step.steps < self.min_steps or not expected_s:
            return None
        slowdown = step.step_s / expected_s
        if slowdown < self.min_slowdown:
            self._run = 0
            return None
        if self._run == 0:
            self._since = now
        self._run += 1
        if self._run < self.persist:
            return None
        return SlowGroup(slowdown, step.step_s, expected_s, self._since)


@dataclass(frozen=True, slots=True)
class GpuLinkErrors:
    """One GPU over one window: the NVLink CRC, replay and recovery errors it logged."""

    tray: str
    gpu: str
    errors: float


# dcgm-exporter's NVLink error counters (a failing link's flit CRC errors are each replayed)
LINK_ERROR_COUNTERS = tuple(
    f"DCGM_FI_DEV_NVLINK_{kind}_ERROR_COUNT_TOTAL"
    for kind in ("CRC_FLIT", "CRC_DATA", "REPLAY", "RECOVERY")
)


def link_error_queries(trays: Sequence[str], window_s: int) -> list[str]:
    """The PromQL of each GPU of ``trays``' NVLink errors over one window, one query per
    counter (``increase`` drops the names, so one query over all four would see each GPU four
    times with one labelset)."""
    hosts = "|".join(trays)
    return [
        f'increase({counter}{{Hostname=~"{hosts}"}}[{window_s}s])'
        for counter in LINK_ERROR_COUNTERS
    ]


def link_errors_from(results: Sequence[Sequence[Mapping[str, Any]]]) -> list[GpuLinkErrors]:
    """The queries' instant vectors as each GPU's errors, every counter summed."""
    errors: dict[tuple[str, str], float] = {}
    for samples in results:
        for sample in samples:
            gpu = (sample["metric"]["Hostname"], sample["metric"]["gpu"])
            errors[gpu] = errors.get(gpu, 0.0) + _value(sample)
    return [GpuLinkErrors(tray, gpu, count) for (tray, gpu), count in errors.items()]


@dataclass(frozen=True, slots=True)
class LinkDegraded:
    """A tray whose GPU's NVLinks failed while its decode group's steps were slow."""

    tray: str
    gpu: str
    errors: float
    window_s: int
    slowdown: float  # the group's step over the prediction
    since: float  # when the group's run of slow windows began

    @property
    def message(self) -> str:
        return (
            f"GPU {self.gpu}'s NVLinks logged {self.errors:.0f} CRC, replay and recovery errors "
            f"in {self.window_s} s while its decode group's steps took {self.slowdown:.2f}x the "
            "performance model's prediction"
        )


def link_culprit(
    slow: SlowGroup, errors: Sequence[GpuLinkErrors], window_s: int, min_errors: float = 10.0
) -> LinkDegraded | None:
    """The tray to blame for ``slow``: its GPU that logged the most NVLink errors in the
    window, at least ``min_errors`` (a healthy link logs none; a stray error is not a failing
    link); None where no GPU did."""
    worst = max(errors, key=lambda gpu: gpu.errors, default=None)
    if worst is None or worst.errors < min_errors:
        return None
    return LinkDegraded(worst.tray, worst.gpu, worst.errors, window_s, slow.slowdown, slow.since)
