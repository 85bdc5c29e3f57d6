"""Whether fetching a cached prefix from the shared store beats computing it, decided per lookup from measured
rates: the store's fetch bytes/s (measured by the cache over its recent fetches) against the engine's prefill
tokens/s (measured by the prefill service). A page costs `page_bytes / fetch_bytes_per_s` to fetch and
`page_size / prefill_tokens_per_s` to compute; the store is used only where fetching is faster. The local tier
(host memory) is not decided here: it serves hits at memory speed and is always used.

While either rate is unmeasured the store is used (that is how its rate gets measured; on CPU engines it is
always the faster path)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FetchDecision:
    fetch: bool
    reason: str  # "unmeasured" | "faster" | "slower"
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
    fetch_bytes_per_s: float | None, page_bytes: float | None, page_size: int, prefill_tokens_per_s: float | None
) -> FetchDecision:
    """Fetch from the store iff it delivers prompt tokens faster than prefill computes them (unmeasured: fetch).
    `page_bytes`: the stored size of one page (value bytes)."""
    prefill = prefill_tokens_per_s or 0.0
    if not fetch_bytes_per_s or not page_bytes or not prefill:
        store = (fetch_bytes_per_s or 0.0) / page_bytes * page_size if page_bytes else 0.0
        return FetchDecision(True, "unmeasured", store, prefill)
    store = fetch_bytes_per_s / page_bytes * page_size
    return FetchDecision(store > prefill, "faster" if store > prefill else "slower", store, prefill)
