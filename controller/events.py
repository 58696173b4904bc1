"""Which Kubernetes Event one of the controller's events becomes, the way client-go's recorder
decides it (its EventCorrelator's logger): the first occurrence creates an Event; the same
event again (same object, type, reason and message) bumps that Event's ``count`` and
``lastTimestamp`` instead of adding another, so ``kubectl describe`` shows "x3 over 5m" and no
occurrence is lost. Remembered occurrences are bounded (least recently seen forgotten first, as
client-go's LRU cache of 4,096), and an Event the API server has expired (events live an hour
by default) is created afresh.

Pure: no I/O; the reconciler writes what this decides.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["EventKey", "EventWrite", "Occurrences"]

# (namespace, involved object's uid, type, reason, message)
EventKey = tuple[str, str, str, str, str]


@dataclass(frozen=True, slots=True)
class EventWrite:
    """Create Event ``name`` (``count`` 1) or patch it to ``count`` and ``last_timestamp``."""

    name: str
    count: int
    first_timestamp: str
    last_timestamp: str

    @property
    def create(self) -> bool:
        return self.count == 1


class Occurrences:
    """The Events already written, by what they say."""

    def __init__(self, capacity: int = 4096) -> None:
        self._capacity = capacity
        self._seen: OrderedDict[EventKey, EventWrite] = OrderedDict()

    def record(self, key: EventKey, name: str, now: str) -> EventWrite:
        """The write for one more occurrence of ``key``; ``name`` names a new Event."""
        before = self._seen.pop(key, None)
        if before is None:
            write = EventWrite(name, 1, now, now)
        else:
            write = EventWrite(before.name, before.count + 1, before.first_timestamp, now)
        self._seen[key] = write
        while len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
        return write

    def forget(self, key: EventKey) -> None:
        """The Event is gone (expired): the next occurrence creates a new one."""
        self._seen.pop(key, None)
