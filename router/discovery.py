"""Where the pool's targets come from: flags, a YAML pool file (reloaded when it changes), and,
once the operator exists, ModelDeployment status (the same ``Pool.update`` seam)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from router.pool import Pool, load_pool_file

__all__ = ["watch_pool_file"]

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
            pool.update(await asyncio.to_thread(load_pool_file, path))
        except ValueError as exc:
            log.error("pool file not reloaded: %s", exc)
            continue
        log.info(
            "pool reloaded from %s: %d prefill, %d decode targets",
            path,
            len(pool.prefill),
            len(pool.decode),
        )
