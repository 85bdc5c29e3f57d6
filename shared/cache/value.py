"""One cached KV page as one self-contained binary value (one atomic Redis value per page).

A value is the page's `pdserve.v1.KVPage` message as bytes (`pdserve.kv.codec.page_to_bytes`: the same
serialisation and CRC32 as the prefill -> decode stream), bound to its key: `request_id` holds the owner string
of the page's chain hash and `model_fingerprint` the namespace's model. Only full pages of all layers are stored.

`decode_value` parses strictly: the checksum, every length against the layout, and every field against what
the caller expects (layout, model, chain hash, page index, full page, all layers); any damage or mismatch
raises CorruptPage and the caller treats the page as a miss. No pickle anywhere.
"""

from __future__ import annotations

import torch

from pdserve.cache.keys import CacheNamespace
from pdserve.errors import CorruptPage, InvalidRequest
from pdserve.kv.codec import encode_page, page_from_bytes, page_to_bytes
from pdserve.kv.payload import PagePayload

CHAIN_BYTES = 32  # a chain hash (sha256 digest), see keys.py


def owner(chain: bytes) -> str:
    """What a cached page belongs to (the KVPage's request_id): its key's chain hash."""
    if len(chain) != CHAIN_BYTES:
        raise InvalidRequest(f"chain hash must be {CHAIN_BYTES} bytes, got {len(chain)}")
    return "prompt-cache:" + chain.hex()


def encode_value(payload: PagePayload, ns: CacheNamespace, chain: bytes) -> bytes:
    """Serialize a full page (all layers) stored under key digest `chain`. Raises InvalidRequest if the
    payload does not fit `ns.layout` or is not a full page of all layers."""
    if (
        payload.layer_start != 0
        or payload.num_tokens != ns.layout.page_size
        or payload.data.dim() != 5
        or payload.layer_count != ns.layout.num_layers
    ):
        raise InvalidRequest("only full pages of all layers are cached")
    return page_to_bytes(payload, owner=owner(chain), layout=ns.layout, fingerprint=ns.fingerprint)


def decode_value(buf: bytes, ns: CacheNamespace, chain: bytes, page_index: int) -> PagePayload:
    """Verify and parse a value expected to hold page `page_index` under key digest `chain` in `ns`.
    Returns a PagePayload of CPU tensors; raises CorruptPage on any damage or mismatch."""
    p = page_from_bytes(
        buf, expected_layout=ns.layout, expected_fingerprint=ns.fingerprint, expected_owner=owner(chain)
    )
    if (
        p.page_index != page_index
        or p.num_tokens != ns.layout.page_size
        or p.layer_start != 0
        or p.layer_count != ns.layout.num_layers
    ):
        raise CorruptPage(
            f"value holds page {p.page_index} ({p.num_tokens} tokens, layers "
            f"[{p.layer_start}, {p.layer_start + p.layer_count})), expected full page {page_index}"
        )
    return p


def value_bytes(ns: CacheNamespace, page_index: int) -> int:
    """Size of the encoded value of page `page_index` in `ns` (a varint's size varies with its value): the
    message of an all-zero page, measured."""
    lay = ns.layout
    shape = (2, lay.num_layers, lay.page_size, lay.num_kv_heads, lay.head_dim)
    groups = (*shape[:-1], lay.head_dim // max(lay.group_size, 1))
    scales = torch.zeros(groups, dtype=torch.float16) if lay.quantized else None
    zeros = torch.zeros(groups, dtype=torch.float16) if lay.quantized and lay.asymmetric else None
    page = PagePayload(
        page_index, lay.page_size, 0, torch.zeros(shape, dtype=lay.torch_dtype), scales, zeros, lay.group_size
    )
    msg = encode_page(page, request_id=owner(bytes(CHAIN_BYTES)), seq_no=0, layout=lay, fingerprint=ns.fingerprint)
    msg.checksum = 0xFFFFFFFF  # a checksum of 0 is not serialized: count the common case
    return msg.ByteSize()
