"""Keep freed host memory in the process (glibc), so big CPU tensors stop paying page faults on every call.

glibc's malloc serves every request above 32 MB (its largest mmap threshold) with a fresh mmap and returns it to the
kernel on free. A banded-attention call on the CPU allocates several such buffers (padded q/k/v, span gradients of
3x the size of k), so every call touched fresh pages: zero-filling them cost ~30% of an SA forward+backward at
n=8192 (bench/attention.py; the torch profiler shows it as aten::fill_ and copies). PyTorch's CPU tuning guide
recommends a caching allocator (jemalloc, tcmalloc) for the same reason; glibc's own knobs get most of it without a
new dependency: serve everything from the heap (M_MMAP_MAX=0) and keep up to `keep_bytes` of freed memory at its top
(M_TRIM_THRESHOLD). The cost: the process holds on to its peak memory instead of giving it back between steps.

train.py, evaluate.py and the benchmarks call it once at start-up; SA_CPU_MALLOC=0 in the environment turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's malloc.h
_applied: bool | None = None


def keep_freed_memory(keep_bytes: int = 2**31 - 1) -> bool:
    """Apply the glibc settings once per process; False where they do not apply (not glibc, or turned off)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("SA_CPU_MALLOC", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, int(keep_bytes)))
    return _applied
