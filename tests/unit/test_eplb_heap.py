"""The EPLB service's heap (eplb.heap): large arrays go back to the OS when freed."""

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's malloc tunables"
)

# Frees a 16 MiB array (glibc then raises its mmap threshold to 16 MiB), then holds 16 arrays
# of the given size and prints how much the heap arena grew for them.
PROBE = """
import ctypes, sys
import numpy as np
from eplb.heap import bound_heap_growth

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
size = int(sys.argv[2])
if sys.argv[1] == "bounded":
    bound_heap_growth()
big = np.ones(16 << 20, dtype=np.uint8)
del big
before = libc.mallinfo2().arena
held = [np.ones(size, dtype=np.uint8) for _ in range(16)]
print(libc.mallinfo2().arena - before)
"""


def arena_growth(mode: str, size: int) -> int:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode, str(size)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(done.stdout)


# A window's row copy (MiBs), a load report's counts and a layer-by-expert sum (~130 KiB).
@pytest.mark.parametrize("size", [4 << 20, 140 << 10], ids=["window-copy", "report-counts"])
def test_large_arrays_are_mapped_not_carved_from_the_heap_once_bounded(size: int) -> None:
    # The soak's premise: by default a freed large block raises glibc's threshold, later
    # arrays below it come from the heap, and the space they leave stays in the process.
    assert arena_growth("default", size) > 8 * size
    assert arena_growth("bounded", size) < size
