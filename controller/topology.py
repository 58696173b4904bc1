"""The NVL72 topology as placement sees it: trays, their GPUs and their NVLink domains.

This module decides what a Kubernetes Node means for placement; it reads no files and calls no
API. Input is what ``kubectl get nodes -o yaml`` (or ``-o json``) prints: a NodeList, a List, a
list of Nodes or one Node. A simpler form, ``{trays: [{name, domain, gpus, ready, schedulable,
quarantined, usedByOthers}]}``, carries the same facts for hand-written examples.

What a Node becomes:

- A node is a tray when it carries the clique label or a GPU count in ``status.allocatable``;
  other nodes (control plane, CPU pools) are skipped.
- Its NVLink domain is the value of ``nvidia.com/gpu.clique`` (``<ClusterUUID>.<CliqueID>``).
  A tray without it is not eligible: GPU feature discovery drops the label when the tray's
  fabric is not healthy, so a missing label means "broken", never "a domain of its own".
- GPUs come from ``status.allocatable["nvidia.com/gpu"]`` (4 on a GB300 tray; fewer when the
  device plugin withholds a bad GPU). GPUs held by pods Baton does not own come from the
  annotation ``baton.dev/gpus-used-by-others`` or from a mapping given by the caller, which wins.
- Ready is the node's Ready condition. A tray is schedulable unless cordoned
  (``spec.unschedulable``) or tainted NoSchedule/NoExecute with a key other than
  ``nvidia.com/gpu`` (the one taint every Baton pod tolerates); a NoExecute taint also evicts the
  pods already there. Those taints and the node's labels are kept, so that placement can use a
  tainted tray for a deployment that tolerates its taints, and only the trays a deployment's
  node selector names. ``baton.dev/quarantined`` (any value but "false") quarantines a tray.
- ``baton.dev/degraded`` (any value but "false": why) marks a tray that holds back the decode
  group on it: it takes no new pods, and keeps the ones it has until the group moves
  (``controller.cell``); ``baton.dev/degraded-since`` and ``-slowdown`` say since when and how
  much, where the straggler watch (``controller.stragglers``) marked it.

Racks are told apart by the ClusterUUID part of the clique value; one rack may hold several
domains when Fabric Manager splits it (e.g. two x36 cliques). Rack and slot indices exist for
display only: racks are numbered in the natural order of their first tray name, trays in natural
name order within their rack. Every ordering here is a function of the trays alone, never of the
order nodes arrive in, so the same cluster always gives the same ``Topology``.
"""

from __future__ import annotations

import random
import re
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from baton.core.files import describe_errors
from baton.core.labels import (
    CLIQUE_LABEL,
    DEGRADED_ANNOTATION,
    DEGRADED_SINCE_ANNOTATION,
    DEGRADED_SLOWDOWN_ANNOTATION,
    GPU_COUNT_LABEL,
    GPU_PRODUCT_LABEL,
    GPU_RESOURCE,
    GPU_TAINT_KEY,
    GPUS_USED_BY_OTHERS_ANNOTATION,
    HOSTNAME_LABEL,
    QUARANTINED_ANNOTATION,
)

__all__ = [
    "Degradation",
    "NVLinkDomain",
    "Topology",
    "TopologyError",
    "Tray",
    "TrayTaint",
    "parse_topology",
    "synthetic_nodes",
    "synthetic_topology",
    "topology_from_trays",
    "tray_degradation",
    "tray_name",
]

_BLOCKING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})


class TopologyError(ValueError):
    """The node data is not what ``kubectl get nodes`` prints; the message names the field."""


@dataclass(frozen=True, slots=True)
class TrayTaint:
    """A NoSchedule or NoExecute taint of a tray (a node's ``spec.taints`` entry)."""

    key: str
    value: str
    effect: str


@dataclass(frozen=True, slots=True)
class Degradation:
    """Why a tray holds back the decode group on it; ``since`` and ``slowdown`` (how many times
    as long the group's steps take) are None where an operator marked it by hand."""

    why: str
    since: datetime | None = None
    slowdown: float | None = None


