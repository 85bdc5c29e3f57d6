"""KV page transfer bookkeeping: explicit page states on both ends, independent of the transport.

Sender (prefill):   ALLOCATED → FILLING → SHIPPED → ACKED → FREED
Receiver (decode):  ALLOCATED → FILLED → ACKED → FREED

The sender frees its pages only when every shipped page is acknowledged or the transfer is abandoned
(cancel, deadline, error): never while the receiver may still be reading them. Sequence numbers make gaps,
repeats and reordering detectable; a transfer that ends with a page missing is an error, never a silent
wrong answer.
"""

from __future__ import annotations

import enum
import threading


class PageState(enum.Enum):
    ALLOCATED = "allocated"
    FILLING = "filling"
    FILLED = "filled"
    SHIPPED = "shipped"
    ACKED = "acked"
    FREED = "freed"


class TransferError(Exception):
    """The transfer broke its protocol (gap, repeat, unknown page, missing pages)."""


class SenderPages:
    """Prefill-side state of one request's pages. Thread-safe (engine thread ships, RPC thread acks)."""

    def __init__(self, request_id: str, num_pages: int):
        self.request_id = request_id
        self._lock = threading.Lock()
        self.states = [PageState.FILLING] * num_pages  # allocated and being filled by prefill
        self._seq_page: list[int] = []  # seq_no -> logical page index
        self._acked_upto = -1  # highest cumulatively acked seq_no
        self.bytes_shipped = 0

    def ship(self, page_index: int, nbytes: int) -> int:
        """Mark `page_index` shipped; returns its seq_no."""
        with self._lock:
            if self.states[page_index] is not PageState.FILLING:
                raise TransferError(f"page {page_index} shipped twice or after free ({self.states[page_index]})")
            self.states[page_index] = PageState.SHIPPED
            self._seq_page.append(page_index)
            self.bytes_shipped += nbytes
            return len(self._seq_page) - 1

    def ack(self, seq_no: int) -> None:
        """Cumulative ack: every page with seq number ≤ seq_no is stored by the receiver."""
        with self._lock:
            if seq_no >= len(self._seq_page):
                raise TransferError(f"ack {seq_no} for a page never shipped (shipped {len(self._seq_page)})")
            for s in range(self._acked_upto + 1, seq_no + 1):
                self.states[self._seq_page[s]] = PageState.ACKED
            self._acked_upto = max(self._acked_upto, seq_no)

    @property
    def num_shipped(self) -> int:
        return len(self._seq_page)

    def all_acked(self) -> bool:
        with self._lock:
            return all(s is PageState.ACKED for s in self.states)

    def free(self) -> None:
        with self._lock:
            self.states = [PageState.FREED] * len(self.states)


class ReceiverPages:
    """Decode-side state of one request's incoming pages."""

    def __init__(self, request_id: str, num_pages: int):
        self.request_id = request_id
        self.states = [PageState.ALLOCATED] * num_pages
        self.next_seq_no = 0
        self.bytes_received = 0

    def check(self, seq_no: int, page_index: int) -> None:
        """Validate an arriving page before it is written; raises TransferError."""
        if seq_no != self.next_seq_no:
            raise TransferError(f"expected page seq_no {self.next_seq_no}, got {seq_no}")
        if not 0 <= page_index < len(self.states):
            raise TransferError(f"page index {page_index} outside the {len(self.states)} reserved pages")
        if self.states[page_index] is not PageState.ALLOCATED:
            raise TransferError(f"page {page_index} received twice")

    def filled(self, page_index: int, nbytes: int) -> None:
        self.states[page_index] = PageState.FILLED
        self.next_seq_no += 1
        self.bytes_received += nbytes

    def acked(self) -> None:
        self.states = [PageState.ACKED if s is PageState.FILLED else s for s in self.states]

    def complete(self, num_pages_announced: int) -> None:
        """At PrefillDone: every reserved page must have arrived exactly once."""
        missing = [i for i, s in enumerate(self.states) if s is PageState.ALLOCATED]
        if missing or num_pages_announced != self.next_seq_no:
            raise TransferError(
                f"transfer incomplete: {len(missing)} pages missing, announced "
                f"{num_pages_announced}, received {self.next_seq_no}"
            )

    def free(self) -> None:
        self.states = [PageState.FREED] * len(self.states)
