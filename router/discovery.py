"""Where the pool's targets come from: flags, a YAML pool file (reloaded when it changes), or a
ModelDeployment's ``status.endpoints``, watched on the Kubernetes API. Flags set the pool once;
the two watched sources hand each change to ``Pool.apply``, which health-checks new engines
before they take traffic.

The controller publishes only ready pods, by cell, so the gateway's two legs of a request stay
in one cell; a cell whose decode group is not ready has no decode endpoints and is left out.
A gateway may follow several ModelDeployments, one pool each: the model a deployment's spec
serves (``servedModelName``, else ``model``) is declared to its pool, so a request for it finds
its pool even while none of its engines answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from baton.core.api import DecodeSpec, Endpoints
from baton.core.follow import DeploymentRef, StatusFollower
from router.prober import Prober
from router.targets import DecodeServerSpec, PoolCell, load_pool_file

__all__ = ["DeploymentWatch", "cells_from_deployment", "served_model", "watch_pool_file"]

log = logging.getLogger("baton.gateway.discovery")


async def watch_pool_file(path: Path, prober: Prober, interval_s: float = 1.0) -> None:
    """Reload ``path`` into ``pool`` whenever its modification time changes; a bad edit is
    logged and the last good pool stays."""
    seen = (await asyncio.to_thread(path.stat)).st_mtime_ns
    while True:
        await asyncio.sleep(interval_s)
        try:
            mtime = (await asyncio.to_thread(path.stat)).st_mtime_ns
        except OSError as exc:
            log.warning("pool file %s is unreadable (%s); keeping the current pool", path, exc)
            continue
        if mtime == seen:
            continue
        seen = mtime
        try:
            spec = await asyncio.to_thread(load_pool_file, path)
        except ValueError as exc:
            log.error("pool file not reloaded: %s", exc)
            continue
        await prober.apply(spec.cells)
        log.info(
            "pool reloaded from %s: %d prefill, %d decode targets",
            path,
            len(prober.pool.prefill),
            len(prober.pool.decode),
        )


def cells_from_deployment(obj: Mapping[str, Any]) -> tuple[PoolCell, ...]:
    """The routable cells of a ModelDeployment (cells without ready decode left out).

    Each decode URL serves its pod's local DP ranks 0 .. gpusPerPod - 1 (hybrid LB).
    """
    decode_spec = ((obj.get("spec") or {}).get("cell") or {}).get("decode") or {}
    ranks = tuple(range(int(decode_spec.get("gpusPerPod", DecodeSpec().gpus_per_pod))))
    endpoints = Endpoints.model_validate((obj.get("status") or {}).get("endpoints") or {})
    return tuple(
        PoolCell(
            name=cell.name,
            prefill=tuple(cell.prefill),
            decode=tuple(DecodeServerSpec(url=url, ranks=ranks) for url in cell.decode),
        )
        for cell in endpoints.cells
        if cell.decode
    )


def served_model(obj: Mapping[str, Any]) -> str:
    """The model name clients ask a ModelDeployment for: its ``servedModelName``, else
    ``model`` (the name its engines' ``--served-model-name`` gives). Read alone: the rest of
    the spec is the controller's to judge, and the pool follows the status whatever it says."""
    spec = obj.get("spec") or {}
    return str(spec.get("servedModelName") or spec.get("model") or "")


def _read(obj: Mapping[str, Any]) -> tuple[str, tuple[PoolCell, ...]]:
    return served_model(obj), cells_from_deployment(obj)


class DeploymentWatch:
    """Hands each changed set of a ModelDeployment's ready cells to its pool, and the model it
    serves, on the gateway's event loop."""

    def __init__(self, ref: DeploymentRef, prober: Prober, loop: asyncio.AbstractEventLoop) -> None:
        self.ref, self.prober, self.loop = ref, prober, loop
        self._change: asyncio.Task[None] | None = None  # the newest pool change
        self._follower = StatusFollower(ref, loop, _read, self._take)

    def start(self) -> None:
        self._follower.start()

    def stop(self) -> None:
        self._follower.stop()

    def _take(self, reading: tuple[str, tuple[PoolCell, ...]]) -> None:
        model, cells = reading
        self.prober.pool.declared = (model,) if model else ()
        self._change = self.loop.create_task(self.prober.apply(cells))
        log.info(
            "pool from ModelDeployment %s/%s (model %s): %d cells, %d prefill, %d decode servers",
            self.ref.namespace,
            self.ref.name,
            model,
            len(cells),
            sum(len(c.prefill) for c in cells),
            sum(len(c.decode) for c in cells),
        )
