"""Fault injection into ``baton sim`` engines, for tests, drills and the chaos suite.

An engine serves ``POST /sim/faults`` only with ``--enable-fault-injection`` and a token file;
:class:`FaultInjection` holds that token and sends it.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import httpx

__all__ = ["FaultInjection"]


class FaultInjection:
    """A fault-injection token in ``directory`` (created there, mode 0600), the engine flags
    that require it, and the call that uses it."""

    def __init__(self, directory: Path) -> None:
        self.token_file = directory / "fault-injection-token"
        self.token_file.touch(mode=0o600)
        self.token_file.write_text(secrets.token_urlsafe(24))

    @property
    def flags(self) -> tuple[str, ...]:
        """``baton sim`` flags: serve ``POST /sim/faults`` to holders of this token."""
        return ("--enable-fault-injection", "--fault-injection-token-file", str(self.token_file))

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token_file.read_text()}"}

    def inject(self, engine: str, **fault: Any) -> httpx.Response:
        """``POST /sim/faults`` on the engine at URL ``engine``; raises unless it took it."""
        response = httpx.post(f"{engine}/sim/faults", json=fault, headers=self.headers, timeout=10)
        response.raise_for_status()
        return response
