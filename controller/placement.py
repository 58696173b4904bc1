"""Placement of cells on NVL72 trays: deployments + topology + current placement -> ``Plan``.

A cell is one decode group (DEP``d``: ``D = d / gpusPerPod`` pods, each taking one whole tray),
the prefill instances that feed it (DEP``p``: ``N`` instances, each ``p`` GPUs of one tray) and
``S`` spare trays held empty for the decode group's recovery, all in one NVLink domain. This
module decides which trays and GPUs each cell gets. It reads nothing and writes nothing: the
reconciler turns a ``Plan`` into pods, the CLI into a rack map.

A tray is *eligible* for a deployment when it has a domain label, is Ready, not quarantined nor
marked degraded (its pods stay; ``controller.cell`` moves its decode group), carries every
label of the deployment's node selector and is schedulable, or not cordoned and tainted only
with taints the deployment tolerates (``TraySelector``). It is *whole* for a shape when it is
eligible, has exactly ``gpusPerPod`` GPUs, none of them held by anyone. A *prefill slot* is
``p`` free GPUs of an eligible tray; a whole GB300 tray has two DEP2 slots.

Algorithm (``plan_placement``), in three steps:

1. Keep. Each cell of the current placement that is still wanted first claims the trays its
   pods are on (so that no other cell grows into them), then is repaired in its domain, in
   name order:
   a. a pod running on a tray that still keeps pods (Ready, not quarantined, not evicting, same
      domain, enough GPUs) stays where it is, on the same GPUs; a pod that is not running there
      (``unbound``: to be created again, or not yet bound by the scheduler) stays only while its
      tray accepts new pods, since a new pod never binds to a cordoned tray; a spare stays while
      its tray accepts new pods; prefill instances beyond the wanted count are dropped (highest
      indices);
   b. a decode rank whose tray failed (or, for a pod to be created again, no longer accepts new
      pods) is re-placed at the same rank onto the cell's spare tray,
      else a free whole tray of the domain, else a whole tray holding only the cell's own
      prefill (those instances move, as in d). The group restarts as a whole: a wide-EP group
      cannot lose a rank. If the group is still short, the domain can no longer hold the cell:
      the cell is released and admitted afresh (step 2);
   c. spares are topped up from free whole trays;
   d. prefill instances that lost their tray, then new ones up to the wanted count ("as many as
      fit" when none is given), take free slots: half-used trays first (fewest free GPUs
      first), then whole trays, in slot order. A running cell that finds too few slots keeps
      running with fewer instances; only admission is all-or-nothing.
2. Admit. Every other wanted cell goes, whole or not at all, to a domain hosting no cell, or,
   when its deployment shares domains (``spec.topology.exclusiveDomain: false``), to a domain
   whose cells' deployments all do, on trays no other cell holds: those first (packing leaves
   free domains to cells that need one alone), then free domains, then again domains to share
   (two new sharing cells in one free domain). A domain fits a shape when it has ``D + S``
   whole trays and, on its other eligible trays, ``N`` prefill slots (at least 1 when N is "as
   many as fit"). Cells are taken in deployment order, then cell index; each takes the first
   fitting domain in its shape's preference order:
   tightest fit for a fixed N (fewest slots left over), the most prefill slots for "as many as
   fit", ties by rack and domain order. A cell that finds none looks for an augmenting path
   (Kuhn's matching) through domains that other newly admitted cells hold, so as many new cells
   as possible are admitted; running cells keep their domains. In its domain a cell's decode
   group takes the first D whole trays in slot order, its spares the next S, and its prefill
   fills slots as in 1d.
3. Explain. A wanted cell left out gets ``InsufficientCapacity`` and, for every domain free of
   cells (and every domain it could share), what it lacked ("domain X: 6 of 9 whole trays free
   (8 decode + 1 spare), 3 of 18 prefill slots").

One cell per NVLink domain by default: IMEX ComputeDomains of two cells in one clique can fail
at the fabric (``cuMemSetAccess`` returning CUDA_ERROR_NOT_SUPPORTED, NVIDIA/k8s-dra-driver-gpu
#892), a fabric fault takes every cell of its rack down, and a DEP32 cell with its prefill fills
an NVL72 rack anyway. Smaller cells may share one when their deployments say so; no tray ever
holds pods of two cells (a node joins one ComputeDomain, NVIDIA/k8s-dra-driver-gpu#353).

Invariants (each checked in tests/unit/test_placement.py):

- A cell lies in one NVLink domain; a domain hosts several cells only if all their
  deployments share domains, and no tray holds pods of two cells. An admitted cell has its
  whole decode group, its S spares and its N prefill instances; a cell that does not fit has
  no pod anywhere.
- No tray holds more GPUs than it has, counting those held by others; decode pods and spares
  take whole trays; no pod is placed on a tray that is not eligible.
- Re-planning moves no running pod whose tray keeps pods and no unbound pod whose tray is
  eligible, except prefill instances on a tray their own
  decode group claimed (1b) and the pods of a cell released from its domain (1b).
- Prefill never takes a spare tray: spares are topped up before prefill scales up.
- The largest prefill count that still fits is reported per cell.
- The plan is a function of its inputs: no clock, no randomness, every tie broken by name, rack
  or slot order, never by input order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import count

from baton.core.api import ModelDeployment, Reason, Toleration, decode_trays_problem
from controller.names import cell_name, decode_pod_name, prefill_pod_name
from controller.topology import NVLinkDomain, Topology, Tray, TrayTaint

__all__ = [
    "CellPlacement",
    "DecodeShape",
    "DeploymentShape",
    "Move",
    "Plan",
    "PrefillInstance",
    "PrefillShape",
    "TraySelector",
    "UnplacedCell",
    "plan_placement",
]


@dataclass(frozen=True, slots=True)
class DecodeShape:
    """A decode group: ``dep`` ranks, ``gpus_per_pod`` per pod (one pod per whole tray)."""

    dep: int = 32
    gpus_per_pod: int = 4
    spare_trays: int = 1

    def __post_init__(self) -> None:
        if self.dep < 1 or self.gpus_per_pod < 1 or self.spare_trays < 0:
            raise ValueError("decode dep and gpusPerPod must be positive, spareTrays >= 0")
        problem = decode_trays_problem(self.dep, self.gpus_per_pod)
        if problem:
            raise ValueError(f"decode {problem}")

    @property
    def trays(self) -> int:
        return self.dep // self.gpus_per_pod


@dataclass(frozen=True, slots=True)
class PrefillShape:
    """Prefill instances of ``dep`` GPUs on one tray; ``instances=None`` means as many as fit."""

    dep: int = 2
    instances: int | None = None

    def __post_init__(self) -> None:
        if self.dep < 1 or (self.instances is not None and self.instances < 0):
            raise ValueError("prefill dep must be positive and instances >= 0")


@dataclass(frozen=True, slots=True)
class TraySelector:
    """The trays a deployment's pods may use besides Baton's own rules: those carrying every
    label of its node selector, and tainted trays whose taints it all tolerates (its
    ``engine.nodeSelector`` and ``engine.tolerations``, which its pods carry too)."""

    labels: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[Toleration, ...] = ()

    @classmethod
    def of(
        cls, node_selector: Mapping[str, str], tolerations: Sequence[Toleration]
    ) -> TraySelector:
        return cls(tuple(sorted(node_selector.items())), tuple(tolerations))

    def tolerates(self, taint: TrayTaint) -> bool:
        """Kubernetes' toleration match: key (empty with Exists: any), value, effect."""
        return any(
            (t.key == taint.key or (not t.key and t.operator == "Exists"))
            and (t.operator == "Exists" or t.value == taint.value)
            and (not t.effect or t.effect == taint.effect)
            for t in self.tolerations
        )

    def admits(self, tray: Tray) -> bool:
        """New pods of the deployment may be scheduled to ``tray`` (health aside)."""
        if any(label not in tray.labels for label in self.labels):
            return False
        if tray.schedulable:
            return True
        # unschedulable with no taint kept: cordoned (the hand-written form says only that)
        return not tray.cordoned and bool(tray.taints) and all(map(self.tolerates, tray.taints))

    def eligible(self, tray: Tray) -> bool:
        """New pods of the deployment may be placed on ``tray``."""
        return (
            tray.domain is not None
            and tray.ready
            and not tray.quarantined
            and tray.degraded is None
            and self.admits(tray)
        )

    def keeps(self, tray: Tray) -> bool:
        """The deployment's pods already on ``tray`` keep running there."""
        if tray.keeps_pods:
            return True
        evicting = [t for t in tray.taints if t.effect == "NoExecute"]
        return (
            tray.domain is not None
            and tray.ready
            and not tray.quarantined
            and bool(evicting)  # evicting with no taint kept: the hand-written form says only that
            and all(map(self.tolerates, evicting))
        )

    def excludes(self, tray: Tray) -> bool:
        """A healthy tray the node selector or the taints keep the deployment off."""
        healthy = tray.domain is not None and tray.ready and not tray.quarantined
        return healthy and not tray.cordoned and not self.admits(tray)


