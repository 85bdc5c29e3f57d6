"""The handoff's bounds on a silent peer.

AckClock    prefill: how long decode has left a shipped page unacknowledged (`ack_timeout_s`)
Watchdog    decode: how long since the last message from prefill; cancels the stream
PageBudget  decode: that bound, scaled with the work ahead of the next page (`page_timeout_s` its floor,
            `page_timeout_max_s` its ceiling, `page_timeout_slack` its margin over the expected time)
PeerLoads   decode: per prefill instance, the prompt tokens still to arrive over this decode's open transfers from
            it (a request's batch mates included) and the rate tokens arrived at; `TransferWork` is one request's part

A long prompt's chunk may take longer than `page_timeout_s` on a slow host, and every request batched in the same
step waits as long for its pages. So the wait allowed for the next page is the expected time of everything this
decode still awaits from that instance (`tokens ahead / measured tokens per second`) times the slack, never below the
floor nor above the ceiling; before any rate is measured it is the floor.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.telemetry.rates import WorkRate


class AckClock:
    """Ship times by seq_no and how far decode's cumulative acks reach. `shipped` runs on the RPC thread, `acked`
    on the ack reader thread; each is a single list append / int store, so no lock is needed."""

    def __init__(self) -> None:
        self._shipped_at: list[float] = []  # monotonic time each seq_no was handed to gRPC
        self._acked = 0  # seq_nos below this are acknowledged

    def shipped(self, num_pages: int = 1) -> None:
        now = time.monotonic()
        self._shipped_at.extend([now] * num_pages)

    def acked(self, seq_no: int) -> None:
        self._acked = max(self._acked, seq_no + 1)

    @property
    def num_acked(self) -> int:
        return self._acked

    @property
    def num_shipped(self) -> int:
        return len(self._shipped_at)

    def oldest_unacked_age(self, now: float | None = None) -> float:
        """Seconds since the oldest unacknowledged page was shipped; 0 when every shipped page is acknowledged."""
        acked, shipped = self._acked, self._shipped_at
        if acked >= len(shipped):
            return 0.0
        return (time.monotonic() if now is None else now) - shipped[acked]


class Watchdog:
    """Calls `on_expire` once (on its own thread) when `feed` has not been called for `timeout_s` seconds (a number,
    or a function read again at least every `recheck_s`, so a bound that grows or shrinks with the work applies at
    once); `stop` ends it without calling. `expired` tells the caller why its blocked call was cancelled;
    `expired_after` is the bound that passed."""

    def __init__(
        self,
        timeout_s: float | Callable[[], float],
        on_expire: Callable[[], object],
        name: str = "watchdog",
        recheck_s: float = 1.0,
    ):
        self._timeout = timeout_s if callable(timeout_s) else (lambda: float(timeout_s))
        self.expired = False
        self.expired_after = 0.0
        self._on_expire = on_expire
        self._recheck_s = recheck_s
        self._last = time.monotonic()  # last feed; a float store, read by the watchdog thread
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def timeout_s(self) -> float:
        return self._timeout()

    def feed(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()

    def _run(self) -> None:
        with self._cv:
            while not self._stopped:
                bound = self._timeout()
                left = self._last + bound - time.monotonic()
                if left <= 0:
                    self.expired, self.expired_after = True, bound
                    break
                self._cv.wait(min(left, self._recheck_s))
        if self.expired:
            self._on_expire()


@dataclass(frozen=True)
class PageBudget:
    """The wait allowed for the next page: `slack` x the expected time of the work ahead, within
    [floor_s, ceiling_s]; the floor while no rate is known."""

    floor_s: float  # page_timeout_s
    ceiling_s: float  # page_timeout_max_s
    slack: float  # page_timeout_slack

    def seconds(self, tokens_ahead: int, tokens_per_s: float | None) -> float:
        if not tokens_per_s or tokens_ahead <= 0:
            return self.floor_s
        return min(self.ceiling_s, max(self.floor_s, self.slack * tokens_ahead / tokens_per_s))


class PeerLoad:
    """Decode's view of one prefill instance: the prompt tokens still to arrive over this decode's open transfers
    from it, and the rate they arrived at (tokens per second while some were awaited: chunk compute, queueing behind
    other work and the transfer together). Thread-safe."""

    def __init__(self, budget: PageBudget) -> None:
        self.budget = budget
        self._lock = threading.Lock()
        self._ahead = 0  # tokens awaited over the open transfers
        self._since: float | None = None  # monotonic: last arrival, or when tokens began to be awaited
        self._rate = WorkRate(tau_s=120.0, min_seconds=0.05)

    def add(self, tokens: int) -> None:
        with self._lock:
            if self._ahead <= 0:
                self._since = time.monotonic()
            self._ahead += tokens

    def arrived(self, tokens: int) -> None:
        """`tokens` of some open transfer arrived: a rate sample over the time since the last arrival."""
        if tokens <= 0:
            return
        with self._lock:
            now = time.monotonic()
            if self._since is not None:
                self._rate.add(tokens, now - self._since)
            self._since = now
            self._ahead = max(0, self._ahead - tokens)

    def remove(self, tokens: int) -> None:
        """A transfer ended with `tokens` it no longer awaits."""
        with self._lock:
            self._ahead = max(0, self._ahead - tokens)
            if self._ahead == 0:
                self._since = None

    @property
    def tokens_ahead(self) -> int:
        return self._ahead

    def rate(self) -> float | None:
        return self._rate.rate()

    def timeout_s(self) -> float:
        return self.budget.seconds(self._ahead, self.rate())


class TransferWork:
    """One request's part of a `PeerLoad`: its prompt tokens, counted off as its pages arrive; `close` (idempotent)
    takes what never arrived off the peer's load."""

    def __init__(self, load: PeerLoad, tokens: int) -> None:
        self.load, self._left = load, tokens
        self._lock = threading.Lock()
        load.add(tokens)

    def arrived(self, tokens: int) -> None:
        with self._lock:
            tokens = min(tokens, self._left)
            self._left -= tokens
        self.load.arrived(tokens)

    def timeout_s(self) -> float:
        """The wait allowed now for this request's next message (the peer's whole load ahead of it)."""
        return self.load.timeout_s()

    def describe(self) -> str:
        rate = self.load.rate()
        scaled = f"{self.load.tokens_ahead} prompt tokens ahead at {rate:.0f} tokens/s" if rate else "no rate yet"
        b = self.load.budget
        return f"page_timeout_s={b.floor_s:g}s, scaled to the work: {scaled}, slack {b.slack:g}, max {b.ceiling_s:g}s"

    def close(self) -> None:
        with self._lock:
            left, self._left = self._left, 0
        self.load.remove(left)


class PeerLoads:
    """Decode's `PeerLoad` of every prefill instance it pulls pages from (one per target address)."""

    def __init__(self, budget: PageBudget) -> None:
        self.budget = budget
        self._lock = threading.Lock()
        self._peers: dict[str, PeerLoad] = {}

    def open(self, peer: str, tokens: int) -> TransferWork:
        """A transfer of `tokens` prompt tokens from `peer` begins."""
        with self._lock:
            load = self._peers.setdefault(peer, PeerLoad(self.budget))
        return TransferWork(load, tokens)
