"""Physical KV page allocation on integers only (no tensors here).

Per-sequence page tables (lists of physical page ids, indexed by logical page) live on the `Sequence`.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.errors import OutOfPages

__all__ = ["OutOfPages", "PageAllocator"]


class PageAllocator:
    """Free-list allocator over page ids `0 .. num_pages-1`. Not thread-safe (engine thread only)."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end: low ids are handed out first, which keeps tests readable.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages; all or nothing (raises OutOfPages, allocating none)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"out of KV pages: need {n}, {len(self._free)} free of {self.num_pages}")
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return pages to the pool. Freeing a page that is not allocated (double free) raises ValueError,
        and then none of `ids` is freed."""
        ids = list(ids)
        bad = [i for i in ids if i not in self._used]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"double free or unknown page ids: {bad or ids}")
        for i in ids:
            self._used.remove(i)
        self._free.extend(reversed(ids))
