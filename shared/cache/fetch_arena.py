"""Host memory shared with the prefix fetch's helper process: one memfd mapping, pinned for CUDA copies, carved
into blocks first fit.

    arena = SharedArena(nbytes, pin=True)       the mapping (arena.fd goes to the helper, which maps it too)
    block = arena.alloc(n)                      a block of n bytes (ALIGN-aligned), None when none is free
    block.tensor                                uint8 [n] view of it (pinned memory on CUDA)
    arena.release(block, event)                 free once `event` (a CUDA event of its last copy; None: now) is done

A memfd has no name in the file system: it goes away with the last process that maps it, whatever way they end.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass

import torch

from pdserve.memory_ranges import FreeRanges

ALIGN = 256  # block starts (device views of any dtype; the fetch's slots are aligned to this too)


@dataclass
class ArenaBlock:
    offset: int  # bytes from the arena's start (what the helper writes at)
    nbytes: int
    tensor: torch.Tensor  # uint8 [nbytes]


class SharedArena:
    def __init__(self, nbytes: int, pin: bool = False):
        """`nbytes` of shared memory (rounded up to ALIGN); `pin`: registered with CUDA (page-locked, so copies to
        the GPU run asynchronously at full speed)."""
        if nbytes <= 0:
            raise ValueError(f"arena size must be > 0, got {nbytes}")
        self.nbytes = -(-nbytes // ALIGN) * ALIGN
        self.fd = os.memfd_create("pdserve-fetch-arena", 0)
        try:
            os.ftruncate(self.fd, self.nbytes)
            self._mm = mmap.mmap(self.fd, self.nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)  # [nbytes]
        self.pinned = False
        if pin:
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of the {self.nbytes}-byte fetch arena failed: {err}")
            self.pinned = True
        self._lock = threading.Lock()
        self._ranges = FreeRanges(self.nbytes, ALIGN)
        self._pending: list[tuple[int, int, object]] = []  # released blocks whose last copy may still run

    @property
    def free_bytes(self) -> int:
        with self._lock:
            self._reap_locked()
            return self._ranges.free_bytes

    def alloc(self, nbytes: int) -> ArenaBlock | None:
        """A block of at least `nbytes` (first fit), or None when no free range is that large."""
        size = self._ranges.size_of(nbytes)
        with self._lock:
            self._reap_locked()
            s = self._ranges.take(size)
        return None if s is None else ArenaBlock(s, size, self.tensor[s : s + size])

    def release(self, block: ArenaBlock, event: object | None = None) -> None:
        """Give `block` back: at once, or when `event` (a torch.cuda.Event) has completed."""
        with self._lock:
            if event is not None:
                self._pending.append((block.offset, block.nbytes, event))
            else:
                self._ranges.give(block.offset, block.nbytes)

    def _reap_locked(self) -> None:
        still = []
        for s, n, ev in self._pending:
            if ev.query():  # type: ignore[attr-defined]
                self._ranges.give(s, n)
            else:
                still.append((s, n, ev))
        self._pending = still

    def close(self) -> None:
        """Unpin and unmap (no block may be in use)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = torch.empty(0, dtype=torch.uint8)
        try:
            self._mm.close()
        except BufferError:  # a view still exists somewhere: the mapping goes with the process
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
