"""Whether fetching a cached prefix from the shared store beats computing it, decided per lookup from measured
rates: the store's fetch bytes/s (measured by the cache over its recent fetches) against the engine's prefill
tokens/s (measured by the prefill service). A page costs `page_bytes / fetch_bytes_per_s` to fetch and
`page_size / prefill_tokens_per_s` to compute; the store is used only where fetching is faster. The local tier
(host memory) is not decided here: it serves hits at memory speed and is always used.

While either rate is unmeasured the store is used (that is how its rate gets measured; on CPU engines it is
always the faster path). A store measured slower is asked again once that measurement is `PROBE_AFTER_S` old
("probe"): one slow moment (a cold connection, a busy host) must not keep it unused for good, since only a fetch
measures it again. An engine that races the fetch (`PromptCache.lookup_racing`) always fetches: a fetch that
loses the race costs nothing; there the rates only decide whether the engine waits for pages about to land."""

from __future__ import annotations

from dataclasses import dataclass

PROBE_AFTER_S = 10.0  # a store measured slower is asked again after this long (its rate measured anew)


@dataclass(frozen=True)
class FetchDecision:
    fetch: bool
    reason: str  # "unmeasured" | "faster" | "slower" | "probe" (slower, but measured PROBE_AFTER_S ago or more)
    # | "race (<one of those>)": fetched while the engine computes (PromptCache.lookup_racing)
    fetch_tokens_per_s: float  # tokens/s the store delivers (0: unmeasured)
    prefill_tokens_per_s: float  # tokens/s the engine computes (0: unmeasured)

    def attributes(self) -> dict[str, object]:
        """Trace / log attributes of the decision."""
        return {
            "pdserve.cache.store_fetch": self.fetch,
            "pdserve.cache.store_decision": self.reason,
            "pdserve.cache.store_tokens_per_s": round(self.fetch_tokens_per_s),
            "pdserve.cache.prefill_tokens_per_s": round(self.prefill_tokens_per_s),
        }


def decide_fetch(
    fetch_bytes_per_s: float | None,
    page_bytes: float | None,
    page_size: int,
    prefill_tokens_per_s: float | None,
    measured_age_s: float | None = None,
    probe_after_s: float = PROBE_AFTER_S,
) -> FetchDecision:
    """Fetch from the store iff it delivers prompt tokens faster than prefill computes them (unmeasured: fetch;
    slower but measured `probe_after_s` or more ago: fetch, to measure it again). `page_bytes`: the stored size
    of one page (value bytes); `measured_age_s`: seconds since the fetch rate was last measured."""
    prefill = prefill_tokens_per_s or 0.0
    if not fetch_bytes_per_s or not page_bytes or not prefill:
        store = (fetch_bytes_per_s or 0.0) / page_bytes * page_size if page_bytes else 0.0
        return FetchDecision(True, "unmeasured", store, prefill)
    store = fetch_bytes_per_s / page_bytes * page_size
    if store > prefill:
        return FetchDecision(True, "faster", store, prefill)
    if measured_age_s is not None and measured_age_s >= probe_after_s:
        return FetchDecision(True, "probe", store, prefill)
    return FetchDecision(False, "slower", store, prefill)
