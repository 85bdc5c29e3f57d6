"""pdserve.server.gc_pauses: the start-up heap frozen out of the collector, and every collection timed by
generation into a real prometheus Histogram (a long one logged)."""

from __future__ import annotations

import gc
import logging

import pytest
from prometheus_client import CollectorRegistry, Histogram

from pdserve.server.gc_pauses import GcPauses, freeze_startup_heap
from pdserve.server.service_config import ServerOptions


def counts(h: Histogram) -> dict[str, float]:
    return {s.labels["generation"]: s.value for m in h.collect() for s in m.samples if s.name.endswith("_count")}


@pytest.fixture
def histogram():
    return Histogram("gc_pause_seconds", "pauses", ["generation"], registry=CollectorRegistry())


def test_each_collection_is_timed_by_generation_until_removed(histogram):
    pauses = GcPauses(histogram, warn_s=0.0, service="test").install()
    assert counts(histogram) == {"0": 0, "1": 0, "2": 0}  # exported from the start
    try:
        gc.collect(0)
        gc.collect(2)
        got = counts(histogram)
        assert got["0"] >= 1 and got["2"] >= 1 and pauses.longest_s > 0
    finally:
        pauses.remove()
    before = counts(histogram)
    gc.collect(2)
    assert counts(histogram) == before
    pauses.remove()  # twice: harmless


def test_a_pause_over_the_threshold_is_logged(histogram, caplog):
    pauses = GcPauses(histogram, warn_s=1e-9, service="prefill").install()
    try:
        with caplog.at_level(logging.WARNING, logger="pdserve"):
            gc.collect(2)
    finally:
        pauses.remove()
    assert any("prefill: garbage collection of generation 2 took" in r.message for r in caplog.records)


def test_the_startup_heap_is_frozen_out_of_full_collections():
    held = [[i] for i in range(50_000)]  # tracked containers alive at "start-up"
    try:
        frozen, took = freeze_startup_heap()
        # the count only shrinks afterwards (a frozen object freed, e.g. by another thread of this process)
        assert frozen >= gc.get_freeze_count() >= len(held) and took > 0
        assert not any(o is held for o in gc.get_objects(2))  # a full collection no longer walks them
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_gc_options_are_checked():
    assert ServerOptions().gc_freeze and ServerOptions().gc_warn_ms == 50.0
    assert "--gc-warn-ms must be >= 0" in ServerOptions(gc_warn_ms=-1).server_problems()
