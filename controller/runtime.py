"""The controller's machinery, as controller-runtime and client-go shape it: informers (list, then
watch, into a local cache), a work queue (a key queued twice is reconciled once; failures retry
with exponential backoff; delayed requeues), and the loop that feeds keys to the reconciler.

Objects are kept as the API's JSON dicts (``_preload_content=False``): the pure decision reads
them as they are, and thousands of pods need no model objects.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from kubernetes import watch
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as Urllib3Error

from baton.core.kube import raw_json

__all__ = ["Informer", "WorkQueue"]

log = logging.getLogger("baton.controller")
Obj = dict[str, Any]
Key = Hashable


def _key(obj: Obj) -> tuple[str, str]:
    meta = obj.get("metadata", {})
    return meta.get("namespace", ""), meta.get("name", "")


class Informer:
    """One resource kind, listed and then watched into a cache; ``on_event(kind, old, new)``.

    A watch that ends (server timeout) resumes from the last resourceVersion; one that expired
    (410 Gone) or failed relists after a second, and the relist reports every difference.
    """

    def __init__(
        self,
        name: str,
        list_call: Callable[..., Any],
        on_event: Callable[[str, Obj | None, Obj | None], None],
        **selectors: str,
    ) -> None:
        self.name = name
        self._list = list_call
        self._on_event = on_event
        self._selectors = selectors
        self._cache: dict[tuple[str, str], Obj] = {}
        self._lock = threading.Lock()
        self.synced = threading.Event()
        self._watch: watch.Watch | None = None

    def items(self) -> list[Obj]:
        with self._lock:
            return list(self._cache.values())

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                version = self._relist()
                self.synced.set()
                while not stop.is_set():
                    version = self._watch_from(version)
            except (ApiException, Urllib3Error, OSError, ValueError) as exc:
                if stop.is_set():
                    return
                log.warning("%s informer: %s; relisting", self.name, exc)
                stop.wait(1.0)

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.stop()

    def _relist(self) -> str:
        response = self._list(_preload_content=False, **self._selectors)
        listing = raw_json(response)
        fresh = {_key(item): item for item in listing.get("items", [])}
        with self._lock:
            old, self._cache = self._cache, fresh
        for key, item in fresh.items():
            before = old.get(key)
            if before is None or before["metadata"].get("resourceVersion") != item["metadata"].get(
                "resourceVersion"
            ):
                self._on_event("ADDED" if before is None else "MODIFIED", before, item)
        for key, item in old.items():
            if key not in fresh:
                self._on_event("DELETED", item, None)
        version: str = listing["metadata"]["resourceVersion"]
        return version

    def _watch_from(self, version: str) -> str:
        """Follow the watch until the server ends it; the version to resume from."""
        self._watch = watch.Watch()
        stream = self._watch.stream(
            self._list,
            resource_version=version,
            timeout_seconds=30,
            allow_watch_bookmarks=True,
            **self._selectors,
        )
        # An expired version (410 Gone) ends the stream as an ApiException: ``run`` relists.
        for event in stream:
            if event is None:
                continue  # an empty line between events
            kind, obj = event["type"], event["raw_object"]
            version = obj["metadata"]["resourceVersion"]
            if kind == "BOOKMARK":
                continue
            key = _key(obj)
            with self._lock:
                old = self._cache.get(key)
                if kind == "DELETED":
                    self._cache.pop(key, None)
                else:
                    self._cache[key] = obj
            self._on_event(kind, old, None if kind == "DELETED" else obj)
        return version


class WorkQueue:
    """Keys to reconcile, as client-go's rate-limited work queue keeps them.

    A key added while queued is queued once; added while being processed, it is queued again
    after ``done``, so one key is never reconciled twice at once. ``retry`` re-adds a failed key
    after ``base * 2**failures`` (capped); ``forget`` resets its count; ``add_after`` wakes a key
    later (a backoff to wait out).
    """

    def __init__(self, base_s: float = 0.005, cap_s: float = 60.0) -> None:
        self._base, self._cap = base_s, cap_s
        self._queue: list[Key] = []
        self._dirty: set[Key] = set()
        self._processing: set[Key] = set()
        self._failures: dict[Key, int] = {}
        self._later: list[tuple[float, int, Key]] = []
        self._sequence = 0
        self._cond = threading.Condition()
        self._closed = False

    def add(self, key: Key) -> None:
        with self._cond:
            if self._closed or key in self._dirty:
                return
            self._dirty.add(key)
            if key not in self._processing:
                self._queue.append(key)
                self._cond.notify()

    def add_after(self, key: Key, delay_s: float) -> None:
        if delay_s <= 0:
            self.add(key)
            return
        with self._cond:
            self._sequence += 1
            heapq.heappush(self._later, (time.monotonic() + delay_s, self._sequence, key))
            self._cond.notify()

    def retry(self, key: Key) -> float:
        with self._cond:
            failures = self._failures.get(key, 0)
            self._failures[key] = failures + 1
        delay: float = min(self._base * 2**failures, self._cap)
        self.add_after(key, delay)
        return delay

    def forget(self, key: Key) -> None:
        with self._cond:
            self._failures.pop(key, None)

    def get(self, timeout_s: float = 1.0) -> Key | None:
        """The next key (now being processed), or None at timeout or after ``close``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                now = time.monotonic()
                while self._later and self._later[0][0] <= now:
                    _, _, key = heapq.heappop(self._later)
                    if key not in self._dirty:
                        self._dirty.add(key)
                        if key not in self._processing:
                            self._queue.append(key)
                if self._queue and not self._closed:
                    key = self._queue.pop(0)
                    self._dirty.discard(key)
                    self._processing.add(key)
                    return key
                if self._closed or now >= deadline:
                    return None
                wake = deadline
                if self._later:
                    wake = min(wake, self._later[0][0])
                self._cond.wait(max(wake - now, 0.001))

    def done(self, key: Key) -> None:
        with self._cond:
            self._processing.discard(key)
            if key in self._dirty:
                self._queue.append(key)
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)
