"""Redis (or Redis Cluster) as the prompt cache's shared store.

- `REDIS_URL`-style URLs: redis://[user[:password]@]host:port/db, rediss:// for TLS (redis-py's options in the
  query string: ssl_ca_certs, ssl_certfile / ssl_keyfile for a client certificate, ssl_cert_reqs), unix://.
  The password may instead come from a file (`password`, `--redis-password-file`): AUTH as the URL's user (an
  ACL user) or the default user. `cluster=True` uses redis-py's cluster client.
- A server that refuses the credentials or whose certificate does not verify is a configuration error:
  `eviction_policy()` (the start-up probe) raises StoreRefused with the reason; later calls fail as StoreError.
- Short socket timeouts and no client-side retries: a slow or dead server costs one timeout, and the circuit
  breaker in front (see prompt_cache) stops further calls for a while.
- After a connection error the client is dropped and rebuilt on the next call, so a restarted server is used
  again without stale pooled sockets.
- Reads are pipelined GETEX (value + TTL refresh in one command); writes are pipelined SET PX. `get_many_into`
  reads the values straight into the caller's buffers (resp_fetch.py) on a pooled connection of its own, so
  several threads fetch one prefix at once (the prompt cache's prefix fetch). Works with any
  `maxmemory-policy`; `allkeys-lru` (or -lfu) is what a cache deployment should use: each page is one key, so
  an eviction can only shorten a cached prefix, never leave half a page.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import AuthenticationError, NoPermissionError, RedisClusterException, RedisError
from redis.retry import Retry

from pdserve.cache.resp_fetch import getex_into, read_getex, send_getex
from pdserve.cache.store import StoreError, copy_into

log = logging.getLogger("pdserve.cache")

_CONNECTION_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, RedisClusterException, OSError)
_AUTH_REFUSALS = ("WRONGPASS", "NOAUTH", "client already authenticated")  # the last: HELLO without AUTH
_TLS_REFUSALS = ("certificate verify failed", "wrong version number", "tlsv1 alert", "sslv3 alert")


class StoreRefused(StoreError):
    """The server refused this client (wrong password or user, no permission, a TLS certificate that does not
    verify): a configuration error, not an outage."""


def refusal(e: BaseException) -> str | None:
    """Why `e` is the server refusing this client (None: some other failure, e.g. down or slow)."""
    if isinstance(e, AuthenticationError) or any(m in str(e) for m in _AUTH_REFUSALS):
        return f"Redis refused the credentials ({e}): check the URL's user and the password (URL or password file)"
    if isinstance(e, NoPermissionError):
        return f"the Redis ACL user may not run the cache's commands ({e})"
    chain, cause = [e], e.__cause__ or e.__context__
    while cause is not None and len(chain) < 8:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    tls = next((c for c in chain if isinstance(c, ssl.SSLError)), None)
    if tls is not None or any(m in str(e).lower() for m in _TLS_REFUSALS):
        return (
            f"TLS with Redis failed ({tls or e}; a server that requires a client certificate ends the handshake so): "
            "check rediss:// and its ssl_ca_certs / ssl_certfile / ssl_keyfile"
        )
    return None


Dest = Callable[[int, int], memoryview | None]  # (value index, length) -> the buffer to read it into, or None


def _reindexed(dest: Dest, idx: list[int]) -> Dest:
    """`dest` for a sub-list of the keys: its j-th value is the caller's value idx[j]."""
    return lambda j, n: dest(idx[j], n)


