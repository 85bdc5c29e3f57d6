"""Helpers shared by the pdserve.cache tests (imported as a plain module; conftest puts this folder on sys.path):
a small KV layout and synthetic pages in it."""

from __future__ import annotations

import torch

from pdserve.cache.keys import CacheNamespace
from pdserve.cache.value_auth import CacheKeyring
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.payload import PagePayload
from pdserve.kv.quant import quantize

PAGE = 4
INT8 = KVLayoutSpec(dtype="int8", page_size=PAGE, num_layers=2, num_kv_heads=2, head_dim=8, group_size=4)
DENSE = KVLayoutSpec(dtype="float32", page_size=PAGE, num_layers=2, num_kv_heads=2, head_dim=8)


def make_page(layout: KVLayoutSpec, index: int, seed: int = 0) -> PagePayload:
    g = torch.Generator().manual_seed(seed * 1000 + index)
    dense = torch.randn(2, layout.num_layers, layout.page_size, layout.num_kv_heads, layout.head_dim, generator=g)
    if not layout.quantized:
        return PagePayload(index, layout.page_size, 0, dense.to(layout.torch_dtype), None, None, 0)
    q, s, z = quantize(dense, layout.group_size, layout.asymmetric, layout.torch_dtype)
    return PagePayload(index, layout.page_size, 0, q, s, z, layout.group_size)


def namespace(layout: KVLayoutSpec = INT8, fingerprint: str = "fp-test") -> CacheNamespace:
    return CacheNamespace(fingerprint, layout)


# one deployment's cache secret: caches that share a store share it (as every prefill of a deployment does)
KEYRING = CacheKeyring.of("test-secret-of-this-deployment-0123456789")
