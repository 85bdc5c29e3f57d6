"""Page states of one transfer, on both ends, independent of the transport. The states drive freeing: each
object holds the callback that gives the request's pages back to its engine and calls it exactly once.

Sender (prefill):   FILLING → SHIPPED → ACKED → FREED   (FILLING: allocated, being computed or exported, or some
                    of its layer groups shipped; SHIPPED: its last layer shipped; ACKED: every shipment of it acked)
Receiver (decode):  ALLOCATED → FILLING → FILLED → ACKED → (handed to the engine's sequence) | FREED on failure
                    (FILLING: a batch claimed the page, or some of its layer groups, and not all layers landed;
                    FILLED: every layer landed)

A shipment is a page's whole KV or one layer range of it (`layers.LayerRange`, `--kv-layer-group`); layer ranges of a
page ship and land in order, from layer 0 up, without gaps or repeats.

The sender frees its pages only when every page is acknowledged or the transfer is abandoned (cancel,
deadline, error): never while the receiver may still be reading them. The receiver's pages are allocated when
the transfer begins (`engine.begin_import`) and freed on any failure before the transfer completes. Sequence
numbers (one per shipment) make gaps, repeats and reordering detectable; a transfer that ends with a page (or a
layer of one) missing is an error, never a silent wrong answer.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Sequence

from pdserve.errors import TransferError  # DATA_LOSS on both ends (pdserve.server.status)
from pdserve.kv.transfer.layers import LayerRange


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
    `abandon`. `num_layers`: the model's (a page is shipped once its last layer is)."""

    def __init__(self, request_id: str, num_pages: int, free: Callable[[], object] | None = None, num_layers: int = 1):
        self.request_id = request_id
        self.num_layers = num_layers
        self._lock = threading.Lock()
        self.states = [PageState.FILLING] * num_pages
        self._layers_shipped = [0] * num_pages  # per page: layers [0, n) shipped
        self._shipments = [0] * num_pages  # per page: seq_nos it took
        self._shipments_acked = [0] * num_pages
        self._seq_page: list[int] = []  # seq_no -> logical page index
        self._acked_upto = -1  # highest cumulatively acked seq_no
        self._all_acked = False
        self._free = _FreeOnce(free)
        self.bytes_shipped = 0

    def ship(self, page_indexes: Sequence[int], nbytes: int, layers: LayerRange | None = None) -> int:
        """Mark `layers` (None: all) of pages shipped (in this order); returns the seq_no of the first. A page is
        SHIPPED once its last layer is."""
        r = layers or LayerRange(0, self.num_layers)
        with self._lock:
            first = len(self._seq_page)
            if not 0 <= r.start < r.stop <= self.num_layers:
                raise TransferError(f"layers [{r.start}, {r.stop}) outside the model's {self.num_layers}")
            if len(set(page_indexes)) != len(page_indexes):
                raise TransferError("a page twice in one shipment")
            for p in page_indexes:
                if not 0 <= p < len(self.states):
                    raise TransferError(f"page {p} outside the request's {len(self.states)} pages")
                if self.states[p] is not PageState.FILLING:
                    raise TransferError(f"page {p} shipped twice or after free ({self.states[p].value})")
                if self._layers_shipped[p] != r.start:
                    raise TransferError(
                        f"page {p}: layers [{r.start}, {r.stop}) shipped after layers [0, {self._layers_shipped[p]})"
                    )
            for p in page_indexes:
                self._layers_shipped[p] = r.stop
                self._shipments[p] += 1
                if r.stop == self.num_layers:
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
                p = self._seq_page[s]
                self._shipments_acked[p] += 1
                if self.states[p] is PageState.SHIPPED and self._shipments_acked[p] == self._shipments[p]:
                    self.states[p] = PageState.ACKED
            self._acked_upto = max(self._acked_upto, seq_no)
            if not all(s is PageState.ACKED for s in self.states):
                return False
            self._all_acked = True
            self.states = [PageState.FREED] * len(self.states)
            return self._free()

    def abandon(self) -> bool:
        """The transfer ended early (cancel, deadline, error): free the pages now. True if this call freed them."""
        with self._lock:
            self.states = [PageState.FREED] * len(self.states)
            return self._free()

    @property
    def num_shipped(self) -> int:
        """Shipments (seq_nos) so far: PrefillDone.num_pages."""
        return len(self._seq_page)

    @property
    def num_pages_shipped(self) -> int:
        """Pages whose every layer shipped."""
        with self._lock:
            return sum(n == self.num_layers for n in self._layers_shipped)

    @property
    def num_acked(self) -> int:
        return self._acked_upto + 1

    @property
    def freed(self) -> bool:
        return self._free._done

    def all_acked(self) -> bool:
        with self._lock:
            return self._all_acked


