"""Fixtures for pdserve.cache tests: private redis-server processes (free port, no persistence) and
synthetic KV pages in a small layout."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pdserve.cache.keys import CacheNamespace
from pdserve.cache.redis_server import RedisServer
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.payload import PagePayload
from pdserve.kv.quant import quantize

sys.path.insert(0, str(Path(__file__).parent))

PAGE = 4
INT8 = KVLayoutSpec(dtype="int8", page_size=PAGE, num_layers=2, num_kv_heads=2, head_dim=8, group_size=4)
DENSE = KVLayoutSpec(dtype="float32", page_size=PAGE, num_layers=2, num_kv_heads=2, head_dim=8)


@pytest.fixture
def start_redis(tmp_path):
    """start_redis(*extra_args) -> a started RedisServer; every one is stopped at teardown."""
    servers: list[RedisServer] = []

    def start(*args: str) -> RedisServer:
        srv = RedisServer(tmp_path / f"redis{len(servers)}", args=list(args)).start()
        servers.append(srv)
        return srv
    yield start
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def shared_redis(tmp_path_factory):
    """One server for the tests of a module that only need a clean database (flushed by `redis`)."""
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.stop()


@pytest.fixture
def redis(shared_redis):
    shared_redis.client().flushall()
    return shared_redis


def make_page(layout: KVLayoutSpec, index: int, seed: int = 0, asymmetric: bool = False) -> PagePayload:
    g = torch.Generator().manual_seed(seed * 1000 + index)
    dense = torch.randn(2, layout.num_layers, layout.page_size, layout.num_kv_heads, layout.head_dim, generator=g)
    if not layout.quantized:
        return PagePayload(index, layout.page_size, 0, dense.to(layout.torch_dtype), None, None, 0)
    q, s, z = quantize(dense, layout.group_size, layout.asymmetric)
    return PagePayload(index, layout.page_size, 0, q, s, z, layout.group_size)


def namespace(layout: KVLayoutSpec = INT8, fingerprint: str = "fp-test") -> CacheNamespace:
    return CacheNamespace(fingerprint, layout)
