"""The garbage collector of a serving process: its start-up heap frozen, each of its pauses measured.

A full collection (the oldest generation) walks every tracked object of the process, with every thread stopped
(it holds the GIL). A service's start-up leaves a couple of hundred thousand of them (torch, transformers, grpc,
protobuf and OTel modules, the tokenizer's tables): one full collection then takes tens of ms (docs/benchmarks.md,
"Garbage collection of the services"). CPython runs one whenever the objects that survived
the younger collections since the last full one reach a quarter of the oldest generation: during serving, in the
middle of a prefill chunk's launch or a decode step, where it lands whole on a request's TTFT or TPOT.

`freeze_startup_heap()`, called once the service is ready, collects once and then moves every object alive into
the permanent generation (`gc.freeze`): later full collections walk only what was made since, so they stay short.
vLLM does the same after its start-up. `GcPauses` times each collection through `gc.callbacks` and keeps it by
generation for /metrics (`pdserve_gc_pause_seconds`, from the service's readiness on: the freeze's own collection
is logged, not counted); a pause over `warn_s` is logged.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

log = logging.getLogger("pdserve")


def freeze_startup_heap() -> tuple[int, float]:
    """Collect, then take every object alive out of the collector's reach: (objects frozen, seconds the collection
    took, i.e. what one full collection of the start-up heap costs)."""
    t0 = time.perf_counter()
    gc.collect()
    took = time.perf_counter() - t0
    gc.freeze()
    return gc.get_freeze_count(), took


class GcPauses:
    """Each garbage collection's wall time, by generation, into `histogram` (a prometheus Histogram labelled by
    `generation`); a pause longer than `warn_s` (> 0) is logged with what it collected."""

    def __init__(self, histogram: Any, warn_s: float, service: str):
        self.histogram = histogram
        self.warn_s = warn_s
        self.service = service
        self.longest_s = 0.0
        self._started = 0.0

    def install(self) -> GcPauses:
        for generation in range(len(gc.get_count())):  # every generation exported from the start, at 0
            self.histogram.labels(str(generation))
        gc.callbacks.append(self._on_gc)
        return self

    def remove(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        # Collections run one at a time (under the GIL), so one start time is enough.
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        self.longest_s = max(self.longest_s, took)
        self.histogram.labels(str(info.get("generation", -1))).observe(took)
        if 0 < self.warn_s < took:
            log.warning(
                "%s: garbage collection of generation %s took %.1f ms (%s objects collected, %d frozen)",
                self.service, info.get("generation"), took * 1e3, info.get("collected"), gc.get_freeze_count(),
            )  # fmt: skip
