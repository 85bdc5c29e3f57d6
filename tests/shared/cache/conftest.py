"""Fixtures for pdserve.cache tests: private redis-server processes (free port, no persistence)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pdserve.testing.redis_server import RedisServer

sys.path.insert(0, str(Path(__file__).parent))  # cache_testutil (pytest runs with --import-mode=importlib)


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
