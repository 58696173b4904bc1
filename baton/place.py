"""``baton place``: a dry run of cell placement on NVL72 trays.

``baton place --nodes FILE --deployment FILE [--current FILE] [--format text|json|svg]`` reads
a Kubernetes NodeList (``kubectl get nodes -o yaml`` or ``-o json``), one or more
ModelDeployment manifests and, optionally, the JSON plan of an earlier run, then prints what
``controller.placement`` decides: a rack map (text), the plan (json) or a picture of the racks
(svg). The JSON plan is also what ``--current`` reads, so a run can be replayed after nodes fail.

Exit status: 0 when every cell is placed, 1 when a cell does not fit (the InsufficientCapacity
reason is printed), 2 when a file or flag is wrong (the message names the file, the field and
the fix). The ModelDeployment model here is the minimum placement needs; everything but
``spec.model`` defaults to the study's shape: one cell of DEP32 decode, one spare tray and as
many DEP2 prefill instances as fit.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    ValidationError,
    model_validator,
)

from baton.core.api import ModelDeployment
from baton.core.files import describe_errors
from controller.names import decode_pod_name, prefill_pod_name
from controller.placement import (
    CellPlacement,
    DeploymentShape,
    Plan,
    PrefillInstance,
    plan_placement,
)
from controller.topology import Topology, TopologyError, Tray, parse_topology

__all__ = [
    "PlaceError",
    "load_deployment",
    "main",
    "plan_to_json",
    "render_svg",
    "render_text",
]

LEGEND = {
    "D": "decode",
    "P": "prefill",
    "S": "spare",
    "o": "other pods",
    ".": "free",
    "-": "free, unschedulable",
    "X": "failed (not Ready, no domain)",
    "Q": "quarantined",
}
_COLOURS = {
    "D": "#3b6fb6",
    "P": "#3a9d5d",
    "S": "#e8b21c",
    "o": "#9a9a9a",
    ".": "#ffffff",
    "-": "#e4e4e4",
    "X": "#cc3b3b",
    "Q": "#8a5cb8",
}
_NODES_FIX = "fix: pass the output of `kubectl get nodes -o yaml` (or -o json)"
_DEPLOYMENT_FIX = "fix: see the ModelDeployment fields in docs/placement.md"
_CURRENT_FIX = "fix: pass a plan written by `baton place --format json`"


class PlaceError(ValueError):
    """A flag or input file is wrong; the message names the file, the field and the fix."""


# --- the plan as JSON (written by --format json, read by --current) ----------------------------


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _PodRecord(_Lenient):
    tray: str
    gpus: list[NonNegativeInt] = Field(min_length=1)
    instance: NonNegativeInt | None = None


class _CellRecord(_Lenient):
    name: str
    deployment: str
    domain: str
    decode: list[_PodRecord]
    prefill: list[_PodRecord]
    spare_trays: list[str] = Field(alias="spareTrays")
    max_prefill_instances: int = Field(default=0, alias="maxPrefillInstances")

    @model_validator(mode="after")
    def _instances_once(self) -> _CellRecord:
        indices = [pod.instance for pod in self.prefill if pod.instance is not None]
        if len(indices) != len(set(indices)):
            raise ValueError("a prefill instance index appears twice")
        return self


class _PlanRecord(_Lenient):
    cells: list[_CellRecord]


def _cell_from_record(record: _CellRecord) -> CellPlacement:
    prefill = []
    for position, pod in enumerate(record.prefill):
        index = position if pod.instance is None else pod.instance
        prefill.append(PrefillInstance(index, pod.tray, tuple(pod.gpus)))
    return CellPlacement(
        name=record.name,
        deployment=record.deployment,
        domain=record.domain,
        decode_trays=tuple(pod.tray for pod in record.decode),
        prefill=tuple(sorted(prefill, key=lambda instance: instance.index)),
        spare_trays=tuple(record.spare_trays),
        max_prefill_instances=record.max_prefill_instances,
    )


def _gpu_marks(plan: Plan, topology: Topology) -> dict[str, tuple[str, str]]:
    """Per tray: one letter per GPU (see LEGEND) and what the tray does, for the maps."""
    roles: dict[str, str] = {}
    letters: dict[str, list[str]] = {}
    for cell in plan.cells:
        for index, name in enumerate(cell.decode_trays):
            tray = topology.tray(name)
            gpus = tray.gpus if tray else 0
            ranks = f"ranks {index * gpus}-{index * gpus + gpus - 1}"
            roles[name] = f"{cell.name} decode {index} ({ranks})"
            letters[name] = ["D"] * gpus
        for name in cell.spare_trays:
            tray = topology.tray(name)
            roles[name] = f"{cell.name} spare"
            letters[name] = ["S"] * (tray.gpus if tray else 0)
        by_tray: dict[str, list[PrefillInstance]] = {}
        for instance in cell.prefill:
            by_tray.setdefault(instance.tray, []).append(instance)
        for name, instances in by_tray.items():
            tray = topology.tray(name)
            marks = letters.setdefault(name, ["."] * (tray.gpus if tray else 0))
            for instance in instances:
                for gpu in instance.gpus:
                    marks[gpu] = "P"
            indices = ", ".join(str(instance.index) for instance in instances)
            roles[name] = f"{cell.name} prefill {indices}"
    result: dict[str, tuple[str, str]] = {}
    for tray in topology.trays:
        if tray.quarantined:
            marks = ["Q"] * tray.gpus
        elif not tray.keeps_pods:
            marks = ["X"] * tray.gpus
        else:
            marks = letters.get(tray.name, ["."] * tray.gpus)
            others = tray.used_by_others
            # Others' GPUs are drawn on the highest indices Baton does not hold.
            for gpu in reversed(range(tray.gpus)):
                if others and marks[gpu] == ".":
                    marks[gpu], others = "o", others - 1
            if not tray.schedulable:
                marks = ["-" if mark == "." else mark for mark in marks]
        result[tray.name] = ("".join(marks), roles.get(tray.name, ""))
    return result


def _gpu_totals(marks: dict[str, tuple[str, str]]) -> dict[str, int]:
    text = "".join(letters for letters, _ in marks.values())
    return {
        "gpus": len(text),
        "decode": text.count("D"),
        "prefill": text.count("P"),
        "spare": text.count("S"),
        "other": text.count("o"),
        "free": text.count(".") + text.count("-"),
        "unavailable": text.count("X") + text.count("Q"),
    }


def plan_to_json(plan: Plan, topology: Topology) -> dict[str, object]:
    """The plan as ``--format json`` prints it and ``--current`` reads it back."""
    marks = _gpu_marks(plan, topology)
    cells = []
    for cell in plan.cells:
        decode = []
        for index, name in enumerate(cell.decode_trays):
            tray = topology.tray(name)
            gpus = list(range(tray.gpus if tray else 0))
            ranks = [index * len(gpus) + gpu for gpu in gpus]
            pod = decode_pod_name(cell.name, index)
            decode.append({"pod": pod, "tray": name, "gpus": gpus, "ranks": ranks})
        prefill = [
            {
                "pod": prefill_pod_name(cell.name, instance.index),
                "instance": instance.index,
                "tray": instance.tray,
                "gpus": list(instance.gpus),
            }
            for instance in cell.prefill
        ]
        cells.append(
            {
                "name": cell.name,
                "deployment": cell.deployment,
                "domain": cell.domain,
                "decode": decode,
                "prefill": prefill,
                "spareTrays": list(cell.spare_trays),
                "maxPrefillInstances": cell.max_prefill_instances,
            }
        )
    return {
        "feasible": plan.feasible,
        "gpus": _gpu_totals(marks),
        "cells": cells,
        "unplaced": [
            {
                "cell": cell.name,
                "deployment": cell.deployment,
                "reason": str(cell.reason),
                "message": cell.message,
                "domains": list(cell.domains),
            }
            for cell in plan.unplaced
        ],
        "moved": [{"pod": m.pod, "from": m.source, "to": m.target} for m in plan.moved],
        "restarted": list(plan.restarted),
        "trays": [
            {
                "name": tray.name,
                "domain": tray.domain,
                "rack": tray.rack,
                "slot": tray.slot,
                "gpus": marks[tray.name][0],
                "role": marks[tray.name][1],
            }
            for tray in topology.trays
        ],
    }


def _trays_by_domain(topology: Topology) -> list[tuple[str, str, list[Tray]]]:
    """(long title, short title, trays) per NVLink domain, then the trays without one."""
    groups = [
        (
            f"NVLink domain {d.name} (rack {d.rack})",
            f"rack {d.rack}, clique {d.name.rsplit('.', 1)[-1]}",
            list(d.trays),
        )
        for d in topology.domains
    ]
    unlabelled = [tray for tray in topology.trays if tray.domain is None]
    if unlabelled:
        groups.append(("no NVLink domain label (not eligible)", "no NVLink domain", unlabelled))
    return groups


def _cell_summary(cell: CellPlacement, topology: Topology, shape: DeploymentShape | None) -> str:
    tray = topology.tray(cell.decode_trays[0]) if cell.decode_trays else None
    decode = len(cell.decode_trays) * (tray.gpus if tray else 0)
    prefill = f"{len(cell.prefill)}"
    spares = f"{len(cell.spare_trays)}"
    if shape is not None:
        decode = shape.decode.dep
        if shape.prefill.instances is not None:
            prefill += f" of {shape.prefill.instances}"
        spares += f" of {shape.decode.spare_trays}"
    dep = f" DEP{len(cell.prefill[0].gpus)}" if cell.prefill else ""
    return (
        f"decode DEP{decode} on {len(cell.decode_trays)} trays  prefill {prefill}{dep} "
        f"(max {cell.max_prefill_instances})  spare {spares}"
    )


def render_text(plan: Plan, topology: Topology, shapes: Sequence[DeploymentShape] = ()) -> str:
    """A rack map, one row per tray, then cells, unplaced cells and changes.

    With the deployments' ``shapes``, each cell's line also says what it asked for.
    """
    marks = _gpu_marks(plan, topology)
    totals = _gpu_totals(marks)
    wanted = len(plan.cells) + len(plan.unplaced)
    lines = [
        f"{len(plan.cells)} of {wanted} cells placed; GPUs: {totals['gpus']} total, "
        f"{totals['decode']} decode, {totals['prefill']} prefill, {totals['spare']} spare, "
        f"{totals['other']} other, {totals['free']} free, {totals['unavailable']} unavailable"
    ]
    width = max((len(tray.name) for tray in topology.trays), default=4)
    for title, _, trays in _trays_by_domain(topology):
        lines += ["", title, f"  slot  {'tray':<{width}}  GPUs  role"]
        for tray in trays:
            letters, role = marks[tray.name]
            lines.append(f"  {tray.slot:>4}  {tray.name:<{width}}  {letters:<4}  {role}".rstrip())
    if plan.cells:
        lines += ["", "cells"]
    by_name = {shape.name: shape for shape in shapes}
    for cell in plan.cells:
        summary = _cell_summary(cell, topology, by_name.get(cell.deployment))
        lines.append(f"  {cell.name}  domain {cell.domain}  {summary}")
    if plan.unplaced:
        lines += ["", "unplaced"]
    for unplaced in plan.unplaced:
        lines.append(f"  {unplaced.name}: {unplaced.reason}: {unplaced.message}")
        lines += [f"    {line}" for line in unplaced.domains]
    if plan.moved:
        lines += ["", "moved"]
        lines += [f"  {move.pod}: {move.source} -> {move.target}" for move in plan.moved]
    if plan.restarted:
        lines += ["", f"decode groups restarted: {', '.join(plan.restarted)}"]
    legend = "  ".join(f"{letter} {meaning}" for letter, meaning in LEGEND.items())
    lines += ["", f"legend: {legend}"]
    return "\n".join(lines) + "\n"


def render_svg(plan: Plan, topology: Topology) -> str:
    """The racks as a picture: one column per NVLink domain, one row of GPU squares per tray."""
    marks = _gpu_marks(plan, topology)
    cell_of = {name: cell.name for cell in plan.cells for name in _cell_trays(cell)}
    groups = _trays_by_domain(topology)
    square, step, column, per_row = 14, 16, 240, 8
    block = 44 + max((len(trays) for _, _, trays in groups), default=0) * step
    width = 20 + column * min(per_row, max(len(groups), 2))
    height = 100 + block * -(-len(groups) // per_row)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="monospace" font-size="10">',
        f'<rect width="{width}" height="{height}" fill="#fafafa"/>',
    ]
    for position, (letter, meaning) in enumerate(LEGEND.items()):
        x, y = 10 + (position % 2) * column, 10 + (position // 2) * step
        out += [_square(x, y, letter, square), _text(x + square + 4, y + 11, meaning)]
    for index, (title, short, trays) in enumerate(groups):
        left, top = 10 + (index % per_row) * column, 84 + (index // per_row) * block
        cells = sorted({cell_of[tray.name] for tray in trays if tray.name in cell_of})
        out.append(f"<g><title>{html.escape(title)}</title>")
        out.append(_text(left, top + 12, short, bold=True))
        out.append(_text(left, top + 26, ", ".join(cells) or "no cell"))
        for row, tray in enumerate(trays):
            y = top + 34 + row * step
            letters = marks[tray.name][0]
            for gpu, letter in enumerate(letters):
                out.append(_square(left + gpu * step, y, letter, square))
            out.append(_text(left + max(len(letters), 4) * step + 6, y + 11, tray.name))
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _text(x: int, y: int, content: str, *, bold: bool = False) -> str:
    weight = ' font-weight="bold"' if bold else ""
    return f'<text x="{x}" y="{y}"{weight}>{html.escape(content)}</text>'


def _square(x: int, y: int, letter: str, size: int) -> str:
    return (
        f'<rect x="{x}" y="{y}" width="{size}" height="{size}" fill="{_COLOURS[letter]}" '
        f'stroke="#555" stroke-width="0.5"><title>{html.escape(LEGEND[letter])}</title></rect>'
    )


def _cell_trays(cell: CellPlacement) -> set[str]:
    return {*cell.decode_trays, *cell.spare_trays, *(i.tray for i in cell.prefill)}


# --- files and the command --------------------------------------------------------------------


def _documents(path: Path, what: str) -> list[object]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlaceError(f"{path}: cannot read the {what} ({exc.strerror})") from exc
    if text.lstrip().startswith(("{", "[")):
        try:
            return [json.loads(text)]
        except json.JSONDecodeError:
            pass  # YAML flow style also starts with a brace; let the YAML parser judge
    try:
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        return [doc for doc in yaml.load_all(text, Loader=loader) if doc is not None]
    except yaml.YAMLError as exc:
        raise PlaceError(f"{path}: not valid YAML or JSON ({exc})") from exc


def _load_deployments(path: Path) -> list[ModelDeployment]:
    documents = _documents(path, "ModelDeployment file")
    items: list[object] = []
    for document in documents:
        if isinstance(document, dict) and document.get("kind") == "List":
            items += document.get("items") or []
        else:
            items.append(document)
    if not items:
        raise PlaceError(f"{path}: no ModelDeployment in the file; {_DEPLOYMENT_FIX}")
    deployments = []
    for index, item in enumerate(items):
        where = f"{path}" if len(items) == 1 else f"{path}: document {index}"
        try:
            deployments.append(ModelDeployment.model_validate(item))
        except ValidationError as exc:
            raise PlaceError(f"{where}: {describe_errors(exc)}; {_DEPLOYMENT_FIX}") from exc
    names = [DeploymentShape.of(deployment).name for deployment in deployments]
    if len(set(names)) != len(names):
        raise PlaceError(f"{path}: two ModelDeployments share a name; fix: give each metadata.name")
    topologies = {(d.spec.topology.domain_label, d.spec.topology.gpu_resource) for d in deployments}
    if len(topologies) > 1:
        raise PlaceError(
            f"{path}: field 'spec.topology': deployments disagree on domainLabel/gpuResource; "
            "fix: use one node labelling for all"
        )
    return deployments


def load_deployment(path: Path) -> DeploymentShape:
    """The one ModelDeployment in ``path``, as placement sees it; raises ``PlaceError``."""
    deployments = _load_deployments(path)
    if len(deployments) > 1:
        raise PlaceError(f"{path}: expected one ModelDeployment, found {len(deployments)}")
    return DeploymentShape.of(deployments[0])


def _load_topology(path: Path, domain_label: str, gpu_resource: str) -> Topology:
    documents = _documents(path, "node list")
    if len(documents) != 1:
        raise PlaceError(
            f"{path}: expected one node list, found {len(documents)} documents; {_NODES_FIX}"
        )
    try:
        return parse_topology(documents[0], domain_label=domain_label, gpu_resource=gpu_resource)
    except TopologyError as exc:
        raise PlaceError(f"{path}: {exc}; {_NODES_FIX}") from exc


def _load_plan(path: Path) -> Plan:
    documents = _documents(path, "current plan")
    if len(documents) != 1:
        raise PlaceError(f"{path}: expected one plan, found {len(documents)}; {_CURRENT_FIX}")
    try:
        record = _PlanRecord.model_validate(documents[0])
    except ValidationError as exc:
        raise PlaceError(f"{path}: {describe_errors(exc)}; {_CURRENT_FIX}") from exc
    return Plan(tuple(_cell_from_record(cell) for cell in record.cells))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baton place", description="Dry-run placement of cells on NVL72 trays."
    )
    parser.add_argument("--nodes", type=Path, required=True, help="kubectl get nodes -o yaml|json")
    parser.add_argument(
        "--deployment", type=Path, required=True, help="ModelDeployment manifest(s), YAML"
    )
    parser.add_argument("--current", type=Path, help="a plan from --format json, to re-plan")
    parser.add_argument("--format", choices=["text", "json", "svg"], default="text")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse has printed the usage error
        return int(exc.code or 0)
    try:
        deployments = _load_deployments(args.deployment)
        topology_spec = deployments[0].spec.topology
        topology = _load_topology(
            args.nodes, topology_spec.domain_label, topology_spec.gpu_resource
        )
        current = _load_plan(args.current) if args.current else None
    except PlaceError as exc:
        print(f"baton place: {exc}", file=sys.stderr)
        return 2
    shapes = [DeploymentShape.of(deployment) for deployment in deployments]
    plan = plan_placement(shapes, topology, current)
    if args.format == "json":
        sys.stdout.write(json.dumps(plan_to_json(plan, topology), indent=2) + "\n")
    elif args.format == "svg":
        sys.stdout.write(render_svg(plan, topology))
    else:
        sys.stdout.write(render_text(plan, topology, shapes))
    if plan.feasible:
        return 0
    if args.format != "text":  # the text map already lists them
        for cell in plan.unplaced:
            print(f"baton place: {cell.name}: {cell.reason}: {cell.message}", file=sys.stderr)
    return 1
