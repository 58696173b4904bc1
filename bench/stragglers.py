"""``baton bench stragglers``: one GPU of a DEP32 decode group throttled to 70%, found and moved.

The straggler loop as a rack runs it, on this machine: a real API server with a rack of kwok
trays, ``baton controller`` with its straggler watch reading a real Prometheus, a ModelDeployment
placed on the trays, and a simulated DEP32 group (``rigs.stragglers``) whose eight dcgm-exporters
carry the names of the decode trays, its EPLB agent followed by ``baton eplb`` in agent mode.
Every GPU decodes long requests throughout, and the exporters' series carry the simulator's
rack noise (``baton sim --dcgm-noise rack``: each GPU 0-3% below nominal for good, momentary
5-15% power-cap dips). Phases:

1. Healthy: the group's tokens/s, its EPLB balance once the service has rebalanced, and no tray
   marked. Tokens/s are counted per simulated second (the modelled engine's throughput: on a
   host too busy to keep the simulated timeline, wall-clock rates measure the host); the
   wall-clock rate is recorded beside it.
2. Fault: rank 13 (GPU 1 of the fourth tray) throttled to 70% of its SM clock. Measured: when
   the watch marks the tray, when the controller drains the cell and restarts the group off it
   (the new decode trays in status), and the group's tokens/s meanwhile.
3. The move: the simulated group restarts, as the moved group's engines do (fresh engines on
   vLLM's initial placement, without the throttled GPU: the spare's GPUs are healthy). The kwok
   pods are Ready at once, so the controller measures a restart of about a second and the move
   pays as soon as the tray is marked; the record gives when the same rule would move a group
   whose weights take 180 s to load.
4. After: tokens/s against the healthy phase's, and the EPLB balance at the first decisions
   after the restart (the service restores the placement in force before) against the balance
   before the fault and the cold placement's at the start.
5. Failing NVLinks: one GPU's links fail ``LINK_ERRORS_PER_S`` times a second and every step
   takes ``LINK_FACTOR`` times as long, every clock normal (the simulator's ``nvlink_errors``
   fault). Measured: when the watch, finding the group slow against the performance model's
   prediction, marks that GPU's tray, and when the group moves off it; the group restarts again.
6. A slow group with normal clocks and links: every step ``SLOW_FACTOR`` times as long (the
   simulator's ``slow`` fault: a slow CPU). Measured: when the watch reports the group slow
   (``baton_decode_group_slow``, the ``DecodeGroupSlow`` Event), the ratio it saw, and that no
   tray was marked.

Throughout, the watch's ratio of the group's measured step to the model's prediction for its
batch (``baton_decode_group_slowdown``) is recorded.

``--noise-minutes N`` runs a healthy group alone for N minutes with the chart's default windows
(60 s, three in a row), its EPLB service running, and counts the trays marked and the groups
reported slow: the false positives.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from kubernetes import client, config

from baton.core.labels import DEGRADED_ANNOTATION, DEGRADED_SLOWDOWN_ANNOTATION
from baton.core.model import MODEL, SPECULATIVE_METHOD, SPECULATIVE_TOKENS
from controller.stragglers import move_decision
from controller.topology import Degradation
from rigs.devcluster import (
    add_trays,
    binaries_dir,
    create_model_deployment,
    install_crd,
    read_model_deployment,
    start_control_plane,
    start_controller,
)
from rigs.processes import eventually, free_port, stop_process
from rigs.stragglers import SimulatedGroup, simulated_group

__all__ = ["add_arguments", "run"]

NAMESPACE, DEPLOYMENT = "bench", "dsv4"
THROTTLED_RANK, SHARE = 13, 0.7  # GPU 1 of the fourth tray
EPLB_STEPS = 300  # the service's cadence here: every 300 steps from the last 300
REAL_RESTART_S = 180.0  # what the same rule pays for a group whose weights take this long
LINK_RANK, LINK_ERRORS_PER_S, LINK_FACTOR = 21, 50.0, 1.3  # GPU 1 of the sixth tray
SLOW_FACTOR = 1.3  # phase 6: every step this many times as long, every clock and link normal
# the engines' speculative decoding, as the simulator runs it (the study's)
SPECULATIVE = {"method": SPECULATIVE_METHOD, "numSpeculativeTokens": SPECULATIVE_TOKENS}
_FIGURES = Path(__file__).resolve().parents[1] / "docs" / "figures"
_RESULTS = Path("bench/results")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("stragglers")
    group.add_argument(
        "--window-seconds",
        type=int,
        default=10,
        help="the straggler watch's window (the chart's default is 60)",
    )
    group.add_argument(
        "--noise-minutes",
        type=float,
        default=0.0,
        help="also run a healthy group this long with 60 s windows and count the trays marked",
    )


def run(quick: bool = False, args: argparse.Namespace | None = None) -> dict[str, Any]:
    window_s = args.window_seconds if args is not None else 10
    noise_minutes = args.noise_minutes if args is not None else 0.0
    phase_s = 30.0 if quick else 60.0
    with tempfile.TemporaryDirectory(prefix="baton-stragglers-") as tmp:
        directory = Path(tmp)
        plane = start_control_plane(directory / "k8s", binaries_dir())
        try:
            api = config.new_client_from_config(config_file=str(plane.kubeconfig))
            install_crd(api)
            result = _fault_run(api, plane, directory, window_s, phase_s)
            if noise_minutes > 0:
                result["noise"] = _noise_run(api, plane, directory, noise_minutes)
        finally:
            plane.stop()
    out = args.out if args is not None and args.out is not None else None
    result["plot"] = _plot(result, out or (_RESULTS if quick else _FIGURES))
    _print(result)
    return result


def _fault_run(
    api: client.ApiClient, plane: Any, directory: Path, window_s: int, phase_s: float
) -> dict[str, Any]:
    core = client.CoreV1Api(api)
    add_trays(api, 1, name_prefix="fault-")
    metrics = free_port()
    with simulated_group(
        directory / "fault",
        "fault-rack-0",
        controller=f"127.0.0.1:{metrics}",
        eplb_steps=EPLB_STEPS,
        dcgm_noise="rack",
        deployment=f"{NAMESPACE}/{DEPLOYMENT}",
        cell=f"{DEPLOYMENT}-cell-0",
    ) as group:
        controller = start_controller(
            plane,
            "bench-fault",
            "baton-controller-bench-fault",
            metrics_port=metrics,
            extra=(
                f"--prometheus-url={group.prometheus.url}",
                f"--straggler-window-seconds={window_s}",
                "--straggler-windows=3",
            ),
        )
        try:
            core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
            create_model_deployment(
                api,
                NAMESPACE,
                DEPLOYMENT,
                {
                    "model": MODEL,
                    "cell": {"prefill": {"instances": 2}},
                    "rollout": {"drainSeconds": 5, "minReadySeconds": 5},
                    "speculative": SPECULATIVE,
                },
            )
            eventually(lambda: _ready(api), timeout=120, interval=0.5)
            [cell] = _status(api)["cells"]
            if cell["decode"]["trays"] != group.trays:
                raise RuntimeError(f"decode placed on {cell['decode']['trays']}, not {group.trays}")
            slow, spare = group.trays[3], cell["spareTrays"][0]
            started = time.time()
            # healthy: the service has made its first decisions, then a phase of steady decode
            eventually(lambda: _decisions(group) >= 2, timeout=300, interval=1.0)
            healthy_from = time.time()
            time.sleep(phase_s)
            healthy_to = time.time()
            marked_healthy = _marked(core, group.trays)
            group.faults.inject(
                group.servers[THROTTLED_RANK // 4],
                action="throttle",
                rank=THROTTLED_RANK,
                share=SHARE,
                seconds=3600,
            )
            throttled = time.time()
            eventually(lambda: bool(_marked(core, [slow])), timeout=20 * window_s, interval=0.25)
            marked = time.time()
            annotations = _annotations(core, slow)
            eventually(
                lambda: _status(api)["cells"][0]["decode"]["trays"][3] == spare,
                timeout=300,
                interval=0.25,
            )
            moved = time.time()
            group.restart()  # the moved group's engines: fresh, on the spare's healthy GPUs
            restarted = time.time()
            eventually(lambda: _ready(api), timeout=300, interval=0.5)
            ready = time.time()
            # the same span of the new load as the healthy phase's of the first: requests of the
            # same age (a decode step's time grows with the context it reads)
            lead = healthy_from - group.load_started[0]
            after_from = group.load_started[-1] + lead
            after_to = after_from + (healthy_to - healthy_from)
            time.sleep(max(0.0, after_to - time.time()) + 2.0)
            # 5: one GPU's NVLinks fail; every step slower, every clock normal
            linked = group.trays[LINK_RANK // 4]
            group.faults.inject(
                group.servers[LINK_RANK // 4],
                action="nvlink_errors",
                rank=LINK_RANK,
                rate=LINK_ERRORS_PER_S,
                factor=LINK_FACTOR,
                seconds=3600,
            )
            links_failed = time.time()
            eventually(lambda: bool(_marked(core, [linked])), timeout=20 * window_s, interval=0.25)
            links_marked = time.time()
            link_annotations = _annotations(core, linked)
            eventually(
                lambda: linked not in _status(api)["cells"][0]["decode"]["trays"],
                timeout=300,
                interval=0.25,
            )
            links_moved = time.time()
            link_slow_event = _slow_event(core)
            group.restart()  # the moved group's engines, on healthy links
            eventually(lambda: _ready(api), timeout=300, interval=0.5)
            # 6: a slow group whose clocks and links stay normal (a slow CPU)
            group.faults.inject(group.servers[0], action="slow", factor=SLOW_FACTOR, seconds=3600)
            slowed = time.time()
            eventually(lambda: _reported_slow(group), timeout=20 * window_s, interval=0.25)
            reported = time.time()
            slow_event = _slow_event(core)
            slow_marked = _marked(core, _status(api)["cells"][0]["decode"]["trays"])
            timeline = _timeline(group, started, reported)
        finally:
            stop_process(controller)
        eplb_log = (group.directory / "eplb.log").read_text(errors="replace")
    slowdown = float(annotations.get(DEGRADED_SLOWDOWN_ANNOTATION, "nan"))
    healthy_tps = _mean(timeline["tokens_per_s"], healthy_from, healthy_to)
    faulted_tps = _mean(timeline["tokens_per_s"], throttled + 10, moved)
    after_tps = _mean(timeline["tokens_per_s"], after_from, after_to)
    wall = timeline["wall_tokens_per_s"]
    ratio = timeline["step_slowdown"]
    return {
        "benchmark": "stragglers",
        "setup": {
            "group": "DEP32, 8 API servers of 4 ranks, 43 layers x 384 experts (baton sim)",
            "throttled": f"rank {THROTTLED_RANK} (GPU 1 of {slow}) at {SHARE:.0%} of its SM clock",
            "window_s": window_s,
            "windows": 3,
            "eplb": f"agent mode, every {EPLB_STEPS} steps from the last {EPLB_STEPS}",
            "drain_s": 5,
            "dcgm_noise": "rack: each GPU 0-3% below nominal for good; 1 scrape in 50 dips 5-15%",
        },
        "healthy": {
            "trays_marked": marked_healthy,
            "tokens_per_s": healthy_tps,
            "wall_tokens_per_s": _mean(wall, healthy_from, healthy_to),
            "step_over_model": _mean(ratio, healthy_from, healthy_to),
        },
        "fault": {
            "to_mark_s": marked - throttled,
            "mark": annotations.get(DEGRADED_ANNOTATION),
            "slowdown": slowdown,
            "to_move_s": moved - throttled,
            "tokens_per_s": faulted_tps,
            "tokens_per_s_share": faulted_tps / healthy_tps if healthy_tps else None,
            "wall_tokens_per_s": _mean(wall, throttled + 10, moved),
            "step_over_model": _mean(ratio, throttled + window_s + 1, moved),
            # the same rule for a group whose weights take REAL_RESTART_S to load
            "real_restart_s": REAL_RESTART_S,
            "real_move_after_mark_s": _pays_after(slowdown, REAL_RESTART_S),
        },
        "after": {
            "restart_s": restarted - moved,
            "to_ready_s": ready - throttled,
            "tokens_per_s": after_tps,
            "tokens_per_s_share": after_tps / healthy_tps if healthy_tps else None,
            "wall_tokens_per_s": _mean(wall, after_from, after_to),
            "trays_marked": _marked(core, group.trays),
            "step_over_model": _mean(ratio, after_from, after_to),
        },
        "nvlink": {
            "fault": f"rank {LINK_RANK} (GPU 1 of {linked}): {LINK_ERRORS_PER_S:.0f} NVLink "
            f"errors a second, every step {LINK_FACTOR}x",
            "to_mark_s": links_marked - links_failed,
            "mark": link_annotations.get(DEGRADED_ANNOTATION),
            "slowdown": float(link_annotations.get(DEGRADED_SLOWDOWN_ANNOTATION, "nan")),
            "to_move_s": links_moved - links_failed,
            "step_over_model": _mean(ratio, links_failed + window_s + 1, links_marked),
            "decode_group_slow_event": link_slow_event,
        },
        "slow_group": {
            "factor": SLOW_FACTOR,
            "to_report_s": reported - slowed,
            "step_over_model": _mean(ratio, slowed + window_s + 1, reported),
            "event": slow_event,
            "trays_marked": slow_marked,
        },
        "eplb": _eplb_recovery(eplb_log),
        "moments": {
            "healthy": [healthy_from - started, healthy_to - started],
            "throttled": throttled - started,
            "marked": marked - started,
            "moved": moved - started,
            "restarted": restarted - started,
            "ready": ready - started,
            "after": [after_from - started, after_to - started],
            "links_failed": links_failed - started,
            "links_marked": links_marked - started,
            "links_moved": links_moved - started,
            "slowed": slowed - started,
            "reported": reported - started,
        },
        "timeline": {
            name: [[t - started, v] for t, v in series] for name, series in timeline.items()
        },
    }


def _noise_run(
    api: client.ApiClient, plane: Any, directory: Path, minutes: float
) -> dict[str, Any]:
    """A healthy group for ``minutes`` under the default windows: the trays marked and the
    groups reported slow."""
    core = client.CoreV1Api(api)
    add_trays(api, 1, first_rack=1, name_prefix="noise-")
    metrics = free_port()
    with simulated_group(
        directory / "noise",
        "noise-rack-1",
        controller=f"127.0.0.1:{metrics}",
        eplb_steps=EPLB_STEPS,
        dcgm_noise="rack",
        deployment=f"{NAMESPACE}/noise",
        cell="noise-cell-0",
    ) as group:
        controller = start_controller(
            plane,
            "bench-noise",
            "baton-controller-bench-noise",
            metrics_port=metrics,
            extra=(f"--prometheus-url={group.prometheus.url}",),
        )
        try:
            create_model_deployment(
                api,
                NAMESPACE,
                "noise",
                {
                    "model": MODEL,
                    "cell": {"prefill": {"instances": 2}},
                    "speculative": SPECULATIVE,
                },
            )
            eventually(lambda: _ready(api, "noise"), timeout=120, interval=0.5)
            time.sleep(60 * minutes)  # the run's length: a benchmark phase, not a wait
            windows = round(minutes)  # 60 s windows
            marked = _marked(core, group.trays)
            span = f"[{round(minutes * 60)}s:15s]"
            ratio = {
                name: group.prometheus.query(
                    f"{name}_over_time(max(baton_decode_group_slowdown){span})"
                )
                for name in ("min", "max", "count")
            }
            slow_events = _slow_event(core, "noise")
            spread = group.prometheus.query("max(DCGM_FI_DEV_SM_CLOCK) / min(DCGM_FI_DEV_SM_CLOCK)")
            # the GPUs were busy throughout (an idle GPU clocks down to 345 MHz)
            busy = group.prometheus.query(
                f"min_over_time(quantile(0.5, DCGM_FI_DEV_SM_CLOCK)[{round(minutes * 60)}s:15s])"
            )
        finally:
            stop_process(controller)
    return {
        "dcgm_noise": "rack",
        "window_s": 60,
        "windows_in_a_row": 3,
        "minutes": minutes,
        "windows": windows,
        "trays_marked": marked,
        "groups_reported_slow": 0 if slow_events is None else 1,
        "step_over_model": {
            name: float(found[0]["value"][1]) if found else None for name, found in ratio.items()
        },
        "fastest_over_slowest_gpu_at_the_end": float(spread[0]["value"][1]) if spread else None,
        "lowest_median_sm_clock_mhz": float(busy[0]["value"][1]) if busy else None,
    }


def _status(api: client.ApiClient, name: str = DEPLOYMENT) -> dict[str, Any]:
    status: dict[str, Any] = read_model_deployment(api, NAMESPACE, name).get("status") or {}
    return status


def _ready(api: client.ApiClient, name: str = DEPLOYMENT) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in _status(api, name).get("conditions", [])
    )


def _annotations(core: client.CoreV1Api, tray: str) -> dict[str, str]:
    meta = core.read_node(tray).metadata
    return dict((meta.annotations if meta else None) or {})


def _marked(core: client.CoreV1Api, trays: list[str]) -> list[str]:
    return [tray for tray in trays if DEGRADED_ANNOTATION in _annotations(core, tray)]


def _reported_slow(group: SimulatedGroup) -> bool:
    return bool(group.prometheus.query("max(baton_decode_group_slow) == 1"))


def _slow_event(core: client.CoreV1Api, name: str = DEPLOYMENT) -> str | None:
    """The message of the deployment's ``DecodeGroupSlow`` Event, if one was recorded."""
    events = core.list_namespaced_event(NAMESPACE, field_selector=f"involvedObject.name={name}")
    found = [e.message for e in events.items if e.reason == "DecodeGroupSlow"]
    return found[-1] if found else None


