"""Redis (or Redis Cluster) as the prompt cache's shared store.

- `REDIS_URL`-style URLs: redis://[:password@]host:port/db, rediss:// for TLS (options such as
  ssl_ca_certs / ssl_cert_reqs go in the query string), unix://. `cluster=True` uses redis-py's cluster client.
- Short socket timeouts and no client-side retries: a slow or dead server costs one timeout, and the circuit
  breaker in front (see prompt_cache) stops further calls for a while.
- After a connection error the client is dropped and rebuilt on the next call, so a restarted server is used
  again without stale pooled sockets.
- Reads are pipelined GETEX (value + TTL refresh in one command); writes are pipelined SET PX. Works with any
  `maxmemory-policy`; `allkeys-lru` (or -lfu) is what a cache deployment should use: each page is one key, so
  an eviction can only shorten a cached prefix, never leave half a page.
"""

from __future__ import annotations

import logging
import threading

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError
from redis.retry import Retry

from pdserve.cache.store import StoreError

log = logging.getLogger("pdserve.cache")

_CONNECTION_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, RedisClusterException, OSError)


class RedisStore:
    remote = True

    def __init__(self, url: str, cluster: bool = False, timeout_s: float = 0.25, connect_timeout_s: float = 0.25):
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"Redis URL must start with redis://, rediss:// or unix://, got {url!r}")
        self.url, self.cluster = url, cluster
        self._kw = dict(
            socket_timeout=timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            socket_read_size=1 << 20,
        )  # values are ~MB: read big chunks
        self._lock = threading.Lock()
        self._client: redis.Redis | RedisCluster | None = None

    def _get_client(self):
        with self._lock:
            if self._client is None:
                self._client = (
                    RedisCluster.from_url(self.url, **self._kw)
                    if self.cluster
                    else redis.Redis.from_url(self.url, **self._kw)
                )
            return self._client

    def _reset(self, broken) -> None:
        """Forget a client whose link broke; the next call builds a fresh one (no stale pooled sockets). It is
        not closed here: other threads may be inside a call on it (they fail on their own; GC closes it)."""
        with self._lock:
            if self._client is broken:
                self._client = None

    def _pipeline(self, fill) -> list:
        """Run one non-transactional pipeline; any failure -> StoreError (client dropped if the link broke)."""
        client = None
        try:
            client = self._get_client()
            pipe = client.pipeline(transaction=False)
            fill(pipe)
            return pipe.execute()
        except RedisError as e:
            if isinstance(e, _CONNECTION_ERRORS):
                self._reset(client)
            raise StoreError(f"redis error: {type(e).__name__}: {e}") from e
        except Exception as e:
            self._reset(client)
            raise StoreError(f"redis unavailable: {type(e).__name__}: {e}") from e

    def get_many(self, keys: list[bytes], ttl_ms: int) -> list[bytes | None]:
        if not keys:
            return []
        return self._pipeline(lambda p: [p.getex(k, px=ttl_ms) for k in keys])

    def set_many(self, items: list[tuple[bytes, bytes]], ttl_ms: int) -> None:
        if items:
            self._pipeline(lambda p: [p.set(k, v, px=ttl_ms) for k, v in items])

    def touch_many(self, keys: list[bytes], ttl_ms: int) -> None:
        if keys:
            self._pipeline(lambda p: [p.pexpire(k, ttl_ms) for k in keys])

    def eviction_policy(self) -> str | None:
        """The server's maxmemory-policy, or None if it cannot be read (down, CONFIG disabled)."""
        try:
            cfg = self._get_client().config_get("maxmemory-policy")
        except (RedisError, *_CONNECTION_ERRORS):
            return None
        if self.cluster and isinstance(cfg, dict) and cfg and all(isinstance(v, dict) for v in cfg.values()):
            cfg = next(iter(cfg.values()))  # one answer per node
        v = cfg.get("maxmemory-policy") if isinstance(cfg, dict) else None
        return v.decode() if isinstance(v, bytes) else v

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
