"""Physical KV page allocation on integers only (no tensors here), with reusable prompt prefixes.

Per-sequence page tables (lists of physical page ids, indexed by logical page) live on the `Sequence`.

Prefix reuse: a full page whose content is identified by a key (a chain digest of the tokens up to it, inside a
namespace: `pdserve.cache.keys`) may be `register`ed. Pages are reference counted; a registered page whose last
holder frees it is not returned to the free list but kept as *evictable*, still holding its KV, so a later request
with the same prefix takes it (`share`) instead of recomputing or re-importing it. Evictable pages count as free:
`allocate` takes plain free pages first, then evicts the least recently released registered ones.

Forks (n > 1 / best_of): the sequences of one request hold the prompt's full pages together (`hold`: one more
hold on pages already held); each page returns to the pool when its last holder frees it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from pdserve.errors import OutOfPages

__all__ = ["OutOfPages", "PageAllocator"]


class PageAllocator:
    """Free-list allocator over page ids `0 .. num_pages-1`. Mutated on the engine thread only; `held_prefix` may be
    read from other threads (single dict lookups)."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end: low ids are handed out first, which keeps tests readable.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refs: dict[int, int] = {}  # allocated page -> holders
        self._page_of: dict[bytes, int] = {}  # registered key -> page
        self._key_of: dict[int, bytes] = {}  # registered page -> key
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, no holder; oldest release first

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out (plain free + evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages with at least one holder."""
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Registered pages (held or evictable)."""
        return len(self._key_of)

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages; all or nothing (raises OutOfPages, allocating none)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.num_free:
            raise OutOfPages(f"out of KV pages: need {n}, {self.num_free} free of {self.num_pages}")
        ids = []
        for _ in range(n):
            if self._free:
                ids.append(self._free.pop())
            else:  # the least recently released registered page: forget its content
                page, _ = self._evictable.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
                ids.append(page)
        for i in ids:
            self._refs[i] = 1
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Drop one hold on each page; a page nobody holds goes back to the pool (evictable if registered).
        Freeing a page that is not held (double free) raises ValueError, and then none of `ids` is freed."""
        ids = list(ids)
        bad = [i for i in ids if i not in self._refs]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"double free or unknown page ids: {bad or ids}")
        plain = []
        for i in ids:
            self._refs[i] -= 1
            if self._refs[i]:
                continue
            del self._refs[i]
            if i in self._key_of:
                self._evictable[i] = None
            else:
                plain.append(i)
        self._free.extend(reversed(plain))

    # ---- prefix reuse -----------------------------------------------------------------------------------
    def register(self, page: int, key: bytes) -> None:
        """Mark held page `page` as holding the KV that `key` identifies. A key that already names another page,
        or a page already registered, is left as it is."""
        if page not in self._refs:
            raise ValueError(f"page {page} is not held")
        if key in self._page_of or page in self._key_of:
            return
        self._page_of[key] = page
        self._key_of[page] = key

    def held_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """Pages of the longest run of `keys`, from the first, that are registered (nothing is taken)."""
        pages = []
        for k in keys:
            p = self._page_of.get(k)
            if p is None:
                break
            pages.append(p)
        return pages

    def num_evictable(self, pages: Iterable[int]) -> int:
        """How many of `pages` nobody holds (taking them lowers `num_free` by as many)."""
        return sum(1 for p in pages if p in self._evictable)

    def hold(self, pages: Iterable[int]) -> None:
        """Take one more hold on each of `pages`, all already held (a fork sharing its request's prompt pages).
        Raises ValueError, holding none, when one is not held."""
        pages = list(pages)
        bad = [p for p in pages if p not in self._refs]
        if bad:
            raise ValueError(f"cannot hold pages nobody holds: {bad}")
        for p in pages:
            self._refs[p] += 1

    def refcount(self, page: int) -> int:
        """Holders of `page` (0: free or evictable)."""
        return self._refs.get(page, 0)

    def share(self, pages: Iterable[int]) -> None:
        """Take one more hold on each registered page (`held_prefix`'s result)."""
        for p in pages:
            if p not in self._key_of:
                raise ValueError(f"page {p} holds no registered prefix")
            if p in self._evictable:
                del self._evictable[p]
                self._refs[p] = 1
            else:
                self._refs[p] += 1