def _decisions(group: SimulatedGroup) -> int:
    """Decisions the EPLB service has taken for the target model (its decision histogram)."""
    assert group.eplb_metrics is not None
    text = httpx.get(group.eplb_metrics, timeout=5).text
    found = re.search(
        r'^baton_eplb_decision_seconds_count\{[^}]*model="target"[^}]*\} (\S+)$', text, re.M
    )
    return int(float(found.group(1))) if found else 0


def _timeline(group: SimulatedGroup, start: float, end: float) -> dict[str, list[list[float]]]:
    """The group's tokens/s, its slowest GPU's SM clock and the target model's EPLB window
    balance, as Prometheus recorded them, one point a second."""
    queries = {
        # per simulated second: the modelled engine's throughput, whether or not this host kept
        # the simulated timeline (past 50 ms behind it gives the debt up, and wall-clock rates
        # then measure the host); every server of the group reports the group's modelled time
        "tokens_per_s": 'sum(increase(vllm:generation_tokens_total{job="baton-engines"}[10s])) '
        '/ max(increase(baton:sim_step_seconds_total{job="baton-engines"}[10s]))',
        "wall_tokens_per_s": 'sum(rate(vllm:generation_tokens_total{job="baton-engines"}[10s]))',
        "slowest_sm_clock_mhz": "min(DCGM_FI_DEV_SM_CLOCK)",
        "median_sm_clock_mhz": "quantile(0.5, DCGM_FI_DEV_SM_CLOCK)",
        "eplb_step_balance": 'max(baton_eplb_step_balance{model="target"})',
        "step_slowdown": "max(baton_decode_group_slowdown)",
    }
    series: dict[str, list[list[float]]] = {}
    for name, expr in queries.items():
        result = group.prometheus.query_range(expr, start, end, 1.0)
        series[name] = [[float(t), float(v)] for t, v in result[0]["values"]] if result else []
    return series