class RedisStore:
    remote = True

    def __init__(
        self,
        url: str,
        cluster: bool = False,
        timeout_s: float = 0.25,
        connect_timeout_s: float = 0.25,
        password: str | None = None,
    ):
        """`password`: AUTH password when the URL holds none (from a file: kept out of URLs, logs and env)."""
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"Redis URL must start with redis://, rediss:// or unix://, got {url!r}")
        if password and urlsplit(url).password:
            raise ValueError("the Redis password is given twice: in the URL and from a password file")
        self.url, self.cluster = url, cluster
        self._spec = dict(
            url=url, cluster=cluster, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s, password=password
        )
        self._kw: dict = dict(
            socket_timeout=timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            socket_read_size=1 << 20,
        )  # values are ~MB: read big chunks
        if password:
            self._kw["password"] = password
        self._lock = threading.Lock()
        self._client: redis.Redis | RedisCluster | None = None

    def spec(self) -> dict:
        """The arguments that build this store again (in the prefix fetch's helper process; the password too)."""
        return dict(self._spec)

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
            why = refusal(e)
            if why:
                raise StoreRefused(why) from e
            raise StoreError(f"redis error: {type(e).__name__}: {e}") from e
        except Exception as e:
            self._reset(client)
            raise StoreError(f"redis unavailable: {type(e).__name__}: {e}") from e

    def get_many(self, keys: list[bytes], ttl_ms: int) -> list[bytes | None]:
        if not keys:
            return []
        return self._pipeline(lambda p: [p.getex(k, px=ttl_ms) for k in keys])

    def get_many_into(
        self, keys: list[bytes], ttl_ms: int, dest: Callable[[int, int], memoryview | None], max_value_bytes: int
    ) -> list[int | None]:
        """GETEX of `keys`, value i of n bytes read straight into `dest(i, n)` (`resp_fetch.getex_into`), on a
        pooled connection of its own (thread-safe: parallel calls use parallel connections). Returns each value's
        length (None: absent or declined). Cluster: per node, every node's commands sent before any is read."""
        if not keys:
            return []
        if self.cluster:
            return self._cluster_get_many_into(keys, ttl_ms, dest, max_value_bytes)
        client = conn = None
        try:
            client = self._get_client()
            conn = client.connection_pool.get_connection()
            sock = getattr(conn, "_sock", None)
            if sock is None:  # a redis-py without the socket attribute: its own parser, then a copy
                conn.send_packed_command(conn.pack_commands([("GETEX", k, "PX", ttl_ms) for k in keys]))
                return copy_into([conn.read_response() for _ in keys], dest, max_value_bytes)
            return getex_into(sock, keys, ttl_ms, dest, max_value_bytes)
        except Exception as e:
            if conn is not None:
                conn.disconnect()  # mid-pipeline: its state is unknown
            if isinstance(e, RedisError | OSError):
                if isinstance(e, _CONNECTION_ERRORS):
                    self._reset(client)
                why = refusal(e)
                if why:
                    raise StoreRefused(why) from e
            raise StoreError(f"redis fetch failed: {type(e).__name__}: {e}") from e
        finally:
            if conn is not None and client is not None:
                client.connection_pool.release(conn)

    def _cluster_get_many_into(
        self, keys: list[bytes], ttl_ms: int, dest: Dest, max_value_bytes: int
    ) -> list[int | None]:
        """Cluster: the keys grouped by the node owning their slot, each group one pipelined GETEX on a pooled
        connection of that node, read straight into `dest`. Every group's commands go out before any reply is
        read, so the nodes look up and write their values at once while this thread reads them one node after
        another (their replies wait in the sockets' buffers). A slot that moved (MOVED / ASK, an error reply)
        fails the call like a broken link: the client is rebuilt with a fresh slot map on the next call, and the
        caller computes instead."""
        client = None
        out: list[int | None] = [None] * len(keys)
        taken: list[tuple[redis.ConnectionPool, redis.Connection, list[int]]] = []  # (pool, connection, keys) sent
        socks: list[socket.socket] = []  # the connections' sockets, in the same order
        read_all = False  # else (any exception, an interrupt too) the taken connections go back closed
        try:
            client = self._get_client()
            groups: dict[str, tuple[object, list[int]]] = {}
            for i, k in enumerate(keys):
                node = client.get_node_from_key(k)
                groups.setdefault(node.name, (node, []))[1].append(i)
            for node, idx in groups.values():
                pool = client.get_redis_connection(node).connection_pool
                conn = pool.get_connection()
                taken.append((pool, conn, idx))
                if getattr(conn, "_sock", None) is None:
                    conn.connect()
                socks.append(conn._sock)
                send_getex(socks[-1], [keys[i] for i in idx], ttl_ms)
            for sock, (_, _, idx) in zip(socks, taken, strict=True):
                lens = read_getex(sock, len(idx), _reindexed(dest, idx), max_value_bytes)
                for j, i in enumerate(idx):
                    out[i] = lens[j]
            read_all = True
            return out
        except Exception as e:
            if isinstance(e, RedisError | OSError | ConnectionError):
                self._reset(client)
                why = refusal(e) if isinstance(e, RedisError) else None
                if why:
                    raise StoreRefused(why) from e
            raise StoreError(f"redis cluster fetch failed: {type(e).__name__}: {e}") from e
        finally:
            for pool, conn, _ in taken:
                if not read_all:
                    conn.disconnect()  # mid-pipeline (this one or one not read yet): its state is unknown
                pool.release(conn)

    def set_many(self, items: list[tuple[bytes, bytes]], ttl_ms: int) -> None:
        if items:
            self._pipeline(lambda p: [p.set(k, v, px=ttl_ms) for k, v in items])

    def touch_many(self, keys: list[bytes], ttl_ms: int) -> list[bool]:
        if not keys:
            return []
        return [bool(r) for r in self._pipeline(lambda p: [p.pexpire(k, ttl_ms) for k in keys])]  # PEXPIRE: 1 if set

    def eviction_policy(self) -> str | None:
        """The server's maxmemory-policy, or None if it cannot be read (down, CONFIG disabled or not allowed).
        Raises StoreRefused when the server refuses this client (credentials, TLS)."""
        try:
            cfg = self._get_client().config_get("maxmemory-policy")
        except (RedisError, *_CONNECTION_ERRORS) as e:
            why = refusal(e)
            if why and not isinstance(e, NoPermissionError):
                raise StoreRefused(why) from e
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
