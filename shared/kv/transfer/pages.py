"""Page states of one transfer, on both ends, independent of the transport. The states drive freeing: each
object holds the callback that gives the request's pages back to its engine and calls it exactly once.

Sender (prefill):   FILLING → SHIPPED → ACKED → FREED   (FILLING: allocated, being computed or exported)
Receiver (decode):  ALLOCATED → FILLING → FILLED → ACKED → (handed to the engine's sequence) | FREED on failure
                    (FILLING: a batch claimed the page, its bytes are being fetched and checked)

The sender frees its pages only when every page is acknowledged or the transfer is abandoned (cancel,
deadline, error): never while the receiver may still be reading them. The receiver's pages are allocated when
the transfer begins (`engine.begin_import`) and freed on any failure before the transfer completes. Sequence
numbers make gaps, repeats and reordering detectable; a transfer that ends with a page missing is an error,
never a silent wrong answer.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Sequence

from pdserve.errors import TransferError  # DATA_LOSS on both ends (pdserve.server.status)


class PageState(enum.Enum):
    ALLOCATED = "allocated"
    FILLING = "filling"
    FILLED = "filled"
    SHIPPED = "shipped"
    ACKED = "acked"
    FREED = "freed"


class _FreeOnce:
    def __init__(self, free: Callable[[], object] | None):
        self._free = free
        self._done = False

    def __call__(self) -> bool:
        """Run the callback unless it ran already; True if this call ran it."""
        if self._done:
            return False
        self._done = True
        if self._free is not None:
            self._free()
        return True


class SenderPages:
    """Prefill-side state of one request's pages. Thread-safe (the writer ships, the ack reader acks, the RPC's
    end abandons). `free` gives the pages back to the engine; it runs once, when every page is acked or on
    `abandon`."""

    def __init__(self, request_id: str, num_pages: int, free: Callable[[], object] | None = None):
        self.request_id = request_id
        self._lock = threading.Lock()
        self.states = [PageState.FILLING] * num_pages
        self._seq_page: list[int] = []  # seq_no -> logical page index
        self._acked_upto = -1  # highest cumulatively acked seq_no
        self._free = _FreeOnce(free)
        self.bytes_shipped = 0

    def ship(self, page_indexes: Sequence[int], nbytes: int) -> int:
        """Mark pages shipped (in this order); returns the seq_no of the first."""
        with self._lock:
            first = len(self._seq_page)
            for p in page_indexes:
                if not 0 <= p < len(self.states):
                    raise TransferError(f"page {p} outside the request's {len(self.states)} pages")
                if self.states[p] is not PageState.FILLING:
                    raise TransferError(f"page {p} shipped twice or after free ({self.states[p].value})")
            for p in page_indexes:
                self.states[p] = PageState.SHIPPED
                self._seq_page.append(p)
            self.bytes_shipped += nbytes
            return first

    def ack(self, seq_no: int) -> bool:
        """Cumulative ack: every page with seq number ≤ seq_no is held by the receiver. Frees the pages when
        that makes every page acked; returns True if this call freed them."""
        with self._lock:
            if seq_no >= len(self._seq_page):
                raise TransferError(f"ack {seq_no} for a page never shipped (shipped {len(self._seq_page)})")
            for s in range(self._acked_upto + 1, seq_no + 1):
                if self.states[self._seq_page[s]] is PageState.SHIPPED:
                    self.states[self._seq_page[s]] = PageState.ACKED
            self._acked_upto = max(self._acked_upto, seq_no)
            if not all(s is PageState.ACKED for s in self.states):
                return False
            self.states = [PageState.FREED] * len(self.states)
            return self._free()

    def abandon(self) -> bool:
        """The transfer ended early (cancel, deadline, error): free the pages now. True if this call freed them."""
        with self._lock:
            self.states = [PageState.FREED] * len(self.states)
            return self._free()

    @property
    def num_shipped(self) -> int:
        return len(self._seq_page)

    @property
    def num_acked(self) -> int:
        return self._acked_upto + 1

    @property
    def freed(self) -> bool:
        return self._free._done

    def all_acked(self) -> bool:
        with self._lock:
            return self._acked_upto + 1 == len(self.states) == len(self._seq_page)


class ReceiverPages:
    """Decode-side state of one request's incoming pages (thread-safe). `free` gives the pages
    reserved at begin back to the engine; it runs once, on `fail`, unless the transfer completed."""

    def __init__(self, request_id: str, num_pages: int, free: Callable[[], object] | None = None):
        self.request_id = request_id
        self.states = [PageState.ALLOCATED] * num_pages
        self._lock = threading.Lock()  # the stream's reader claims batches; fetch workers fill them
        self.next_claim = 0  # seq_no the next arriving batch must start at
        self.next_seq_no = 0  # seq_no after the last filled page
        self.bytes_received = 0
        self._free = _FreeOnce(free)
        self.completed = False

    def check(self, first_seq_no: int, page_indexes: Sequence[int]) -> None:
        """Validate an arriving batch before any byte of it is written and claim its pages (FILLING); raises
        TransferError. Batches are claimed in arrival order; their bytes may be fetched concurrently."""
        with self._lock:
            if first_seq_no != self.next_claim:
                raise TransferError(f"expected page seq_no {self.next_claim}, got {first_seq_no}")
            seen = set()
            for p in page_indexes:
                if not 0 <= p < len(self.states):
                    raise TransferError(f"page index {p} outside the {len(self.states)} reserved pages")
                if self.states[p] is not PageState.ALLOCATED or p in seen:
                    raise TransferError(f"page {p} received twice")
                seen.add(p)
            for p in page_indexes:
                self.states[p] = PageState.FILLING
            self.next_claim += len(page_indexes)

    def filled(self, page_indexes: Sequence[int], nbytes: int) -> int:
        """The batch's bytes are held here (batches in claim order); returns the seq_no to acknowledge
        (cumulative)."""
        with self._lock:
            for p in page_indexes:
                if self.states[p] is not PageState.FILLING:
                    raise TransferError(f"page {p} filled while {self.states[p].value}")
                self.states[p] = PageState.FILLED
            self.next_seq_no += len(page_indexes)
            self.bytes_received += nbytes
            return self.next_seq_no - 1

    def acked(self) -> None:
        with self._lock:
            self.states = [PageState.ACKED if s is PageState.FILLED else s for s in self.states]

    def complete(self, num_pages_announced: int) -> None:
        """At PrefillDone: every reserved page must have arrived exactly once. Then the engine's sequence owns
        the pages (freed when it finishes); `fail` no longer frees them."""
        missing = [i for i, s in enumerate(self.states) if s in (PageState.ALLOCATED, PageState.FILLING)]
        if missing or num_pages_announced != self.next_seq_no:
            raise TransferError(
                f"transfer incomplete: {len(missing)} pages missing, announced "
                f"{num_pages_announced}, received {self.next_seq_no}"
            )
        self.completed = True

    def fail(self) -> bool:
        """The transfer failed: free the reserved pages (once). True if this call freed them."""
        with self._lock:
            if self.completed:
                return False
            self.states = [PageState.FREED] * len(self.states)
            return self._free()

    @property
    def freed(self) -> bool:
        return self._free._done