def _mean(series: list[list[float]], start: float, end: float) -> float:
    values = [v for t, v in series if start <= t <= end]
    return sum(values) / len(values) if values else 0.0


def _pays_after(slowdown: float, restart_s: float) -> float | None:
    """Seconds of the fault after which moving pays: ``controller.stragglers``' own decision
    for a tray marked that long ago."""
    mark = Degradation("bench", datetime.now(UTC), slowdown)
    return move_decision("tray", mark, mark.since or datetime.now(UTC), restart_s).pays_in_s


_SYNC = re.compile(r"group \S+: \d+ ranks over \d+ agents, models \[[^]]*\], step (\d+)")
# decisions on a complete window: a skip for too small a gain, or a committed switch
_DECISION = re.compile(
    r"group \S+ target: (?:no rebalance at step (\d+) \(gain_too_small; window balance "
    r"([0-9.]+)|switch \S+ committed for step \d+: window \[\d+, (\d+)\) balance ([0-9.]+))"
)
_RESTORED = "in force before they restarted (version"


def _eplb_recovery(log: str) -> dict[str, Any]:
    """From the EPLB service's log: the target model's window balance at each decision, the
    syncs, and whether the restarted group's placement was restored."""
    syncs = [int(m.group(1)) for m in _SYNC.finditer(log)]
    decisions: list[tuple[int, float, int]] = []  # (boundary, balance, syncs before it)
    for found in _DECISION.finditer(log):
        boundary = int(found.group(1) or found.group(3))
        balance = float(found.group(2) or found.group(4))
        decisions.append((boundary, balance, log[: found.start()].count("ranks over")))
    last_sync = len(syncs)
    before = [d for d in decisions if d[2] < last_sync]
    after = [d for d in decisions if d[2] == last_sync]
    return {
        "syncs": syncs,
        "restored": log.count(_RESTORED),
        "cold_balance": decisions[0][1] if decisions else None,
        "balance_before_fault": before[-1][1] if before else None,
        "balance_after_restart": [b for _, b, _ in after[:3]],
        "steps_to_first_decision_after_restart": (after[0][0] - syncs[-1]) if after else None,
    }


