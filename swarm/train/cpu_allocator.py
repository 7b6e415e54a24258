"""Keep freed memory inside the process on glibc, so CPU training steps stop re-faulting fresh pages.

Every step frees and re-allocates the same large activation, gradient and optimizer temporaries. glibc
serves big blocks with mmap and returns them to the kernel on free, so each step page-faults them in again;
on the 2-core machines here that measured 5-25% of a step. Disabling mmap-backed allocations and trimming
makes glibc reuse the freed blocks (the process keeps its peak heap, which a trainer reaches anyway).
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Tune glibc malloc as above. Returns False where glibc is not the allocator (nothing changes)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