@dataclass(frozen=True, slots=True)
class DeploymentShape:
    """What a ModelDeployment asks placement for: ``cells`` cells of one shape."""

    name: str
    cells: int = 1
    decode: DecodeShape = field(default_factory=DecodeShape)
    prefill: PrefillShape = field(default_factory=PrefillShape)
    trays: TraySelector = field(default_factory=TraySelector)
    # its cells may share an NVLink domain with other cells that may, each on trays of its own
    # (spec.topology.exclusiveDomain false)
    shares_domain: bool = False
    # cells past ``cells`` a rollout would have (spec.rollout.maxSurge): placed only on what
    # every deployment's cells leave, and never reported unplaced
    surge: int = 0

    def __post_init__(self) -> None:
        if not self.name or self.cells < 0 or self.surge < 0:
            raise ValueError("a deployment needs a name, cells >= 0 and surge >= 0")

    @classmethod
    def of(cls, deployment: ModelDeployment) -> DeploymentShape:
        """What placement needs of a ModelDeployment."""
        cell = deployment.spec.cell
        return cls(
            name=deployment.name,
            cells=deployment.spec.cells,
            decode=DecodeShape(cell.decode.dep, cell.decode.gpus_per_pod, cell.decode.spare_trays),
            prefill=PrefillShape(cell.prefill.dep, cell.prefill.instances),
            trays=TraySelector.of(
                deployment.spec.engine.node_selector, deployment.spec.engine.tolerations
            ),
            shares_domain=not deployment.spec.topology.exclusive_domain,
        )


@dataclass(frozen=True, slots=True)
class PrefillInstance:
    index: int
    tray: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CellPlacement:
    """Where one cell runs.

    Decode pod ``i`` (ranks ``i*g .. i*g+g-1`` for ``g`` GPUs per pod) is on ``decode_trays[i]``.
    """

    name: str
    deployment: str
    domain: str
    decode_trays: tuple[str, ...]
    prefill: tuple[PrefillInstance, ...]
    spare_trays: tuple[str, ...]
    max_prefill_instances: int


@dataclass(frozen=True, slots=True)
class UnplacedCell:
    """A wanted cell without a placement; ``domains`` says what each free domain lacked, and
    what each domain hosting a cell has left."""

    name: str
    deployment: str
    reason: Reason
    message: str
    domains: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Move:
    """A pod that runs on another tray than in the current placement."""

    pod: str
    source: str
    target: str


@dataclass(frozen=True, slots=True)
class Plan:
    """Placed cells (deployment order, then index), unplaced cells, and changes vs current.

    ``restarted`` names the cells whose decode group restarts as a whole.
    """

    cells: tuple[CellPlacement, ...]
    unplaced: tuple[UnplacedCell, ...] = ()
    moved: tuple[Move, ...] = ()
    restarted: tuple[str, ...] = ()

    @property
    def feasible(self) -> bool:
        return not self.unplaced

    def cell(self, name: str) -> CellPlacement | None:
        return next((cell for cell in self.cells if cell.name == name), None)


class _Ledger:
    """GPU indices Baton holds on each tray during one planning pass (never leaves it), and the
    cell each tray's pods belong to: a tray's pods are one cell's (a node joins one IMEX
    ComputeDomain), so a tray another cell holds or claims offers a cell nothing."""

    __slots__ = ("_cell", "_held")

    def __init__(self) -> None:
        self._held: dict[str, int] = {}  # tray name -> bit mask of held GPU indices
        self._cell: dict[str, str] = {}  # tray name -> the cell holding or claiming it

    def _ours(self, tray: Tray, cell: str) -> bool:
        return self._cell.get(tray.name, cell) == cell

    def claim(self, tray: Tray, cell: str) -> None:
        """Keep ``tray`` for ``cell`` (its pods run there) before it holds any GPU again."""
        self._cell.setdefault(tray.name, cell)

    def release_claims(self, cell: str) -> None:
        """``cell``'s claims on trays where it holds no GPU end: others may take them."""
        for name in [n for n, c in self._cell.items() if c == cell and n not in self._held]:
            del self._cell[name]

    def release_cell(self, cell: str) -> None:
        """Everything ``cell`` holds or claims goes back."""
        for name in [n for n, c in self._cell.items() if c == cell]:
            del self._cell[name]
            self._held.pop(name, None)

    def is_empty(self, tray: Tray, cell: str) -> bool:
        return tray.name not in self._held and self._ours(tray, cell)

    def free(self, tray: Tray, cell: str) -> int:
        if not self._ours(tray, cell):
            return 0
        return tray.free_gpus - self._held.get(tray.name, 0).bit_count()

    def take_whole(self, tray: Tray, cell: str) -> None:
        self._held[tray.name] = (1 << tray.gpus) - 1
        self._cell[tray.name] = cell

    def take(self, tray: Tray, gpus: tuple[int, ...], cell: str) -> bool:
        """Hold these GPUs for ``cell`` if they exist, are distinct, not held, fit next to
        others', and no other cell holds the tray."""
        if not self._ours(tray, cell):
            return False
        mask = 0
        for gpu in gpus:
            mask |= 1 << gpu
        held = self._held.get(tray.name, 0)
        if (
            not mask
            or held & mask
            or mask >> tray.gpus
            or mask.bit_count() != len(gpus)
            or (held | mask).bit_count() > tray.free_gpus
        ):
            return False
        self._held[tray.name] = held | mask
        self._cell[tray.name] = cell
        return True

    def take_lowest(self, tray: Tray, count: int, cell: str) -> tuple[int, ...]:
        held = self._held.get(tray.name, 0)
        gpus = tuple(gpu for gpu in range(tray.gpus) if not held >> gpu & 1)[:count]
        self.take(tray, gpus, cell)
        return gpus


@dataclass(frozen=True, slots=True)
class _Fit:
    """What a domain free of cells offers one shape."""

    domain: NVLinkDomain
    position: int  # the domain's place in topology order, the last tie-break
    whole: int
    slots: int  # prefill slots left once decode and spares have their whole trays
    excluded: int = 0  # healthy trays the deployment's node selector or taints keep it off


def _prefill_wanted(shape: DeploymentShape) -> int:
    # "As many as fit" still needs one instance: a cell without prefill is not disaggregated.
    instances = shape.prefill.instances
    return 1 if instances is None else instances


class _Pass:
    """One planning pass: the ledger and the steps that read and update it."""

    def __init__(self, topology: Topology, unbound: Collection[str]) -> None:
        self.topology = topology
        self.unbound = unbound
        self.ledger = _Ledger()

    def is_whole(self, tray: Tray, shape: DeploymentShape, cell: str) -> bool:
        return (
            shape.trays.eligible(tray)
            and tray.gpus == shape.decode.gpus_per_pod
            and tray.used_by_others == 0
            and self.ledger.is_empty(tray, cell)
        )

    def free_in(self, domain: NVLinkDomain, shape: DeploymentShape, cell: str) -> tuple[int, int]:
        """The whole trays and prefill slots of ``domain`` that ``cell`` may take: none that a
        pod of this plan holds, nor on a tray another cell holds."""
        whole = slots = 0
        for tray in domain.trays:
            if shape.trays.eligible(tray):
                slots += self.ledger.free(tray, cell) // shape.prefill.dep
                whole += self.is_whole(tray, shape, cell)
        return whole, slots

    def fit(self, domain: NVLinkDomain, position: int, shape: DeploymentShape, cell: str) -> _Fit:
        whole, slots = self.free_in(domain, shape, cell)
        needed = shape.decode.trays + shape.decode.spare_trays
        per_whole = shape.decode.gpus_per_pod // shape.prefill.dep
        excluded = sum(map(shape.trays.excludes, domain.trays))
        return _Fit(domain, position, whole, slots - min(whole, needed) * per_whole, excluded)

    def repair(self, old: CellPlacement, shape: DeploymentShape) -> CellPlacement | None:
        """Step 1: keep the cell in its domain, re-placing only what lost its tray."""
        domain = self.topology.domain(old.domain)
        if (
            domain is None
            or len(old.decode_trays) != shape.decode.trays
            or any(len(instance.gpus) != shape.prefill.dep for instance in old.prefill)
        ):
            return None  # the domain is gone or the shape changed: admit afresh
        ledger = self.ledger
        decode: list[Tray | None] = []
        for rank, name in enumerate(old.decode_trays):
            tray = self._keepable(name, domain, decode_pod_name(old.name, rank), shape)
            if (
                tray is not None
                and tray.gpus == shape.decode.gpus_per_pod
                and tray.used_by_others == 0
                and ledger.is_empty(tray, old.name)
            ):
                ledger.take_whole(tray, old.name)
                decode.append(tray)
            else:
                decode.append(None)  # a lost rank, re-placed by _complete_decode
        spares: list[Tray] = []
        for name in old.spare_trays[: shape.decode.spare_trays]:
            tray = self._keepable(name, domain, None, shape)
            if tray is not None and self.is_whole(tray, shape, old.name):
                ledger.take_whole(tray, old.name)
                spares.append(tray)
        limit = shape.prefill.instances
        prefill: dict[int, PrefillInstance] = {}
        for instance in sorted(old.prefill, key=lambda instance: instance.index):
            if limit is not None and instance.index >= limit:
                continue
            tray = self._keepable(
                instance.tray, domain, prefill_pod_name(old.name, instance.index), shape
            )
            if tray is not None and ledger.take(tray, instance.gpus, old.name):
                prefill[instance.index] = instance
        if not self._complete_decode(decode, spares, prefill, domain, shape, old.name):
            ledger.release_cell(old.name)
            return None
        self._top_up_spares(spares, domain, shape, old.name)
        free_slots = self._fill_prefill(prefill, domain, shape, old.name)
        cell = CellPlacement(
            name=old.name,
            deployment=old.deployment,
            domain=domain.name,
            decode_trays=tuple(tray.name for tray in decode if tray is not None),
            prefill=tuple(prefill[index] for index in sorted(prefill)),
            spare_trays=tuple(tray.name for tray in spares),
            max_prefill_instances=len(prefill) + free_slots,
        )
        return old if cell == old else cell

    def admit(self, name: str, shape: DeploymentShape, domain: NVLinkDomain) -> CellPlacement:
        """Step 2: the whole cell in a domain known to fit it."""
        whole = [tray for tray in domain.trays if self.is_whole(tray, shape, name)]
        decode = whole[: shape.decode.trays]
        spares = whole[shape.decode.trays : shape.decode.trays + shape.decode.spare_trays]
        for tray in decode + spares:
            self.ledger.take_whole(tray, name)
        prefill: dict[int, PrefillInstance] = {}
        free_slots = self._fill_prefill(prefill, domain, shape, name)
        return CellPlacement(
            name=name,
            deployment=shape.name,
            domain=domain.name,
            decode_trays=tuple(tray.name for tray in decode),
            prefill=tuple(prefill.values()),
            spare_trays=tuple(tray.name for tray in spares),
            max_prefill_instances=len(prefill) + free_slots,
        )

    def headroom(self, cell: CellPlacement, shape: DeploymentShape) -> CellPlacement:
        """``cell`` with the prefill instances it could have now: its own and every slot of
        its domain's trays that no other cell holds."""
        domain = self.topology.domain(cell.domain)
        dep = shape.prefill.dep
        free = sum(
            self.ledger.free(tray, cell.name) // dep
            for tray in (domain.trays if domain else ())
            if shape.trays.eligible(tray)
        )
        most = len(cell.prefill) + free
        return (
            cell
            if most == cell.max_prefill_instances
            else replace(cell, max_prefill_instances=most)
        )

    def _keepable(
        self, name: str, domain: NVLinkDomain, pod: str | None, shape: DeploymentShape
    ) -> Tray | None:
        """Tray ``name`` if ``pod`` (None: a spare) may stay on it."""
        tray = self.topology.tray(name)
        if tray is None or tray.domain != domain.name or not shape.trays.keeps(tray):
            return None
        if pod in self.unbound and not shape.trays.eligible(tray):
            return None  # its pod is created anew, and a new pod is not bound to a cordoned tray
        return tray

    def _complete_decode(
        self,
        decode: list[Tray | None],
        spares: list[Tray],
        prefill: dict[int, PrefillInstance],
        domain: NVLinkDomain,
        shape: DeploymentShape,
        cell: str,
    ) -> bool:
        """Fill lost decode ranks: spares, then free whole trays, then the cell's prefill trays."""
        lost = [rank for rank, tray in enumerate(decode) if tray is None]
        if not lost:
            return True
        candidates = spares + [t for t in domain.trays if self.is_whole(t, shape, cell)]
        if len(candidates) < len(lost):
            candidates += self._reclaimable(prefill, domain, shape)
        if len(candidates) < len(lost):
            return False
        chosen = candidates[: len(lost)]
        for rank, tray in zip(lost, chosen, strict=True):
            # Instances on a reclaimed tray are placed again, like any that lost its tray.
            for index in [i for i, instance in prefill.items() if instance.tray == tray.name]:
                del prefill[index]
            self.ledger.take_whole(tray, cell)
            decode[rank] = tray
        spares[:] = [tray for tray in spares if tray not in chosen]
        return True

    def _reclaimable(
        self, prefill: dict[int, PrefillInstance], domain: NVLinkDomain, shape: DeploymentShape
    ) -> list[Tray]:
        """Whole-size trays holding only this cell's prefill, fewest instances first."""
        instances_on: dict[str, int] = {}
        for instance in prefill.values():
            instances_on[instance.tray] = instances_on.get(instance.tray, 0) + 1
        candidates = [
            tray
            for tray in domain.trays
            if tray.name in instances_on
            and shape.trays.eligible(tray)
            and tray.gpus == shape.decode.gpus_per_pod
            and tray.used_by_others == 0
        ]
        return sorted(candidates, key=lambda tray: (instances_on[tray.name], tray.slot))

    def _top_up_spares(
        self, spares: list[Tray], domain: NVLinkDomain, shape: DeploymentShape, cell: str
    ) -> None:
        for tray in domain.trays:
            if len(spares) >= shape.decode.spare_trays:
                return
            if self.is_whole(tray, shape, cell):
                self.ledger.take_whole(tray, cell)
                spares.append(tray)

    def _fill_prefill(
        self,
        prefill: dict[int, PrefillInstance],
        domain: NVLinkDomain,
        shape: DeploymentShape,
        cell: str,
    ) -> int:
        """Give missing instance indices free slots, half-used trays first; return slots left."""
        dep, ledger = shape.prefill.dep, self.ledger
        wanted = shape.prefill.instances
        missing: Iterator[int] = (index for index in count() if index not in prefill)
        if wanted is not None:
            missing = (index for index in range(wanted) if index not in prefill)
        trays = sorted(
            (
                tray
                for tray in domain.trays
                if shape.trays.eligible(tray) and ledger.free(tray, cell) >= dep
            ),
            key=lambda tray: (
                ledger.free(tray, cell) == tray.gpus,
                ledger.free(tray, cell),
                tray.slot,
            ),
        )
        # Sorted by free GPUs, a tray keeps fewer free GPUs than any later one once it takes an
        # instance, so filling each tray before moving on is best fit.
        position = 0
        for index in missing:
            while position < len(trays) and ledger.free(trays[position], cell) < dep:
                position += 1
            if position == len(trays):
                break
            tray = trays[position]
            instance = PrefillInstance(index, tray.name, ledger.take_lowest(tray, dep, cell))
            prefill[index] = instance
        return sum(ledger.free(tray, cell) // dep for tray in trays[position:])


_ShapeKey = tuple[DecodeShape, PrefillShape, TraySelector]


def _assign(
    cells: Sequence[tuple[str, _ShapeKey]], options: Mapping[_ShapeKey, Sequence[str]]
) -> dict[str, str]:
    """Cells to domains, one cell per domain, as many cells as possible.

    Each cell takes the first free domain of its shape's options. One that finds none looks for
    an augmenting path (breadth first) through the cells already assigned. Once that search
    fails for a shape it fails for every later cell of the shape (Kuhn), so it is not repeated.
    """
    owner: dict[str, str] = {}  # domain -> cell
    assigned: dict[str, str] = {}  # cell -> domain
    shape_of = dict(cells)
    cursor: dict[_ShapeKey, int] = {}  # options before this index are all taken
    hopeless: set[_ShapeKey] = set()
    for cell, key in cells:
        choices = options[key]
        position = cursor.get(key, 0)
        while position < len(choices) and choices[position] in owner:
            position += 1
        cursor[key] = position
        if position < len(choices):
            owner[choices[position]] = cell
            assigned[cell] = choices[position]
        elif key not in hopeless and not _augment(cell, shape_of, options, owner, assigned):
            hopeless.add(key)
    return assigned


def _augment(
    cell: str,
    shape_of: Mapping[str, _ShapeKey],
    options: Mapping[_ShapeKey, Sequence[str]],
    owner: dict[str, str],
    assigned: dict[str, str],
) -> bool:
    reached_from: dict[str, str] = {}  # domain -> the cell whose options reached it
    queue = deque([cell])
    while queue:
        current = queue.popleft()
        for domain in options[shape_of[current]]:
            if domain in reached_from:
                continue
            reached_from[domain] = current
            holder = owner.get(domain)
            if holder is not None:
                queue.append(holder)
                continue
            # A free domain: every cell on the path moves one domain along it.
            while True:
                mover = reached_from[domain]
                vacated = assigned.get(mover)
                owner[domain] = mover
                assigned[mover] = domain
                if mover == cell:
                    return True
                # Every other mover was queued as a domain's holder, so it had a domain to vacate.
                assert vacated is not None
                domain = vacated
    return False


def _shortfall(fit: _Fit, shape: DeploymentShape) -> str:
    needed = shape.decode.trays + shape.decode.spare_trays
    wanted = "" if shape.prefill.instances is None else f" of {shape.prefill.instances}"
    kept_off = ""
    if fit.excluded:
        kept_off = (
            f"; {fit.excluded} healthy tray{'' if fit.excluded == 1 else 's'} left out by "
            "engine.nodeSelector or untolerated taints"
        )
    return (
        f"domain {fit.domain.name}: {min(fit.whole, needed)} of {needed} whole trays free "
        f"({shape.decode.trays} decode + {shape.decode.spare_trays} spare), "
        f"{fit.slots}{wanted} prefill slots{kept_off}"
    )


def _explanation(
    shape: DeploymentShape,
    free: Sequence[_Fit],
    domains: int,
    hosting: Sequence[tuple[str, int, int]],
    joinable: Sequence[_Fit] = (),
) -> tuple[str, tuple[str, ...]]:
    """Why no cell of this shape fits: one sentence, then what each free domain lacked, what
    each domain it could share lacked (``joinable``), and what each domain hosting a cell it
    may not join has left (``hosting``: its name, whole trays and prefill slots no pod holds),
    which only the cells there can take."""
    needed = shape.decode.trays + shape.decode.spare_trays
    instances = shape.prefill.instances
    slot = f"DEP{shape.prefill.dep} prefill slot"
    if instances is None:
        prefill = f"at least one {slot}"
    else:
        prefill = f"{instances} {slot}{'' if instances == 1 else 's'}"
    if not domains:
        why = "there is no NVLink domain: no eligible tray carries the clique label"
    elif not free:
        why = (
            "the only NVLink domain hosts a cell"
            if domains == 1
            else f"all {domains} NVLink domains host cells"
        )
    else:
        why = (
            "the one domain free of cells lacks that"
            if len(free) == 1
            else f"none of the {len(free)} domains free of cells has that"
        )
        others = domains - len(free)
        if others:
            hosts = "domain hosts a cell" if others == 1 else "domains host cells"
            why += f"; {others} other {hosts}"
    summary = (
        f"needs {needed} whole trays ({shape.decode.trays} decode + {shape.decode.spare_trays} "
        f"spare) and {prefill} in one NVLink domain; {why}"
    )
    left = tuple(
        f"domain {name} hosts a cell (one cell per NVLink domain unless every deployment in it "
        f"sets topology.exclusiveDomain: false): {whole} whole trays and "
        f"{slots} DEP{shape.prefill.dep} prefill slots free there, for its cells' prefill only"
        for name, whole, slots in hosting
        if slots
    )
    shared = tuple(f"{_shortfall(fit, shape)}, beside the cells it hosts" for fit in joinable)
    return summary, (*(_shortfall(fit, shape) for fit in free), *shared, *left)


def _changes(
    previous: Mapping[str, CellPlacement], cells: Sequence[CellPlacement]
) -> tuple[tuple[Move, ...], tuple[str, ...]]:
    moved: list[Move] = []
    restarted: list[str] = []
    for cell in cells:
        old = previous.get(cell.name)
        if old is None or old is cell:
            continue
        if old.decode_trays != cell.decode_trays:
            restarted.append(cell.name)
            for rank, (source, target) in enumerate(
                zip(old.decode_trays, cell.decode_trays, strict=False)
            ):
                if source != target:
                    moved.append(Move(decode_pod_name(cell.name, rank), source, target))
        old_trays = {instance.index: instance.tray for instance in old.prefill}
        for instance in cell.prefill:
            old_tray = old_trays.get(instance.index)
            if old_tray is not None and old_tray != instance.tray:
                moved.append(
                    Move(prefill_pod_name(cell.name, instance.index), old_tray, instance.tray)
                )
    return tuple(moved), tuple(restarted)


def plan_placement(
    deployments: Sequence[DeploymentShape],
    topology: Topology,
    current: Plan | None = None,
    unbound: Collection[str] = frozenset(),
) -> Plan:
    """Place every wanted cell, keeping the current placement where its trays are healthy.

    ``unbound`` names the current placement's pods that do not run on their tray (not created,
    on their way out, ended, or not yet bound by the scheduler); the others run there."""
    wanted: dict[str, DeploymentShape] = {}
    names: set[str] = set()
    for shape in deployments:
        if shape.name in names:
            raise ValueError(f"deployment '{shape.name}' is listed twice")
        names.add(shape.name)
        for index in range(shape.cells):
            wanted[cell_name(shape.name, index)] = shape
    surge = {
        cell_name(shape.name, index): shape
        for shape in deployments
        for index in range(shape.cells, shape.cells + shape.surge)
    }
    everything = {**wanted, **surge}
    step = _Pass(topology, unbound)
    placed: dict[str, CellPlacement] = {}
    hosts: dict[str, list[DeploymentShape]] = {}  # domain -> the shapes of its cells
    previous = {cell.name: cell for cell in current.cells} if current else {}
    # Every kept cell's trays are its own before any cell grows into free GPUs.
    for name, old in previous.items():
        if name in everything:
            for tray_name in (*old.decode_trays, *old.spare_trays, *(i.tray for i in old.prefill)):
                tray = topology.tray(tray_name)
                if tray is not None:
                    step.ledger.claim(tray, name)
    for name in sorted(previous):
        old, kept = previous[name], everything.get(name)
        cell = None
        if kept is not None and _may_join(hosts.get(old.domain, ()), kept):
            cell = step.repair(old, kept)
        if cell is None or kept is None:
            step.ledger.release_cell(name)
            continue
        placed[name] = cell
        hosts.setdefault(cell.domain, []).append(kept)
        step.ledger.release_claims(name)  # trays it kept no pod on go back to the domain

    # Step 2: the rest. Cells that may share a domain join one whose cells all may; the others
    # take a domain free of cells each; cells that may share join those too.
    newcomers = [
        (name, (shape.decode, shape.prefill, shape.trays))
        for name, shape in wanted.items()
        if name not in placed
    ]
    _join_shared(step, [name for name, _ in newcomers], wanted, hosts, placed)
    free = [
        (position, domain)
        for position, domain in enumerate(topology.domains)
        if domain.name not in hosts
    ]
    fits: dict[_ShapeKey, list[_Fit]] = {}
    options: dict[_ShapeKey, list[str]] = {}
    for name, key in newcomers:
        if key not in fits:
            fits[key] = [
                step.fit(domain, position, wanted[name], name) for position, domain in free
            ]
            options[key] = _preferred(fits[key], wanted[name])
    domains = {domain.name: domain for _, domain in free}
    alone = [(name, key) for name, key in newcomers if name not in placed]
    for name, domain_name in _assign(alone, options).items():
        placed[name] = step.admit(name, wanted[name], domains[domain_name])
        hosts[domain_name] = [wanted[name]]
    _join_shared(step, [name for name, _ in newcomers], wanted, hosts, placed)
    _place_surge(step, [name for name in surge if name not in placed], surge, hosts, placed)

    # Step 3: explain every cell left out, against the domains still free of cells and those
    # it could have shared.
    explanations: dict[_ShapeKey, tuple[str, tuple[str, ...]]] = {}
    unplaced: list[UnplacedCell] = []
    for name, key in newcomers:
        if name in placed:
            continue
        if key not in explanations:
            shape = wanted[name]
            free_now = [fit for fit in fits[key] if fit.domain.name not in hosts]
            joinable = [
                step.fit(domain, position, shape, name)
                for position, domain in enumerate(topology.domains)
                if domain.name in hosts and _may_join(hosts[domain.name], shape)
            ]
            hosting = [
                (domain.name, *step.free_in(domain, shape, ""))
                for domain in topology.domains
                if domain.name in hosts and not _may_join(hosts[domain.name], shape)
            ]
            explanations[key] = _explanation(
                shape, free_now, len(topology.domains), hosting, joinable
            )
        summary, lines = explanations[key]
        unplaced.append(
            UnplacedCell(
                name,
                wanted[name].name,
                Reason.INSUFFICIENT_CAPACITY,
                f"cell {name} {summary}",
                lines,
            )
        )
    for name, cell in placed.items():
        if len(hosts[cell.domain]) > 1:  # its slots as they are once its neighbours are placed
            placed[name] = step.headroom(cell, everything[name])
    cells = tuple(placed[name] for name in everything if name in placed)
    moved, restarted = _changes(previous, cells)
    return Plan(cells, tuple(unplaced), moved, restarted)


def _place_surge(
    step: _Pass,
    names: Sequence[str],
    surge: Mapping[str, DeploymentShape],
    hosts: dict[str, list[DeploymentShape]],
    placed: dict[str, CellPlacement],
) -> None:
    """Surge cells, after every deployment's own: each on what is left, where it fits best
    (a shared domain its deployment may join, else a free one), or nowhere."""
    _join_shared(step, names, surge, hosts, placed)
    for name in names:
        if name not in placed:
            _admit_best(step, name, surge[name], hosts, placed, lambda domain: domain not in hosts)


def _may_join(cells: Sequence[DeploymentShape], shape: DeploymentShape) -> bool:
    """Whether a cell of ``shape`` may go to a domain hosting cells of ``cells``: a free one,
    or one whose cells all share, as it does."""
    return not cells or (shape.shares_domain and all(other.shares_domain for other in cells))


def _join_shared(
    step: _Pass,
    names: Sequence[str],
    wanted: Mapping[str, DeploymentShape],
    hosts: dict[str, list[DeploymentShape]],
    placed: dict[str, CellPlacement],
) -> None:
    """Each cell of ``names`` not yet placed whose deployment shares domains goes, whole, to
    the domain it fits best among those hosting only such cells, on trays no cell holds."""
    for name in names:
        shape = wanted[name]
        if name in placed or not shape.shares_domain:
            continue
        joinable = {d for d, cells in hosts.items() if _may_join(cells, shape)}
        _admit_best(step, name, shape, hosts, placed, joinable.__contains__)


def _admit_best(
    step: _Pass,
    name: str,
    shape: DeploymentShape,
    hosts: dict[str, list[DeploymentShape]],
    placed: dict[str, CellPlacement],
    allowed: Callable[[str], bool],
) -> None:
    """Cell ``name`` to the domain it fits best of those ``allowed`` (by name), if any fits."""
    fits = [
        step.fit(domain, position, shape, name)
        for position, domain in enumerate(step.topology.domains)
        if allowed(domain.name)
    ]
    best = _preferred(fits, shape)
    if best:
        domain = next(fit.domain for fit in fits if fit.domain.name == best[0])
        placed[name] = step.admit(name, shape, domain)
        hosts.setdefault(domain.name, []).append(shape)


def _preferred(fits: Sequence[_Fit], shape: DeploymentShape) -> list[str]:
    """Domains that fit the shape, best first."""
    needed = shape.decode.trays + shape.decode.spare_trays
    wanted = _prefill_wanted(shape)
    fitting = [fit for fit in fits if fit.whole >= needed and fit.slots >= wanted]
    if shape.prefill.instances is None:
        fitting.sort(key=lambda fit: (-fit.slots, fit.position))
    else:
        fitting.sort(key=lambda fit: (fit.slots - wanted, fit.whole - needed, fit.position))
    return [fit.domain.name for fit in fitting]
