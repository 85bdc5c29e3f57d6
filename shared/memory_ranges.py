"""Free byte ranges of a buffer, first fit (torch-free: helper processes use it too).

ranges = FreeRanges(nbytes, align=256)
offset = ranges.take(n)          # None when no free range is that large
ranges.give(offset, n)           # back, merged with its neighbours
"""

from __future__ import annotations


class FreeRanges:
    """Not thread-safe: callers hold their own lock."""

    def __init__(self, nbytes: int, align: int):
        self.align = align
        self.nbytes = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (start, end), sorted, merged

    def size_of(self, n: int) -> int:
        """What a request of `n` bytes takes (at least one `align` unit)."""
        return max(self.align, -(-n // self.align) * self.align)

    @property
    def free_bytes(self) -> int:
        return sum(e - s for s, e in self._free)

    def take(self, n: int) -> int | None:
        """The offset of `size_of(n)` bytes (first fit), or None."""
        size = self.size_of(n)
        for i, (s, e) in enumerate(self._free):
            if e - s >= size:
                if e - s == size:
                    del self._free[i]
                else:
                    self._free[i] = (s + size, e)
                return s
        return None

    def give(self, offset: int, n: int) -> None:
        """Return what `take(n)` gave at `offset`."""
        start, end = offset, offset + self.size_of(n)
        free = self._free
        i = 0
        while i < len(free) and free[i][0] < start:
            i += 1
        if (i > 0 and free[i - 1][1] > start) or (i < len(free) and free[i][0] < end):
            raise ValueError(f"range [{start}, {end}) given back twice or never taken")
        free.insert(i, (start, end))
        if i + 1 < len(free) and free[i][1] == free[i + 1][0]:  # merge with the next
            free[i] = (free[i][0], free[i + 1][1])
            del free[i + 1]
        if i > 0 and free[i - 1][1] == free[i][0]:  # and the previous
            free[i - 1] = (free[i - 1][0], free[i][1])
            del free[i]