def _plot(result: dict[str, Any], directory: Path) -> str | None:
    """The run's timeline: tokens/s and the GPUs' SM clocks, with the moments marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    timeline, moments = result["timeline"], result["moments"]
    figure, (tokens, clocks, steps) = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    for axis, names, label in (
        (tokens, ("tokens_per_s",), "decode tokens per simulated s"),
        (clocks, ("slowest_sm_clock_mhz", "median_sm_clock_mhz"), "SM clock, MHz"),
        (steps, ("step_slowdown",), "step / model's step"),
    ):
        for name in names:
            points = timeline.get(name) or []
            axis.plot(
                [t for t, _ in points],
                [v for _, v in points],
                label=name.replace("_", " "),
                linewidth=1,
            )
        axis.set_ylabel(label)
        for moment, colour in (
            ("throttled", "red"),
            ("marked", "orange"),
            ("moved", "purple"),
            ("ready", "green"),
            ("links_failed", "magenta"),
            ("links_moved", "purple"),
            ("slowed", "brown"),
            ("reported", "grey"),
        ):
            axis.axvline(moments[moment], color=colour, linestyle="--", linewidth=0.8)
            axis.text(moments[moment], axis.get_ylim()[1], moment, fontsize=7, rotation=90)
    clocks.legend(loc="lower right", fontsize=8)
    steps.set_xlabel("seconds since the deployment was Ready")
    figure.suptitle(
        f"One GPU of a DEP32 group at {SHARE:.0%}: marked and moved; a GPU's NVLinks failing: "
        f"marked and moved; every step {SLOW_FACTOR}x, nothing to blame: reported "
        f"({result['setup']['window_s']} s windows, three in a row)"
    )
    figure.tight_layout()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "stragglers.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return str(path)


def _print(result: dict[str, Any]) -> None:
    fault, after, eplb = result["fault"], result["after"], result["eplb"]
    lines = [
        f"healthy: {result['healthy']['tokens_per_s']:.0f} tokens/s, trays marked "
        f"{result['healthy']['trays_marked'] or 'none'}",
        f"throttled to {SHARE:.0%}: marked after {fault['to_mark_s']:.1f} s "
        f"(slowdown {fault['slowdown']:.2f}), moved after {fault['to_move_s']:.1f} s, "
        f"{fault['tokens_per_s']:.0f} tokens/s meanwhile ({fault['tokens_per_s_share']:.2f}x)",
        f"after the move: restart {after['restart_s']:.1f} s, Ready {after['to_ready_s']:.1f} s "
        f"after the throttle; {after['tokens_per_s']:.0f} tokens/s "
        f"({after['tokens_per_s_share']:.2f}x healthy)",
        f"step over the model's prediction: healthy {result['healthy']['step_over_model']:.3f}, "
        f"throttled {fault['step_over_model']:.3f}, after the move {after['step_over_model']:.3f}",
        f"NVLinks failing, every step {LINK_FACTOR}x: tray marked after "
        f"{result['nvlink']['to_mark_s']:.1f} s (slowdown {result['nvlink']['slowdown']:.2f}), "
        f"moved after {result['nvlink']['to_move_s']:.1f} s",
        f"every step {SLOW_FACTOR}x, clocks and links normal: reported slow after "
        f"{result['slow_group']['to_report_s']:.1f} s (step over the model "
        f"{result['slow_group']['step_over_model']:.3f}), trays marked "
        f"{result['slow_group']['trays_marked'] or 'none'}",
        f"EPLB: cold {eplb['cold_balance']}, before the fault {eplb['balance_before_fault']}, "
        f"after the restart {eplb['balance_after_restart']} (restored {eplb['restored']}x, first "
        f"decision {eplb['steps_to_first_decision_after_restart']} steps after the sync)",
    ]
    if "noise" in result:
        noise = result["noise"]
        lines.append(
            f"noise: {noise['minutes']} min, {noise['windows']} windows, trays marked "
            f"{noise['trays_marked'] or 'none'}, groups reported slow "
            f"{noise['groups_reported_slow']} (step over the model "
            f"{noise['step_over_model']['min']}-{noise['step_over_model']['max']}); the group's "
            "median SM clock never below "
            f"{noise['lowest_median_sm_clock_mhz']} MHz"
        )
    print("\n".join(lines))
