"""Where the pool's targets come from: flags, a YAML pool file (reloaded when it changes), or a
ModelDeployment's ``status.endpoints``, watched on the Kubernetes API. All three reach the pool
through ``Pool.update``.

The controller publishes only ready pods, by cell, so the gateway's two legs of a request stay
in one cell; a cell whose decode group is not ready has no decode endpoints and is left out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException
from pydantic import ValidationError
from urllib3.exceptions import HTTPError as Urllib3Error

from baton.api import GROUP, VERSION, Endpoints
from router.pool import CellSpec, DecodeServerSpec, Pool, load_pool_file

__all__ = ["DeploymentRef", "DeploymentWatch", "cells_from_status", "watch_pool_file"]

log = logging.getLogger("baton.gateway.discovery")


async def watch_pool_file(path: Path, pool: Pool, interval_s: float = 1.0) -> None:
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
            pool.update((await asyncio.to_thread(load_pool_file, path)).cells)
        except ValueError as exc:
            log.error("pool file not reloaded: %s", exc)
            continue
        log.info(
            "pool reloaded from %s: %d prefill, %d decode targets",
            path,
            len(pool.prefill),
            len(pool.decode),
        )


@dataclass(frozen=True, slots=True)
class DeploymentRef:
    namespace: str
    name: str
    kubeconfig: Path | None = None  # None: the pod's service account

    @classmethod
    def parse(cls, value: str, kubeconfig: Path | None) -> DeploymentRef:
        namespace, slash, name = value.partition("/")
        if not slash or not namespace or not name:
            raise ValueError(
                f"--model-deployment {value}: expected NAMESPACE/NAME, e.g. serving/dsv4"
            )
        return cls(namespace, name, kubeconfig)


def cells_from_status(status: Mapping[str, Any] | None) -> tuple[CellSpec, ...]:
    """The routable cells of a ModelDeployment status (cells without ready decode left out)."""
    endpoints = Endpoints.model_validate((status or {}).get("endpoints") or {})
    return tuple(
        CellSpec(
            name=cell.name,
            prefill=tuple(cell.prefill),
            decode=tuple(DecodeServerSpec(url=d.url, ranks=tuple(d.ranks)) for d in cell.decode),
        )
        for cell in endpoints.cells
        if cell.decode
    )


class DeploymentWatch:
    """Follows one ModelDeployment in a daemon thread (the kubernetes client blocks) and hands
    each changed set of cells to the pool on the gateway's event loop."""

    def __init__(self, ref: DeploymentRef, pool: Pool, loop: asyncio.AbstractEventLoop) -> None:
        self.ref, self.pool, self.loop = ref, pool, loop
        self._stop = threading.Event()
        self._applied: tuple[CellSpec, ...] | None = None
        self._thread = threading.Thread(target=self._run, name="mdep-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _api(self) -> client.CustomObjectsApi:
        if self.ref.kubeconfig is not None:
            return client.CustomObjectsApi(
                config.new_client_from_config(config_file=str(self.ref.kubeconfig))
            )
        config.load_incluster_config()
        return client.CustomObjectsApi()

    def _apply(self, obj: Mapping[str, Any]) -> None:
        try:
            cells = cells_from_status(obj.get("status"))
        except ValidationError as exc:
            log.error("status of %s/%s not understood: %s", self.ref.namespace, self.ref.name, exc)
            return
        if cells == self._applied:
            return
        self._applied = cells
        self.loop.call_soon_threadsafe(self.pool.update, cells)
        log.info(
            "pool from ModelDeployment %s/%s: %d cells, %d prefill, %d decode servers",
            self.ref.namespace,
            self.ref.name,
            len(cells),
            sum(len(c.prefill) for c in cells),
            sum(len(c.decode) for c in cells),
        )

    def _run(self) -> None:
        api = self._api()
        selector = f"metadata.name={self.ref.name}"
        while not self._stop.is_set():
            try:
                listing = json.loads(
                    api.list_namespaced_custom_object(
                        GROUP,
                        VERSION,
                        self.ref.namespace,
                        "modeldeployments",
                        field_selector=selector,
                        _preload_content=False,
                    ).data
                )
                for item in listing["items"]:
                    self._apply(item)
                stream = watch.Watch().stream(
                    api.list_namespaced_custom_object,
                    GROUP,
                    VERSION,
                    self.ref.namespace,
                    "modeldeployments",
                    field_selector=selector,
                    resource_version=listing["metadata"]["resourceVersion"],
                    timeout_seconds=30,
                )
                for event in stream:
                    if self._stop.is_set():
                        return
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._apply(event["raw_object"])
                    elif event["type"] == "DELETED":
                        self._apply({})
            except (ApiException, Urllib3Error, OSError, ValueError) as exc:
                log.warning("watching ModelDeployment %s: %s", self.ref.name, exc)
                self._stop.wait(1.0)
