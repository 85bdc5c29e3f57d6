"""Host allocator settings for processes that move KV bytes through Python buffers.

Each KV batch on the `grpc` transport becomes a fresh multi-MB `bytes` object (sender: the serialized message;
receiver: gRPC's copy of it). glibc serves blocks that large with fresh `mmap`s and trims freed heap memory, so
every batch pays a page fault per 4 KiB touched, and building the messages runs at a fraction of memory speed
(a third, on the hosts tried: docs/benchmarks.md, KV transfer paths). Keeping
blocks up to `MMAP_THRESHOLD` in the heap, and freed memory up to `TRIM_THRESHOLD` mapped, makes the next
batch reuse pages that are already faulted in. The cost is retained RSS, bounded by the peak of in-flight batches.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

log = logging.getLogger("pdserve")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for this setting on 64-bit hosts (a KV batch is 8 MiB by default)
TRIM_THRESHOLD = 512 << 20


def tune_malloc() -> bool:
    """Keep multi-MB blocks in glibc's heap and freed memory mapped (see the module docstring). Returns whether
    the settings took (False on other C libraries: nothing changes there)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except (OSError, AttributeError):
        return False
    if ok:
        log.info(
            "malloc: blocks up to %d MiB from the heap, trim above %d MiB", MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20
        )
    return ok


def release_free_heap() -> bool:
    """Give the heap's free pages back to the system (glibc `malloc_trim`): after loading a model, the copies and
    temporaries it freed stay in RSS otherwise (the trim threshold above keeps up to 512 MiB). Returns whether
    memory was released (False on other C libraries)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        return bool(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False
