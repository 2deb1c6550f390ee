"""The one door to glibc's `mallopt`: CPU ranks keep the memory their tensors free, as a GPU's caching allocator does.

A CPU tensor's storage is plain malloc'd memory. glibc serves blocks above its mmap threshold (at most 32 MiB) with
mmap and returns them to the system when they are freed, and trims the top of its heap the same way, so the next
activation of the same size page-faults all of its pages in again and the kernel zeroes each one: a training step
frees and reallocates its activations every micro batch. On a 2-core machine an exp over 64 MiB into new memory
took about 3x as long as into memory already mapped. `keep_freed_memory` turns both returns off for this process
(`M_MMAP_MAX` 0, `M_TRIM_THRESHOLD` at its largest): freed blocks stay in malloc's free lists and the next
allocation reuses them. The process's resident memory then stays at its high-water mark instead of following its
live tensors; its peak is unchanged but for fragmentation. torch's own CPU launcher reaches the same end by
preloading jemalloc or tcmalloc with decay turned off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
"""mallopt's parameter numbers (glibc's malloc.h)."""


def keep_freed_memory() -> bool:
    """Make this process's malloc keep and reuse freed memory; False where the C library is not glibc (nothing
    changed). Process-wide and irreversible: call it in a process that trains."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # only glibc has it (musl's mallopt ignores every parameter)
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