class ReceiverPages:
    """Decode-side state of one request's incoming pages (thread-safe). `free` gives the pages
    reserved at begin back to the engine; it runs once, on `fail`, unless the transfer completed. `num_layers`: the
    model's (a page is filled once its last layer landed)."""

    def __init__(self, request_id: str, num_pages: int, free: Callable[[], object] | None = None, num_layers: int = 1):
        self.request_id = request_id
        self.num_layers = num_layers
        self.states = [PageState.ALLOCATED] * num_pages
        self._layers_claimed = [0] * num_pages  # per page: layers [0, n) claimed by arrived batches
        self._layers_filled = [0] * num_pages  # ... and held here
        self._lock = threading.Lock()  # the stream's reader claims batches; fetch workers fill them
        self.next_claim = 0  # seq_no the next arriving batch must start at
        self.next_seq_no = 0  # seq_no after the last filled shipment
        self.pages_claimed = 0  # pages whose every layer an arrived batch claimed
        self.bytes_received = 0
        self._free = _FreeOnce(free)
        self.completed = False

    def check(self, first_seq_no: int, page_indexes: Sequence[int], layers: LayerRange | None = None) -> None:
        """Validate an arriving batch of `layers` (None: all) before any byte of it is written and claim its pages
        (FILLING); raises TransferError. Batches are claimed in arrival order; their bytes may be fetched
        concurrently. A page's layer ranges must arrive in order from layer 0, without gaps or repeats."""
        r = layers or LayerRange(0, self.num_layers)
        with self._lock:
            if first_seq_no != self.next_claim:
                raise TransferError(f"expected page seq_no {self.next_claim}, got {first_seq_no}")
            if not 0 <= r.start < r.stop <= self.num_layers:
                raise TransferError(f"layers [{r.start}, {r.stop}) outside the model's {self.num_layers}")
            seen = set()
            for p in page_indexes:
                if not 0 <= p < len(self.states):
                    raise TransferError(f"page index {p} outside the {len(self.states)} reserved pages")
                if self.states[p] not in (PageState.ALLOCATED, PageState.FILLING) or p in seen:
                    raise TransferError(f"page {p} received twice")
                if self._layers_claimed[p] != r.start:
                    got = self._layers_claimed[p]
                    what = "received twice" if got >= r.stop or got == self.num_layers else "out of order"
                    raise TransferError(f"page {p}: layers [{r.start}, {r.stop}) {what} (layers [0, {got}) arrived)")
                seen.add(p)
            for p in page_indexes:
                self.states[p] = PageState.FILLING
                self._layers_claimed[p] = r.stop
            self.next_claim += len(page_indexes)
            if r.stop == self.num_layers:
                self.pages_claimed += len(page_indexes)

    def filled(self, page_indexes: Sequence[int], nbytes: int, layers: LayerRange | None = None) -> int:
        """The batch's bytes are held here (batches in claim order); returns the seq_no to acknowledge
        (cumulative). A page is FILLED once its last layer is."""
        r = layers or LayerRange(0, self.num_layers)
        with self._lock:
            for p in page_indexes:
                if self.states[p] is not PageState.FILLING:
                    raise TransferError(f"page {p} filled while {self.states[p].value}")
                if self._layers_filled[p] != r.start:
                    raise TransferError(f"page {p}: layers [{r.start}, {r.stop}) filled out of claim order")
            for p in page_indexes:
                self._layers_filled[p] = r.stop
                if r.stop == self.num_layers:
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
