"""Prefill's `--kv-dtype` against the page format each decode asks for (see `pdserve.prefill.config`).

Decode's layout decides what prefill ships; prefill's flag names the format it prepared for (warm-up, and with
`--batch-invariant` its own pool). A request for another format is served; the first one of each format is logged,
so that a misconfigured pair is visible without failing traffic (one prefill may serve decode instances of several
formats on purpose).
"""

from __future__ import annotations

import logging
import threading

from pdserve.kv.codec import KVLayoutSpec

log = logging.getLogger("pdserve")


def kv_dtype_of(layout: KVLayoutSpec) -> str:
    """The `--kv-dtype` value that produces `layout`: int8 | fp8, or auto for an unquantized model-dtype layout."""
    return layout.dtype if layout.quantized else "auto"


class ShipFormatCheck:
    """Compares each request's layout with prefill's `--kv-dtype`; `check` is safe from any RPC thread."""

    def __init__(self, kv_dtype: str, batch_invariant: bool = False):
        self.kv_dtype = kv_dtype
        self.batch_invariant = batch_invariant
        self._reported: set[str] = set()
        self._lock = threading.Lock()

    def mismatch(self, layout: KVLayoutSpec) -> str:
        """Why `layout` is not what this prefill prepared for ('' when it is)."""
        wanted = kv_dtype_of(layout)
        if wanted == self.kv_dtype:
            return ""
        why = (
            f"decode asks for {wanted} KV pages ({layout.dtype}), this prefill runs --kv-dtype {self.kv_dtype}: "
            f"served as asked (decode's layout decides), but not warmed up for it"
        )
        if self.batch_invariant:
            why += f", and --batch-invariant holds only for {self.kv_dtype} (the format its pool stores)"
        return why

    def check(self, layout: KVLayoutSpec) -> str:
        """`mismatch(layout)`, logged as a warning the first time per requested format."""
        why = self.mismatch(layout)
        if why:
            with self._lock:
                first = layout.dtype not in self._reported
                self._reported.add(layout.dtype)
            if first:
                log.warning("%s", why)
        return why
