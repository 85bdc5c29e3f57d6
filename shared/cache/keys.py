"""Content-addressed page keys: a chained sha256 over full pages of token ids, inside a namespace.

    root  = sha256("pdserve-prompt-cache" | cache format | KV format | fingerprint | layout fields | scope)
    h_0   = root
    h_k   = sha256(h_{k-1} || token ids of page k as little-endian int32)      (k = 1 .. full pages)

h_k identifies the KV of page k: causal attention makes it a function of tokens 0 .. k*page_size only, and the
namespace pins everything else (model weights, KV dtype, group size, symmetry, page size, formats) and the scope:
who may share the pages (the router sends each tenant's requests with the tenant's own scope unless its config names
a shared one), so a prompt cached for one tenant is never a hit, or a `cached_tokens` count, for another. Only full
pages get keys: a partial page is never shared. The layout is the model's, every KV head in global order, whatever
the tensor-parallel size of the instance that writes or reads a page (its ranks' heads are gathered on export and
split again on import, `pdserve.engine.tp.page_export` / `page_import`), so the TP size is not in the namespace: a
page written at TP=2 is a hit at TP=1. Deterministic across processes and hosts (never Python's
salted `hash()`). These digests are computable from public inputs: they never appear in the store; its key names
and value MACs are keyed with the deployment's cache secret (value_auth.py).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from functools import cached_property

from pdserve.kv.codec import FORMAT_VERSION as KV_FORMAT_VERSION
from pdserve.kv.codec import KVLayoutSpec

CACHE_FORMAT_VERSION = 6  # bump with any change to keys.py, value.py or value_auth.py's tag (3: scope; 4: raw +
# CRC32C; 5: keyed MAC, names; 6: the value MAC BLAKE3-keyed)


@dataclass(frozen=True)
class CacheNamespace:
    """What a cached page must match besides its tokens: the model, the KV layout it is stored in, and the scope
    (prompt-cache namespace of the tenant or shared group; "" = unscoped, for callers without a router)."""

    fingerprint: str
    layout: KVLayoutSpec
    scope: str = ""

    @cached_property
    def root(self) -> bytes:
        lay = self.layout
        fields = (
            b"pdserve-prompt-cache",
            str(CACHE_FORMAT_VERSION).encode(),
            str(KV_FORMAT_VERSION).encode(),
            self.fingerprint.encode(),
            lay.dtype.encode(),
            str(lay.page_size).encode(),
            str(lay.num_layers).encode(),
            str(lay.num_kv_heads).encode(),
            str(lay.head_dim).encode(),
            str(lay.group_size).encode(),
            b"asym" if lay.asymmetric else b"sym",
            self.scope.encode(),
        )
        h = hashlib.sha256()
        for f in fields:  # length-prefixed: no two field lists serialize alike
            h.update(struct.pack("<I", len(f)) + f)
        return h.digest()

    def page_keys(self, token_ids: list[int], max_pages: int | None = None) -> list[bytes]:
        """Chain digests h_1 .. h_n (32 bytes each) of the full pages of `token_ids` (at most `max_pages`)."""
        ps = self.layout.page_size
        n = len(token_ids) // ps if max_pages is None else min(len(token_ids) // ps, max_pages)
        out, h = [], self.root
        for k in range(n):
            page = token_ids[k * ps : (k + 1) * ps]
            h = hashlib.sha256(h + struct.pack(f"<{ps}i", *page)).digest()
            out.append(h)
        return out
