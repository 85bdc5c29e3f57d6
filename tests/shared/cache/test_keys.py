"""Chained page keys: deterministic, prefix-shaped, namespaced."""

from __future__ import annotations

import dataclasses
import hashlib
import struct

from cache_testutil import INT8, PAGE, namespace

from pdserve.testing.hash_seed import outputs_under_hash_seeds


def test_chain_definition():
    """h_k = sha256(h_{k-1} || int32 LE tokens of page k), h_0 = the namespace root."""
    ns = namespace()
    tokens = list(range(100, 100 + 3 * PAGE + 2))
    keys = ns.page_keys(tokens)
    assert len(keys) == 3  # full pages only
    h = ns.root
    for k in range(3):
        h = hashlib.sha256(h + struct.pack(f"<{PAGE}i", *tokens[k * PAGE : (k + 1) * PAGE])).digest()
        assert keys[k] == h


def test_prefix_property_and_divergence():
    ns = namespace()
    a = list(range(5, 5 + 4 * PAGE))
    b = a[: 2 * PAGE] + [7] + a[2 * PAGE + 1 :]  # differs inside page 2
    ka, kb = ns.page_keys(a), ns.page_keys(b)
    assert ka[:2] == kb[:2] and ka[2] != kb[2] and ka[3] != kb[3]  # a change poisons every later page
    assert ns.page_keys(a + [1, 2, 3])[:4] == ka
    assert ns.page_keys(a, max_pages=2) == ka[:2]
    assert ns.page_keys(a[: PAGE - 1]) == []


def test_namespace_separates_models_and_formats():
    tokens = list(range(2 * PAGE))
    base = namespace().page_keys(tokens)
    others = [
        namespace(fingerprint="other"),
        namespace(dataclasses.replace(INT8, group_size=8)),
        namespace(dataclasses.replace(INT8, asymmetric=True)),
        namespace(dataclasses.replace(INT8, dtype="bfloat16", group_size=0)),
        namespace(dataclasses.replace(INT8, num_layers=3)),
    ]
    for ns in others:
        assert ns.page_keys(tokens)[0] != base[0]


def test_scope_separates_tenants():
    """Each tenant's prompts live in its own scope: the same tokens never share a key across scopes, and the
    unscoped namespace is a scope of its own."""
    tokens = list(range(2 * PAGE))
    base = namespace()
    a, b = (dataclasses.replace(base, scope=s) for s in ("tenant:alice", "tenant:bob"))
    keys = {ns.page_keys(tokens)[0] for ns in (base, a, b)}
    assert len(keys) == 3
    assert dataclasses.replace(base, scope="tenant:alice").page_keys(tokens) == a.page_keys(tokens)  # deterministic


def test_same_keys_in_another_process_with_another_hash_seed():
    code = (
        "from pdserve.cache.keys import CacheNamespace\nfrom pdserve.kv.codec import KVLayoutSpec\n"
        f"ns = CacheNamespace('fp-test', {INT8!r})\nprint(ns.page_keys(list(range({3 * PAGE})))[-1].hex())"
    )
    assert set(outputs_under_hash_seeds(code)) == {namespace().page_keys(list(range(3 * PAGE)))[-1].hex()}
