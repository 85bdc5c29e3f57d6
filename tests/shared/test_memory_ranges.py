"""First-fit free ranges: taken ranges never overlap, giving back merges, a range given back twice is refused."""

from __future__ import annotations

import random

import pytest

from pdserve.memory_ranges import FreeRanges


def test_ranges_never_overlap_and_merge_back():
    r = FreeRanges(1 << 16, align=512)
    rng = random.Random(0)
    held: list[tuple[int, int]] = []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            off, n = held.pop(rng.randrange(len(held)))
            r.give(off, n)
        else:
            n = rng.randrange(1, 5000)
            off = r.take(n)
            if off is None:
                assert r.free_bytes < (1 << 16)
                continue
            assert off % 512 == 0
            spans = sorted([(o, o + r.size_of(m)) for o, m in held] + [(off, off + r.size_of(n))])
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "overlap"
            assert spans[-1][1] <= 1 << 16
            held.append((off, n))
    for off, n in held:
        r.give(off, n)
    assert r.free_bytes == 1 << 16 and r.take(1 << 16) == 0  # one range again


def test_a_range_given_back_twice_is_refused():
    r = FreeRanges(4096, align=512)
    off = r.take(100)
    assert off == 0 and r.take(4096) is None
    r.give(off, 100)
    with pytest.raises(ValueError, match="given back twice"):
        r.give(off, 100)
