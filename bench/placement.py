"""Placement at scale: planning time and GPU use for 1 to 1,000 NVL72 racks, and a re-plan.

For 1, 10, 100 and 1,000 synthetic racks (18 healthy trays of 4 GPUs each; 72,000 GPUs at the
top) one ModelDeployment asks for one cell per rack, in two shapes: the default (DEP32 decode,
one spare tray, DEP2 prefill as many as fit) and the same without a spare tray. For each:

- planning time: ``plan_placement`` from nothing, median of several runs (perf_counter; the
  topology is parsed once beforehand, its parse time is reported separately);
- GPU use: GPUs running decode or prefill over all GPUs, and the same counting spare trays.

Then, on the largest case, one decode tray of one cell fails and the plan is redone against the
previous one (median time of several runs), and once more with nothing changed.
Targets: 1,000 racks planned in <= 1 s; a re-plan after one failure in <= 50 ms; every GPU of a
healthy rack used (1 DEP32 + 18 DEP2 + 1 spare tray, or 1 DEP32 + 20 DEP2).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from controller.placement import DecodeShape, DeploymentShape, Plan, PrefillShape, plan_placement
from controller.topology import Topology, parse_topology, synthetic_nodes

__all__ = ["run"]

PLAN_TARGET_S = 1.0
REPLAN_TARGET_S = 0.050


def _timed(
    shape: DeploymentShape, topology: Topology, current: Plan | None, repeats: int
) -> tuple[float, Plan]:
    """Median seconds of ``plan_placement`` over ``repeats`` runs, and the plan."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        plan = plan_placement([shape], topology, current)
        times.append(time.perf_counter() - started)
    return statistics.median(times), plan


def _use(plan: Plan, topology: Topology) -> dict[str, int]:
    gpus_of = {tray.name: tray.gpus for tray in topology.trays}
    decode = sum(gpus_of[name] for cell in plan.cells for name in cell.decode_trays)
    spare = sum(gpus_of[name] for cell in plan.cells for name in cell.spare_trays)
    prefill = sum(len(i.gpus) for cell in plan.cells for i in cell.prefill)
    return {"decode_gpus": decode, "prefill_gpus": prefill, "spare_gpus": spare}


def run(quick: bool = False) -> dict[str, object]:
    sizes = [1, 10, 100] if quick else [1, 10, 100, 1000]
    repeats = 3 if quick else 7
    shapes = {
        "1 spare": DecodeShape(32, 4, 1),
        "no spare": DecodeShape(32, 4, 0),
    }
    rows: list[dict[str, Any]] = []  # JSON records of the report
    topologies: dict[int, Topology] = {}
    for racks in sizes:
        nodes = synthetic_nodes(racks)
        started = time.perf_counter()
        topology = parse_topology(nodes)
        parse_s = time.perf_counter() - started
        topologies[racks] = topology
        gpus = sum(tray.gpus for tray in topology.trays)
        for label, decode in shapes.items():
            shape = DeploymentShape("flash", racks, decode, PrefillShape(2, None))
            seconds, plan = _timed(shape, topology, None, repeats)
            use = _use(plan, topology)
            rows.append(
                {
                    "racks": racks,
                    "gpus": gpus,
                    "shape": label,
                    "cells_placed": len(plan.cells),
                    "parse_s": parse_s,
                    "plan_s": seconds,
                    **use,
                    "use_running": (use["decode_gpus"] + use["prefill_gpus"]) / gpus,
                    "use_with_spares": sum(use.values()) / gpus,
                }
            )
    print(
        f"{'racks':>6} {'GPUs':>7} {'shape':>9} {'cells':>6} {'parse s':>8} {'plan ms':>8} "
        f"{'decode':>7} {'prefill':>8} {'spare':>6} {'running':>8} {'+spares':>8}"
    )
    for row in rows:
        print(
            f"{row['racks']:>6} {row['gpus']:>7} {row['shape']:>9} {row['cells_placed']:>6} "
            f"{row['parse_s']:>8.3f} {row['plan_s'] * 1000:>8.1f} {row['decode_gpus']:>7} "
            f"{row['prefill_gpus']:>8} {row['spare_gpus']:>6} {row['use_running']:>8.1%} "
            f"{row['use_with_spares']:>8.1%}"
        )

    largest = sizes[-1]
    topology = topologies[largest]
    shape = DeploymentShape("flash", largest, DecodeShape(32, 4, 1), PrefillShape(2, None))
    before = plan_placement([shape], topology)
    victim = before.cells[len(before.cells) // 2].decode_trays[3]
    failed = parse_topology(synthetic_nodes(largest, failed=[victim]))
    replan_s, after = _timed(shape, failed, before, repeats)
    unchanged_s, same = _timed(shape, topology, before, repeats)
    replan: dict[str, Any] = {
        "racks": largest,
        "failed_tray": victim,
        "replan_after_failure_s": replan_s,
        "moved": [f"{m.pod}: {m.source} -> {m.target}" for m in after.moved],
        "restarted": list(after.restarted),
        "replan_unchanged_s": unchanged_s,
        "unchanged_moves": len(same.moved),
    }
    print(
        f"re-plan of {largest} racks after {victim} failed: {replan_s * 1000:.1f} ms; "
        f"moved {', '.join(replan['moved']) or 'nothing'}; restarted "
        f"{', '.join(after.restarted) or 'nothing'}"
    )
    print(f"re-plan of {largest} racks with nothing changed: {unchanged_s * 1000:.1f} ms")

    top = [row for row in rows if row["racks"] == largest]
    healthy_full = all(row["use_with_spares"] == 1.0 for row in rows)
    met = {
        "plan_largest_within_target": all(row["plan_s"] <= PLAN_TARGET_S for row in top),
        "replan_within_target": replan_s <= REPLAN_TARGET_S,
        "every_gpu_of_a_healthy_rack_used": healthy_full,
    }
    print(
        f"targets: plan {largest} racks <= {PLAN_TARGET_S:.0f} s: "
        f"{'met' if met['plan_largest_within_target'] else 'MISSED'}; re-plan <= "
        f"{REPLAN_TARGET_S * 1000:.0f} ms: {'met' if met['replan_within_target'] else 'MISSED'}; "
        f"every GPU used: {'met' if healthy_full else 'MISSED'}",
        flush=True,
    )
    return {
        "benchmark": "placement",
        "repeats": repeats,
        "rows": rows,
        "replan": replan,
        "targets": {"plan_s": PLAN_TARGET_S, "replan_s": REPLAN_TARGET_S},
        "met": met,
    }
