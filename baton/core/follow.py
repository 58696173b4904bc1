"""Following one ModelDeployment on the Kubernetes API: what the gateway and the EPLB service
use to learn their endpoints from its status (``status.endpoints``, written by the controller).

The official kubernetes client blocks, so the follower runs in a daemon thread: list the object
(by field selector), then watch it from that resourceVersion; a watch that ends or fails starts
over after a second. Every version seen is handed to ``on_object`` (``{}`` once deleted).
:class:`StatusFollower` is what both services use: each changed reading of the object, handed
to their event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError
from urllib3.exceptions import HTTPError as Urllib3Error

from baton.core.api import GROUP, PLURAL, VERSION
from baton.core.kube import api_client, raw_json

__all__ = ["DeploymentRef", "ModelDeploymentFollower", "StatusFollower", "custom_objects_api"]

log = logging.getLogger("baton.core.follow")
T = TypeVar("T")


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

    @property
    def key(self) -> str:
        """NAMESPACE/NAME, as the flag gives it and metrics label it."""
        return f"{self.namespace}/{self.name}"


def custom_objects_api(ref: DeploymentRef) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api_client(ref.kubeconfig))


class ModelDeploymentFollower:
    def __init__(self, ref: DeploymentRef, on_object: Callable[[Mapping[str, Any]], None]) -> None:
        self.ref = ref
        self.on_object = on_object
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mdep-follower", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        api = custom_objects_api(self.ref)
        where = (GROUP, VERSION, self.ref.namespace, PLURAL)
        selector = f"metadata.name={self.ref.name}"
        while not self._stop.is_set():
            try:
                listing = raw_json(
                    api.list_namespaced_custom_object(
                        *where, field_selector=selector, _preload_content=False
                    )
                )
                for item in listing["items"]:
                    self.on_object(item)
                stream = watch.Watch().stream(
                    api.list_namespaced_custom_object,
                    *where,
                    field_selector=selector,
                    resource_version=listing["metadata"]["resourceVersion"],
                    timeout_seconds=30,
                )
                for event in stream:
                    if self._stop.is_set():
                        return
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self.on_object(event["raw_object"])
                    elif event["type"] == "DELETED":
                        self.on_object({})
            except (ApiException, Urllib3Error, OSError, ValueError) as exc:
                log.warning("following ModelDeployment %s: %s", self.ref.name, exc)
                self._stop.wait(1.0)


class StatusFollower(Generic[T]):
    """Follows one ModelDeployment and hands each changed reading of it to ``on_change`` on an
    event loop: ``read`` turns the object into what its user needs (a ValidationError is logged
    and the last reading stays); equal readings are not handed on; once the loop has closed (its
    process shutting down) readings are dropped."""

    def __init__(
        self,
        ref: DeploymentRef,
        loop: asyncio.AbstractEventLoop,
        read: Callable[[Mapping[str, Any]], T],
        on_change: Callable[[T], None],
    ) -> None:
        self.ref = ref
        self._loop = loop
        self._read = read
        self._on_change = on_change
        self._last: T | None = None
        self._follower = ModelDeploymentFollower(ref, self._seen)

    def start(self) -> None:
        self._follower.start()

    def stop(self) -> None:
        self._follower.stop()

    def _seen(self, obj: Mapping[str, Any]) -> None:
        try:
            reading = self._read(obj)
        except ValidationError as exc:
            log.error("%s/%s not understood: %s", self.ref.namespace, self.ref.name, exc)
            return
        try:
            self._loop.call_soon_threadsafe(self._deliver, reading)
        except RuntimeError:  # the loop closed under us: the process is shutting down
            return

    def _deliver(self, reading: T) -> None:
        if reading != self._last:
            self._last = reading
            self._on_change(reading)
