"""When a decode group may restart again, and when a tray that keeps failing is quarantined.

A wide-EP decode group restarts as a whole; restarts back off exponentially and a budget per
window stops a crash loop from restarting forever. Every Baton pod that fails counts against
its tray (annotation ``baton.dev/tray-failures``); at ``quarantine_after`` failures the tray is
quarantined (``baton.dev/quarantined``) and placement keeps off it. Pure: no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from baton.core.api import Reason
from baton.core.labels import QUARANTINED_ANNOTATION, TRAY_FAILURES_ANNOTATION
from controller.actions import Event, TrayMark

__all__ = ["RestartPolicy", "TrayFailure", "tray_marks"]


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How decode group restarts back off, and when a tray is quarantined.

    The ``n``-th restart within ``window`` waits ``base * 2**(n-2)`` (capped) after the previous
    one (the first is immediate); ``budget`` restarts within ``window`` stop further restarts.
    """

    base: timedelta = timedelta(seconds=5)
    cap: timedelta = timedelta(minutes=5)
    window: timedelta = timedelta(hours=1)
    budget: int = 10
    quarantine_after: int = 3

    def wait(self, recent: Sequence[datetime], now: datetime) -> timedelta | None:
        """Time left before the next restart may start; None when the budget is spent."""
        if len(recent) >= self.budget:
            return None
        if not recent:
            return timedelta(0)
        delay = min(self.base * 2 ** (len(recent) - 1), self.cap)
        return max(max(recent) + delay - now, timedelta(0))


@dataclass(frozen=True, slots=True)
class TrayFailure:
    """A Baton pod of ``deployment`` failed on ``tray``."""

    tray: str
    deployment: str


def tray_marks(
    failures: Sequence[TrayFailure],
    nodes: Sequence[Mapping[str, Any]],
    policy: RestartPolicy,
    now: str,
) -> tuple[list[TrayMark], list[Event]]:
    """New failure counts of the trays in ``failures`` and the quarantines they reach; the
    quarantine event goes to the deployment whose pod failed there last."""
    counts = Counter(failure.tray for failure in failures)
    culprits = {failure.tray: failure.deployment for failure in failures}
    by_name = {node["metadata"]["name"]: node for node in nodes}
    marks: list[TrayMark] = []
    events: list[Event] = []
    for tray, count in sorted(counts.items()):
        node = by_name.get(tray)
        if node is None:
            continue
        annotations = node["metadata"].get("annotations") or {}
        previous = annotations.get(TRAY_FAILURES_ANNOTATION, "0")
        total = (int(previous) if previous.isdigit() else 0) + count
        quarantine = None
        if total >= policy.quarantine_after and QUARANTINED_ANNOTATION not in annotations:
            quarantine = f"{total} Baton pod failures on this tray by {now}"
            events.append(
                Event(culprits[tray], "Warning", Reason.TRAY_QUARANTINED, f"{tray}: {quarantine}")
            )
        marks.append(TrayMark(tray, total, quarantine))
    return marks, events
