"""Keep the EPLB service's heap from growing with the arrays it frees.

The service allocates and frees arrays of several MiB per load report and per decision (a
report's counts, a window's sums, the algorithm's temporaries), some on worker threads. glibc's
malloc maps a block of 128 KiB or more with mmap and unmaps it on free, but it raises that
threshold to the size of each mapped block freed, up to 32 MiB; after the first large free such
arrays are carved from the heap arenas instead, one per thread, where the space they leave
stays with the process. Over a 30-minute soak that grew the service's RSS by a third while its
live arrays stayed the same size. Fixing the threshold (which also stops it moving) and bounding
the number of arenas keeps large blocks mapped, so freeing them returns them to the OS.
"""

from __future__ import annotations

import ctypes
import logging
import platform

__all__ = ["bound_heap_growth"]

log = logging.getLogger("baton.eplb")

# mallopt parameters (glibc malloc.h).
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

# Below the service's recurring mid-size blocks: a load report's counts (about 140 KiB for a
# batch of steps) and a layer-by-expert sum (43 x 384 int64, 129 KiB). At 256 KiB they were
# carved from the heap, whose free space still grew by 32 MiB in 7 minutes.
MMAP_THRESHOLD = 64 << 10
ARENA_MAX = 2


def bound_heap_growth() -> None:
    """Fix glibc's mmap threshold and arena count for this process; a no-op elsewhere."""
    if platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL(None)
    fixed = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(
        _M_ARENA_MAX, ARENA_MAX
    )
    if not fixed:
        log.warning("glibc refused the malloc thresholds; freed arrays may stay in the heap")