@dataclass(frozen=True, slots=True)
class Tray:
    """One compute tray (a Kubernetes node) and the facts placement needs about it.

    ``domain`` is the NVLink domain (clique label value), ``None`` when the label is missing.
    ``rack`` and ``slot`` are display indices set by ``topology_from_trays`` (-1 until then, and
    ``rack`` stays -1 for a tray without a domain).
    """

    name: str
    domain: str | None
    gpus: int
    ready: bool = True
    schedulable: bool = True
    quarantined: bool = False
    used_by_others: int = 0
    evicts_pods: bool = False
    rack: int = -1
    slot: int = -1
    cordoned: bool = False
    labels: tuple[tuple[str, str], ...] = ()
    taints: tuple[TrayTaint, ...] = ()  # the blocking ones, nvidia.com/gpu's aside
    degraded: Degradation | None = None

    @property
    def eligible(self) -> bool:
        """New pods may be placed here."""
        return (
            self.domain is not None
            and self.ready
            and self.schedulable
            and not self.quarantined
            and self.degraded is None
        )

    @property
    def keeps_pods(self) -> bool:
        """Pods already here keep running (a cordoned tray keeps its pods; a failed one not)."""
        return (
            self.domain is not None and self.ready and not self.quarantined and not self.evicts_pods
        )

    @property
    def free_gpus(self) -> int:
        """GPUs not held by pods Baton does not own."""
        return self.gpus - self.used_by_others

    @property
    def trouble(self) -> str | None:
        """Why new pods may not come here, in an operator's words; None when they may."""
        if not self.ready:
            return "not ready"
        if self.quarantined:
            return "quarantined"
        if not self.schedulable:
            return "cordoned"
        if self.degraded is not None:
            return "degraded"
        if self.domain is None:
            return "no NVLink domain label"
        return None


@dataclass(frozen=True, slots=True)
class NVLinkDomain:
    """One clique: the trays whose GPUs share an NVLink fabric partition, in slot order."""

    name: str
    rack: int
    trays: tuple[Tray, ...]


@dataclass(frozen=True, slots=True)
class Topology:
    """All trays (by rack, then slot; trays without a domain last) and all NVLink domains."""

    trays: tuple[Tray, ...]
    domains: tuple[NVLinkDomain, ...]
    _trays_by_name: dict[str, Tray] = field(init=False, repr=False, compare=False)
    _domains_by_name: dict[str, NVLinkDomain] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_trays_by_name", {tray.name: tray for tray in self.trays})
        object.__setattr__(self, "_domains_by_name", {d.name: d for d in self.domains})
        if len(self._trays_by_name) != len(self.trays):
            names = Counter(tray.name for tray in self.trays)
            twice = next(name for name, times in names.items() if times > 1)
            raise TopologyError(f"two trays are named '{twice}'; node names must be unique")

    def tray(self, name: str) -> Tray | None:
        return self._trays_by_name.get(name)

    def domain(self, name: str) -> NVLinkDomain | None:
        return self._domains_by_name.get(name)

    def trouble(self, name: str) -> str | None:
        """Why new pods may not come to tray ``name`` (``removed`` when it is gone)."""
        tray = self.tray(name)
        return "removed" if tray is None else tray.trouble

    def troubles(self, domain: str) -> str:
        """The domain's trays that take no new pods, by why: "1 tray not ready (t3); ..."."""
        found = self.domain(domain)
        by_why: dict[str, list[str]] = {}
        for tray in found.trays if found else ():
            if tray.trouble is not None:
                by_why.setdefault(tray.trouble, []).append(tray.name)
        return "; ".join(
            f"{len(names)} tray{'' if len(names) == 1 else 's'} {why} ({', '.join(names)})"
            for why, names in by_why.items()
        )


