"""The engine's side of the prefix fetch's helper process (`fetch_worker`): start it, hand it requests, restart it.

    proc = FetchProcess(store, keyring, connections=8, arena_bytes=1 << 30, pin=True).start()
    block = proc.arena.alloc(n)                           where a fetch's values land (shared, pinned)
    got = proc.get_many(rows, ttl_ms, max_value_bytes)    one pipelined GETEX + MAC checks in the helper
    proc.close()

Each engine-side fetch thread takes one of `connections` socketpairs (the helper serves each on a thread with a
Redis connection of its own), sends a request and blocks on the reply (outside the GIL), so the engine process
touches the GIL once a request instead of once a socket read. A helper that died (or could not start) fails the
requests in flight as StoreError (the engine computes those pages) and is started again on a later fetch, at most
once every `RESTART_AFTER_S`.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from pdserve.cache.fetch_arena import SharedArena
from pdserve.cache.fetch_worker import parse_reply, recv_frame, send_frame
from pdserve.cache.store import StoreError
from pdserve.cache.value_auth import CacheKeyring

log = logging.getLogger("pdserve.cache")
RESTART_AFTER_S = 5.0


@dataclass
class FetchRow:
    """One key of a request: `name` (store key), `key_index` (which secret of the keyring made it), `digest` (the
    page's chain hash, MACed with the value), `offset` / `size`: where in the arena a value of `size` bytes goes
    (offset -1: nowhere, it comes back in the reply); `header`: the header the value must start with (with the
    request's `blocks`, the helper checks the whole value; b"": MAC only)."""

    name: bytes
    key_index: int
    digest: bytes
    offset: int
    size: int
    header: bytes = b""


@dataclass
class FetchReply:
    lens: list[int | None]  # value length per row (None: absent or over the size limit)
    ok: list[bool | str | None]  # per row: verified (and checked), False: fails its MAC, str: corrupt, None: absent
    extras: dict[int, memoryview]  # rows whose value is not in the arena: its bytes


class FetchProcess:
    def __init__(self, store, keyring: CacheKeyring, connections: int, arena_bytes: int, pin: bool):
        """`store`: a RedisStore (its `spec()` builds the helper's); `pin`: the arena is registered with CUDA."""
        self.store_spec = store.spec()
        self.mac_keys = [k.mac_key.hex() for k in keyring.keys]
        self.connections = max(1, connections)
        self.arena = SharedArena(arena_bytes, pin=pin)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._socks: queue.Queue[socket.socket] = queue.Queue()
        self._generation = 0
        self._started_at = 0.0
        self.restarts = 0
        self.fallbacks = {"arena_full": 0, "helper_down": 0}  # fetches that ran in the engine's process instead
        self.closed = False

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> FetchProcess:
        with self._lock:
            self._start_locked()
        return self

    def _start_locked(self) -> None:
        self._started_at = time.monotonic()
        pairs = [socket.socketpair() for _ in range(self.connections)]
        child_fds = [b.fileno() for _, b in pairs]
        cmd = [
            sys.executable, "-m", "pdserve.cache.fetch_worker", "--arena-fd", str(self.arena.fd),
            "--arena-bytes", str(self.arena.nbytes), "--conn-fds", ",".join(map(str, child_fds)),
        ]  # fmt: skip
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, pass_fds=[self.arena.fd, *child_fds])
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"store": self.store_spec, "mac_keys": self.mac_keys}).encode())
            proc.stdin.close()
        except OSError as e:
            for a, b in pairs:
                a.close()
                b.close()
            log.warning("prompt cache: the fetch helper process did not start (%s): fetching in this process", e)
            self._proc = None
            return
        finally:
            for _, b in pairs:
                b.close()
        self._proc = proc
        self._generation += 1
        while not self._socks.empty():  # the previous helper's links (those in use are closed when returned)
            self._socks.get_nowait().close()
        self._socks = queue.Queue()
        for a, _ in pairs:
            self._socks.put(a)
        log.info("prompt cache: fetch helper process %d (%d connections)", proc.pid, self.connections)

    def ready(self) -> bool:
        """Whether the helper runs (started again if it died and the last start is `RESTART_AFTER_S` old)."""
        with self._lock:
            if self.closed:
                return False
            if self._proc is not None and self._proc.poll() is None:
                return True
            if time.monotonic() - self._started_at < RESTART_AFTER_S:
                return False
            if self._proc is not None:
                log.warning("prompt cache: fetch helper process exited (%s); starting it again", self._proc.returncode)
                self.restarts += 1
            self._start_locked()
            return self._proc is not None

    def fell_back(self, why: str) -> None:
        """Count a fetch that ran in the engine's process instead (`fallbacks`: arena_full, helper_down)."""
        with self._lock:
            self.fallbacks[why] += 1

    def events(self) -> dict[str, int]:
        """Counters for metrics: restarts and the fallbacks by reason."""
        with self._lock:
            return {"restarts": self.restarts, **{f"fallback_{k}": v for k, v in self.fallbacks.items()}}

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def close(self) -> None:
        with self._lock:
            self.closed = True
            proc, self._proc = self._proc, None
            socks = []
            while not self._socks.empty():
                socks.append(self._socks.get_nowait())
        for s in socks:
            s.close()  # the helper's threads see EOF and it exits
        if proc is not None:
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.arena.close()

    # ---- requests ----------------------------------------------------------------------------------------
    def get_many(
        self,
        rows: list[FetchRow],
        ttl_ms: int,
        max_value_bytes: int,
        blocks: list[list[int]] | None = None,
        timeout_s: float = 10.0,
    ) -> FetchReply:
        """One pipelined GETEX of `rows` in the helper, values at their arena offsets, MACs checked there, and with
        `blocks` (`value.block_checks`) each row with a header checked whole (`fetch_worker.check_value`).
        Raises StoreError (store trouble, or the helper gone: the caller computes instead)."""
        with self._lock:
            gen, socks = self._generation, self._socks
            alive = self._proc is not None and not self.closed
        if not alive:
            raise StoreError("the fetch helper process is not running")
        try:
            sock = socks.get(timeout=timeout_s)
        except queue.Empty:
            raise StoreError("no fetch helper connection free") from None
        req = {
            "ttl_ms": int(ttl_ms),
            "max_value_bytes": int(max_value_bytes),
            "keys": [
                [r.name.decode("latin-1"), r.key_index, r.digest.hex(), r.offset, r.size, r.header.hex()] for r in rows
            ],
        }
        if blocks:
            req["blocks"] = blocks
        broken = False
        try:
            sock.settimeout(timeout_s)
            send_frame(sock, [json.dumps(req).encode()])
            body = recv_frame(sock, limit=max(1 << 20, len(rows) * (max_value_bytes + 4096)))
            if body is None:
                raise ConnectionError("the fetch helper closed its connection")
        except OSError as e:  # socket.timeout and ConnectionError included
            broken = True
            raise StoreError(f"fetch helper: {type(e).__name__}: {e}") from e
        finally:
            if broken:
                sock.close()  # its state is unknown: the helper's thread for it ends
                self._helper_broken(gen)
            else:
                self._give_back(sock, gen)
        head, raw = parse_reply(body)
        if "error" in head:
            if head.get("refused"):
                from pdserve.cache.redis_store import StoreRefused

                raise StoreRefused(head["error"])
            raise StoreError(f"redis fetch failed (helper): {head['error']}")
        lens: list[int | None] = head["lens"]
        extras: dict[int, memoryview] = {}
        at = 0
        for i in head["extra"]:
            n = lens[i] or 0
            extras[i] = raw[at : at + n]
            at += n
        if at != len(raw) or len(lens) != len(rows):
            raise StoreError("fetch helper reply out of step")
        return FetchReply(lens, head["ok"], extras)

    def _give_back(self, sock: socket.socket, generation: int) -> None:
        """A link back to the free ones, or closed when its helper was replaced (or closed) meanwhile."""
        with self._lock:
            if generation == self._generation and not self.closed:
                self._socks.put(sock)
                return
        sock.close()

    def _helper_broken(self, generation: int) -> None:
        """A connection broke: the helper is stopped (its other connections' state is fine, but a helper that
        drops links is suspect), and `ready()` starts a new one later."""
        with self._lock:
            if generation != self._generation or self._proc is None:
                return
            proc = self._proc
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass
