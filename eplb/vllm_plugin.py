"""Baton's EPLB inside vLLM engines: a vLLM general plugin that makes vLLM's expert rebalance use
Baton's minimal-move algorithm, and reports each window to Baton's EPLB service.

How vLLM 0.33 gets here (read in its ``vllm/plugins`` and ``vllm/distributed/eplb``): every
process of an engine loads the ``vllm.general_plugins`` entry points, a worker before it builds
its model and its ``EplbState``. That state takes its policy class from
``EPLB_POLICIES[eplb_config.policy]``, and asynchronous EPLB (vLLM's default) accepts only the
policy named ``default``; so :func:`register` puts Baton's class under that name rather than
adding one. vLLM calls ``rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks,
old_global_expert_indices)`` on every EP rank with the same inputs (the window's load, summed and
all-reduced, ``[layers, logical experts]``; the placement in force, ``[layers, physical slots]``)
and uses each rank's own answer, so the answer must be a function of the inputs alone: Baton's
algorithm is deterministic numpy, identical on every rank.

``baton sim`` loads the same policy through an entry point of its own
(:func:`simulated_engine_policy`), so the simulator's in-engine EPLB can run what vLLM engines
run with the plugin.

Who places is the pod's choice (``spec.eplb.policy``, rendered as ``POLICY_ENV``): Baton's
algorithm by default, or ``vllm_default``, where vLLM's own policy places every window and the
plugin only measures and reports it (the same balance and moves), so that a live group's figures
under vLLM's policy can be set beside Baton's before switching.

Fallbacks, each logged, each reported: a vLLM version this plugin was not written against leaves
vLLM's policy in place (nothing is patched); any error in Baton's placement makes that window's
placement vLLM's own. Nothing here raises into vLLM.

Reports: EP rank 0 of each group posts a :class:`~baton.core.eplb_report.WindowReport` per
rebalance (``eplb.reporter``) when the engine's pod says where (the environment variables
``baton.core.eplb_report`` names; the controller renders them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel

from baton.core.eplb_report import (
    INACTIVE_PATH,
    POLICY_ENV,
    REPORT_PATH,
    REPORT_URL_ENV,
    TOKEN_ENV,
    WHERE_ENV,
    PluginInactive,
    Policy,
    WindowReport,
)
from baton.core.experts import Placement, balance, moves
from baton.core.vllm_eplb import vllm_rebalance
from eplb.algorithm import rebalance
from eplb.reporter import Reporter

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENTRY_POINT_NAME",
    "ENTRY_POINT_VALUE",
    "SIMULATOR_ENTRY_POINT_GROUP",
    "SUPPORTED_VLLM",
    "Rebalanced",
    "SimulatedPolicy",
    "configured_policy",
    "place_and_report",
    "rebalance_window",
    "register",
    "simulated_engine_policy",
    "supported",
    "window_report",
]

log = logging.getLogger("baton.eplb.vllm_plugin")

# The vLLM releases whose EPLB entry point and state this plugin was written against: 0.33, and
# 0.32, whose vllm/distributed/eplb/policy is 0.33's line for line (tests/live checks it on the
# CPU build of 0.32, where the plugin runs inside vLLM's loop); and 0.26, the newest release
# built for the lent GPUs' torch (docs/vllm.md), whose policy package differs from 0.33's in
# docstrings alone and is called with the same arguments (compared in the wheels' code, not run).
SUPPORTED_VLLM = ("0.26.", "0.32.", "0.33.")
# How vLLM finds the plugin: pyproject.toml declares the same entry point for installs of Baton.
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "baton_eplb"
ENTRY_POINT_VALUE = "eplb.vllm_plugin:register"
# How `baton sim` finds the same policy (pyproject.toml declares it under the name "baton"):
# by entry point, as vLLM finds the plugin, never by import.
SIMULATOR_ENTRY_POINT_GROUP = "baton.sim.eplb_policies"
SIMULATOR_VERSION = "baton-sim"
_REPORTER: Reporter | None = None
# vLLM's policy call, numpy in and out: (load, num_replicas, num_groups, num_nodes, num_ranks,
# placement in force) -> new placement [layers, physical slots].
SimulatedPolicy = Callable[[np.ndarray, int, int, int, int, np.ndarray], np.ndarray]


def supported(version: str) -> bool:
    return version.startswith(SUPPORTED_VLLM)


@dataclass(frozen=True, slots=True)
class Rebalanced:
    """One window's new placement, who made it, and what it does to the window."""

    phy2log: np.ndarray  # [layers, physical slots]
    policy: Policy
    fallback: str | None
    balance_before: float | None  # None: the old placement was not one
    balance_after: float
    experts_moved: int


def configured_policy() -> Policy:
    """Who places, as the pod's ``POLICY_ENV`` says: ``baton`` unless it names vLLM's policy
    (an unknown value is logged and leaves Baton's)."""
    value = os.environ.get(POLICY_ENV, "baton")
    if value == "vllm_default":
        return "vllm_default"
    if value != "baton":
        log.warning(
            "%s=%r is neither baton nor vllm_default; Baton's algorithm places", POLICY_ENV, value
        )
    return "baton"


def rebalance_window(
    load: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old: np.ndarray | None,
    vllm_default: Callable[[], np.ndarray],
    policy: Policy = "baton",
) -> Rebalanced:
    """The placement for a window vLLM hands its policy: Baton's (keeping experts where they
    are when ``old`` is a placement of the same shape), or ``vllm_default()`` where ``policy``
    says so or Baton's fails; with its balance and moves either way."""
    load = np.asarray(load, dtype=np.float64)
    num_experts = load.shape[1]
    previous = _placement(old, num_ranks, num_experts)
    placed: Placement | None
    fallback: str | None = None
    if policy == "vllm_default":
        phy2log = vllm_default()
        placed = _placement(phy2log, num_ranks, num_experts)
    else:
        try:
            placed = rebalance(
                load,
                num_ranks,
                num_replicas - num_experts,
                num_nodes,
                num_groups,
                previous=previous,
            )
            phy2log = placed.phy2log
        except Exception as exc:  # vLLM's own policy places this window instead
            log.warning(
                "Baton's EPLB failed (%s: %s); vLLM's policy places", type(exc).__name__, exc
            )
            phy2log, policy, fallback = vllm_default(), "vllm_default", type(exc).__name__
            placed = _placement(phy2log, num_ranks, num_experts)
    before = balance(load, previous) if previous is not None else None
    after = balance(load, placed) if placed is not None else 0.0
    moved = moves(previous, placed) if previous is not None and placed is not None else 0
    return Rebalanced(np.asarray(phy2log, dtype=np.int64), policy, fallback, before, after, moved)


def _placement(phy2log: np.ndarray | None, num_ranks: int, num_experts: int) -> Placement | None:
    """The placement ``phy2log`` describes, or None when it is not one (absent, or with -1
    slots as vLLM's elastic EP leaves them)."""
    if phy2log is None:
        return None
    try:
        return Placement(np.asarray(phy2log), num_ranks, num_experts)
    except ValueError:
        return None


def window_report(
    result: Rebalanced,
    load: np.ndarray,
    num_ranks: int,
    vllm_version: str,
    cell: str | None = None,
) -> WindowReport | None:
    """The report of ``result`` for the group this engine belongs to, when its pod says
    (``cell`` in place of the pod's, for a simulator process serving many groups)."""
    where = _where(cell)
    if where is None:
        return None
    layers, experts = np.asarray(load).shape
    return WindowReport(
        **where,
        layers=layers,
        experts=experts,
        num_ranks=num_ranks,
        load=np.asarray(load, dtype=np.int64).tolist(),
        balance_before=result.balance_before,
        balance_after=result.balance_after,
        experts_moved=result.experts_moved,
        policy=result.policy,
        fallback=result.fallback,
        vllm_version=vllm_version,
    )


def _where(cell: str | None = None) -> dict[str, str] | None:
    """The engine's group, as its pod's environment names it (all three, or None); ``cell``
    overrides the environment's cell."""
    where = {key: os.environ.get(variable, "") for key, variable in WHERE_ENV.items()}
    if cell is not None:
        where["cell"] = cell
    return where if all(where.values()) else None


def register() -> None:
    """vLLM's general-plugin entry point: put Baton's policy under vLLM's ``default`` name."""
    try:
        import vllm
        from vllm.distributed.eplb import policy as policies
    except Exception as exc:  # not a vLLM process after all, or one that cannot import EPLB
        log.warning("Baton's EPLB plugin not active: %s", exc)
        return
    version = str(vllm.__version__)
    if not supported(version):
        log.warning(
            "Baton's EPLB plugin not active: written for vLLM %s, this is %s; vLLM's policy "
            "places experts",
            "/".join(f"{v}x" for v in SUPPORTED_VLLM),
            version,
        )
        _submit(
            INACTIVE_PATH,
            lambda where: PluginInactive(
                **where, vllm_version=version, reason="unsupported_vllm_version"
            ),
        )
        return
    default = policies.EPLB_POLICIES["default"]
    if getattr(default, "baton", False):
        return  # a forked worker inherits its parent's registration
    policies.EPLB_POLICIES["default"] = _policy_class(default, policies.AbstractEplbPolicy, version)
    placer = (
        "Baton's algorithm"
        if configured_policy() == "baton"
        else "its own policy, which the plugin measures and reports"
    )
    log.info("Baton's EPLB plugin active: vLLM %s rebalances with %s", version, placer)


def _policy_class(default: Any, base: Any, version: str) -> Any:
    """Baton's policy as vLLM's ``AbstractEplbPolicy`` subclass (torch in, torch out)."""
    import torch

    class BatonEplbPolicy(base):
        baton = True

        @classmethod
        def rebalance_experts(
            cls,
            weight: Any,
            num_replicas: int,
            num_groups: int,
            num_nodes: int,
            num_ranks: int,
            old_global_expert_indices: Any = None,
        ) -> Any:
            load = weight.cpu().numpy()
            old = None if old_global_expert_indices is None else old_global_expert_indices.numpy()

            def vllm_default() -> np.ndarray:
                placed = default.rebalance_experts(
                    weight,
                    num_replicas,
                    num_groups,
                    num_nodes,
                    num_ranks,
                    old_global_expert_indices,
                )
                return np.asarray(placed.cpu().numpy(), dtype=np.int64)

            phy2log = place_and_report(
                load,
                num_replicas,
                num_groups,
                num_nodes,
                num_ranks,
                old,
                vllm_default,
                reports=_reports_here,
                version=version,
            )
            return torch.from_numpy(np.array(phy2log, dtype=np.int64))  # a writable copy

    return BatonEplbPolicy


def place_and_report(
    load: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old: np.ndarray | None,
    vllm_default: Callable[[], np.ndarray],
    *,
    reports: Callable[[], bool],
    version: str,
    cell: str | None = None,
) -> np.ndarray:
    """One window as the engine's policy answers it: the configured policy's placement (vLLM's
    on any error of Baton's), reported when ``reports()`` says this process is the group's
    reporter."""
    try:
        result = rebalance_window(
            load,
            num_replicas,
            num_groups,
            num_nodes,
            num_ranks,
            old,
            vllm_default,
            configured_policy(),
        )
    except Exception:  # never into the engine: its own policy places this window
        log.exception("Baton's EPLB plugin failed; vLLM's policy places")
        return vllm_default()
    if load.sum() > 0 and reports():  # not vLLM's profiling run
        _submit(REPORT_PATH, lambda _: window_report(result, load, num_ranks, version, cell), cell)
    return result.phy2log


def simulated_engine_policy(cell: str | None) -> SimulatedPolicy:
    """The plugin as ``baton sim`` loads it for decode group ``cell`` (entry point
    ``baton`` of ``SIMULATOR_ENTRY_POINT_GROUP``; None: the group ``BATON_CELL`` names): the
    placement, fallback and report the plugin makes inside vLLM, numpy in and out. The
    simulator runs a whole group in one process, so that process reports every window."""

    def policy(
        load: np.ndarray,
        num_replicas: int,
        num_groups: int,
        num_nodes: int,
        num_ranks: int,
        old: np.ndarray,
    ) -> np.ndarray:
        def vllm_default() -> np.ndarray:
            experts = load.shape[1]
            previous = _placement(old, num_ranks, experts)
            redundant = num_replicas - experts
            placed = vllm_rebalance(load, num_ranks, redundant, num_nodes, num_groups, previous)
            return placed.phy2log

        return place_and_report(
            load,
            num_replicas,
            num_groups,
            num_nodes,
            num_ranks,
            old,
            vllm_default,
            reports=lambda: True,
            version=SIMULATOR_VERSION,
            cell=cell,
        )

    return policy


def _reports_here() -> bool:
    """This process is EP rank 0 of its group: one report per group and window."""
    try:
        from vllm.distributed.parallel_state import get_ep_group

        return bool(get_ep_group().rank_in_group == 0)
    except Exception:  # no EP group (a test, a profiling process): nobody reports
        return False


def _submit(
    path: str, build: Callable[[dict[str, str]], BaseModel | None], cell: str | None = None
) -> None:
    """Post what ``build`` makes for this engine's group, when the pod says where to."""
    global _REPORTER
    try:
        url, where = os.environ.get(REPORT_URL_ENV), _where(cell)
        report = build(where) if url and where is not None else None
        if url is None or report is None:
            return
        if _REPORTER is None:
            _REPORTER = Reporter(url, os.environ.get(TOKEN_ENV))
        _REPORTER.submit(path, report)
    except Exception:  # reporting must never take the engine down
        log.exception("EPLB report not sent")