def _natural_key(name: str) -> tuple[str | int, ...]:
    # "tray-2" before "tray-10"; re.split alternates text and digits, so keys always compare.
    return tuple(int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", name)))


def _rack_of(domain: str) -> str:
    return domain.rsplit(".", 1)[0]


def topology_from_trays(trays: Iterable[Tray]) -> Topology:
    """Number racks and slots and group trays into NVLink domains (input order is irrelevant)."""
    by_rack: dict[str, list[Tray]] = {}
    unlabelled: list[Tray] = []
    for tray in trays:
        if tray.domain is None:
            unlabelled.append(tray)
        else:
            by_rack.setdefault(_rack_of(tray.domain), []).append(tray)
    for members in by_rack.values():
        members.sort(key=lambda tray: _natural_key(tray.name))
    racks = sorted(by_rack.values(), key=lambda members: _natural_key(members[0].name))
    ordered = [
        replace(tray, rack=rack, slot=slot)
        for rack, members in enumerate(racks)
        for slot, tray in enumerate(members)
    ]
    unlabelled.sort(key=lambda tray: _natural_key(tray.name))
    ordered += [replace(tray, rack=-1, slot=slot) for slot, tray in enumerate(unlabelled)]
    by_domain: dict[str, list[Tray]] = {}
    for tray in ordered:
        if tray.domain is not None:
            by_domain.setdefault(tray.domain, []).append(tray)
    domains = sorted(
        (
            NVLinkDomain(name, members[0].rack, tuple(members))
            for name, members in by_domain.items()
        ),
        key=lambda domain: (domain.rack, _natural_key(domain.name)),
    )
    return Topology(tuple(ordered), tuple(domains))


# --- Kubernetes Node objects (untrusted input: only the fields placement reads) ---------------


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Metadata(_Lenient):
    name: str
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class _Taint(_Lenient):
    key: str = ""
    value: str = ""
    effect: str = ""


class _NodeSpec(_Lenient):
    unschedulable: bool = False
    taints: list[_Taint] = Field(default_factory=list)


class _Condition(_Lenient):
    type: str
    status: str


class _NodeStatus(_Lenient):
    allocatable: dict[str, str | int] = Field(default_factory=dict)
    conditions: list[_Condition] = Field(default_factory=list)


class _Node(_Lenient):
    metadata: _Metadata
    spec: _NodeSpec = Field(default_factory=_NodeSpec)
    status: _NodeStatus = Field(default_factory=_NodeStatus)


class _SimpleTray(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str
    domain: str | None = None
    gpus: int = Field(default=4, ge=0)
    ready: bool = True
    schedulable: bool = True
    quarantined: bool = False
    used_by_others: int = Field(default=0, ge=0, alias="usedByOthers")


class _SimpleTopology(BaseModel):
    model_config = ConfigDict(extra="forbid")

    trays: list[_SimpleTray]


def _whole_number(value: str | int, what: str) -> int:
    text = str(value).strip()
    if not text.isdigit():
        raise TopologyError(f"{what}: '{value}' is not a whole number of GPUs")
    return int(text)


def _tray_from_node(
    node: _Node, used_by_others: Mapping[str, int], domain_label: str, gpu_resource: str
) -> Tray | None:
    meta = node.metadata
    domain = meta.labels.get(domain_label) or None
    allocatable = node.status.allocatable.get(gpu_resource)
    if domain is None and allocatable is None:
        return None
    gpus = 0
    if allocatable is not None:
        gpus = _whole_number(allocatable, f"field 'status.allocatable.{gpu_resource}'")
    if meta.name in used_by_others:
        others = used_by_others[meta.name]
    else:
        others = _whole_number(
            meta.annotations.get(GPUS_USED_BY_OTHERS_ANNOTATION, "0"),
            f"annotation '{GPUS_USED_BY_OTHERS_ANNOTATION}'",
        )
    blocking = [
        taint
        for taint in node.spec.taints
        if taint.effect in _BLOCKING_EFFECTS and taint.key != GPU_TAINT_KEY
    ]
    quarantine = meta.annotations.get(QUARANTINED_ANNOTATION)
    return Tray(
        name=meta.name,
        domain=domain,
        gpus=gpus,
        ready=any(c.type == "Ready" and c.status == "True" for c in node.status.conditions),
        schedulable=not node.spec.unschedulable and not blocking,
        cordoned=node.spec.unschedulable,
        labels=tuple(sorted(meta.labels.items())),
        taints=tuple(TrayTaint(t.key, t.value, t.effect) for t in blocking),
        quarantined=quarantine is not None and quarantine.strip().lower() != "false",
        # More GPUs than the tray has would be a stale count; the tray is simply full.
        used_by_others=min(max(others, 0), gpus),
        evicts_pods=any(taint.effect == "NoExecute" for taint in blocking),
        degraded=tray_degradation(meta.annotations),
    )


def tray_degradation(annotations: Mapping[str, str]) -> Degradation | None:
    """The tray's ``baton.dev/degraded`` marks; a since or slowdown that does not parse counts
    as absent (as if marked by hand: the group moves on its turn)."""
    why = annotations.get(DEGRADED_ANNOTATION)
    if why is None or why.strip().lower() == "false":
        return None
    since: datetime | None = None
    with suppress(ValueError):
        since = datetime.fromisoformat(annotations.get(DEGRADED_SINCE_ANNOTATION, ""))
    if since is not None and since.tzinfo is None:
        since = None
    slowdown: float | None = None
    with suppress(ValueError):
        slowdown = float(annotations.get(DEGRADED_SLOWDOWN_ANNOTATION, ""))
    if slowdown is not None and not slowdown >= 1.0:  # NaN too
        slowdown = None
    return Degradation(why.strip() or "marked degraded", since, slowdown)


def _node_items(data: object) -> list[object]:
    if isinstance(data, list):
        return data
    if isinstance(data, Mapping):
        if data.get("kind") == "Node":
            return [data]
        items = data.get("items")
        if isinstance(items, list):
            return items
    raise TopologyError(
        "not a node list: expected a NodeList or List with 'items', a list of Nodes, one Node, "
        "or {trays: [...]}; fix: kubectl get nodes -o yaml > nodes.yaml"
    )


def parse_topology(
    data: object,
    *,
    used_by_others: Mapping[str, int] | None = None,
    domain_label: str = CLIQUE_LABEL,
    gpu_resource: str = GPU_RESOURCE,
) -> Topology:
    """Trays and NVLink domains from parsed YAML/JSON (Node objects or the simple form).

    ``used_by_others`` maps tray names to GPUs held by pods Baton does not own; it overrides the
    annotation. Raises ``TopologyError`` naming the item and field of the first problem.
    """
    others = dict(used_by_others or {})
    if isinstance(data, Mapping) and "trays" in data:
        try:
            simple = _SimpleTopology.model_validate(data)
        except ValidationError as exc:
            raise TopologyError(describe_errors(exc)) from exc
        return topology_from_trays(
            Tray(
                name=t.name,
                domain=t.domain,
                gpus=t.gpus,
                ready=t.ready,
                schedulable=t.schedulable,
                quarantined=t.quarantined,
                used_by_others=min(others.get(t.name, t.used_by_others), t.gpus),
            )
            for t in simple.trays
        )
    trays: list[Tray] = []
    for index, item in enumerate(_node_items(data)):
        try:
            node = _Node.model_validate(item)
        except ValidationError as exc:
            raise TopologyError(f"item {index}: {describe_errors(exc)}") from exc
        try:
            tray = _tray_from_node(node, others, domain_label, gpu_resource)
        except TopologyError as exc:
            raise TopologyError(f"item {index} (node '{node.metadata.name}'): {exc}") from exc
        if tray is not None:
            trays.append(tray)
    return topology_from_trays(trays)


# --- synthetic racks (tests, benchmarks, the local stack) -------------------------------------


def tray_name(rack: int, slot: int) -> str:
    """The node name of a synthetic tray."""
    return f"rack-{rack}-tray-{slot}"


def synthetic_nodes(
    racks: int,
    *,
    trays_per_rack: int = 18,
    gpus_per_tray: int = 4,
    failed: Iterable[str] = (),
    partly_used: Mapping[str, int] | None = None,
    quarantined: Iterable[str] = (),
    split_cliques: int = 0,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Node objects of ``racks`` NVL72-like racks, as ``kubectl get nodes -o json`` lists them.

    Trays are named by ``tray_name``. ``failed`` trays are not Ready; ``partly_used`` gives GPUs
    held by others per tray; ``quarantined`` trays carry the quarantine annotation.
    ``split_cliques`` racks (chosen by ``seed``) are split by Fabric Manager into two cliques,
    the first half of their trays in one and the rest in the other. ClusterUUIDs come from
    ``seed`` too, so the same arguments always give the same nodes.
    """
    if not 0 <= split_cliques <= racks:
        raise ValueError(f"split_cliques must be within 0..{racks}, got {split_cliques}")
    rng = random.Random(seed)
    cluster_uuids = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(racks)]
    split = set(rng.sample(range(racks), split_cliques))
    failed_set, quarantined_set = set(failed), set(quarantined)
    used = dict(partly_used or {})
    nodes: list[dict[str, Any]] = []
    for rack in range(racks):
        for slot in range(trays_per_rack):
            name = tray_name(rack, slot)
            clique = 2 if rack in split and slot >= trays_per_rack // 2 else 1
            annotations: dict[str, str] = {}
            if name in used:
                annotations[GPUS_USED_BY_OTHERS_ANNOTATION] = str(used[name])
            if name in quarantined_set:
                annotations[QUARANTINED_ANNOTATION] = "repeated Xid 149"
            ready = "False" if name in failed_set else "True"
            nodes.append(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": name,
                        "labels": {
                            CLIQUE_LABEL: f"{cluster_uuids[rack]}.{clique}",
                            GPU_COUNT_LABEL: str(gpus_per_tray),
                            GPU_PRODUCT_LABEL: "NVIDIA-GB300",
                            HOSTNAME_LABEL: name,
                        },
                        "annotations": annotations,
                    },
                    "spec": {"taints": [{"key": GPU_TAINT_KEY, "effect": "NoSchedule"}]},
                    "status": {
                        "capacity": {GPU_RESOURCE: str(gpus_per_tray)},
                        "allocatable": {GPU_RESOURCE: str(gpus_per_tray)},
                        "conditions": [{"type": "Ready", "status": ready}],
                    },
                }
            )
    return nodes


def synthetic_topology(
    racks: int,
    *,
    trays_per_rack: int = 18,
    gpus_per_tray: int = 4,
    failed: Iterable[str] = (),
    partly_used: Mapping[str, int] | None = None,
    quarantined: Iterable[str] = (),
    split_cliques: int = 0,
    seed: int = 0,
) -> Topology:
    """``synthetic_nodes`` parsed: the topology those Node objects describe."""
    nodes = synthetic_nodes(
        racks,
        trays_per_rack=trays_per_rack,
        gpus_per_tray=gpus_per_tray,
        failed=failed,
        partly_used=partly_used,
        quarantined=quarantined,
        split_cliques=split_cliques,
        seed=seed,
    )
    return parse_topology(nodes)
