"""An engine process's end of its shipper (`pdserve.kv.shipper.process`): start it, share the arena, command it,
hear it.

    link = ShipperLink("prefill" | "decode", arena_bytes, pin=cuda, host=..., environ=...).start()
    prefill: block = link.reserve(n, timeout); ...rows into block.tensor...; link.push(address, key, seq, block)
             link.watch(key, on_failed); link.unwatch(key); link.give(block) once decode acknowledged it
    decode:  inbox = link.inbox(key); inbox.when(seq, fn); region = inbox.take(seq); inbox.release(region)
             link.address(host): where prefill's shipper pushes; inbox.close() gives back what was never taken

A shipper that exits fails what depends on it (prefill: every watched transfer; decode: every inbox) and is started
again on a later `ready()`, at most once every `RESTART_AFTER_S` (decode: once every landed region was given back,
so no new shipment lands where a receiver still reads); a request that finds it down uses plain `grpc`. The
services run several links as one (`group.ShipperGroup`): an `Inbox` may then span several links.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from pdserve.cache.fetch_arena import ArenaBlock, SharedArena
from pdserve.kv.shipper.frames import recv_event, send_message
from pdserve.v1 import kv_pb2

log = logging.getLogger("pdserve.kv.shipper")
RESTART_AFTER_S = 5.0
START_TIMEOUT_S = 30.0


@dataclass
class Landed:
    """A batch's bytes in decode's arena: the arena of `link`, the shipper it came through."""

    link: ShipperLink
    offset: int
    nbytes: int
    tensor: torch.Tensor  # uint8 [nbytes], a view of the arena (pinned on CUDA)


class ShipperDown(Exception):
    """The shipper exited or a push failed: the transfers that depended on it fail."""


class Inbox:
    """Decode: the arrivals of one transfer key, by seq_no, through any of `links` (a `ShipperGroup` spreads a
    transfer's batches over its shippers). `when(seq, fn)` runs `fn` (once) as soon as that batch landed or the inbox
    failed (any of its shippers exited: the transfer needs every batch); `take(seq)` then gives the bytes or raises
    ShipperDown; `release(landed)` gives them back to the shipper whose arena holds them."""

    def __init__(self, links: Sequence[ShipperLink], key: bytes):
        self.links = list(links)
        self.key = key
        self._lock = threading.Lock()
        self._landed: dict[int, Landed] = {}
        self._waiting: dict[int, Callable[[], object]] = {}
        self._failed = ""
        self._closed = False

    def when(self, seq_no: int, fn: Callable[[], object]) -> None:
        with self._lock:
            ready = seq_no in self._landed or bool(self._failed)
            if not ready:
                self._waiting[seq_no] = fn
        if ready:
            fn()

    def take(self, seq_no: int) -> Landed:
        with self._lock:
            got = self._landed.pop(seq_no, None)
            if got is None:
                raise ShipperDown(self._failed or f"batch {seq_no} has not landed")
            return got

    def release(self, landed: Landed) -> None:
        """Give a taken batch's region back to the shipper it landed through."""
        landed.link.release(landed)

    def _arrived(self, ev: kv_pb2.ShipIn, link: ShipperLink) -> None:
        landed = Landed(link, ev.offset, ev.nbytes, link.arena.tensor[ev.offset : ev.offset + ev.nbytes])
        with self._lock:
            if self._closed or ev.seq_no in self._landed:
                fn, keep = None, False
            else:
                self._landed[ev.seq_no] = landed
                fn, keep = self._waiting.pop(ev.seq_no, None), True
        if not keep:
            link.release(landed)  # after close, or a repeated seq_no: not ours to keep
        elif fn is not None:
            fn()

    def fail(self, reason: str) -> None:
        with self._lock:
            self._failed = self._failed or reason
            waiting, self._waiting = list(self._waiting.values()), {}
        for fn in waiting:
            fn()

    def close(self) -> None:
        """Give back whatever landed and was never taken; later arrivals are given back as they land."""
        with self._lock:
            self._closed = True
            landed, self._landed = list(self._landed.values()), {}
        for got in landed:
            got.link.release(got)
        for link in self.links:
            link._forget(self.key)


class ShipperLink:
    def __init__(
        self,
        role: str,
        arena_bytes: int,
        pin: bool,
        host: str = "127.0.0.1",
        port: int = 0,
        environ: Mapping[str, str] | None = None,
        max_shipment_bytes: int = 64 << 20,
        arena_wait_s: float = 60.0,
        idle_close_s: float | None = None,
        log_level: str = "WARNING",
    ):
        """`environ`: the shipper's environment (the service's resolved token and TLS files: its Push port is
        internal); `pin`: the arena is registered with CUDA; `arena_wait_s`: decode, how long a full arena may hold
        a Push stream before failing it."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"shipper role must be prefill or decode, got {role!r}")
        self.role = role
        self.arena = SharedArena(arena_bytes, pin=pin)
        self.host, self.port = host, port
        self.environ = dict(os.environ if environ is None else environ)
        self.max_shipment_bytes = max_shipment_bytes
        self.arena_wait_s = arena_wait_s
        self.idle_close_s = idle_close_s  # prefill: a Push stream idle this long ends (None: the shipper's default)
        self.log_level = log_level
        self._lock = threading.Lock()
        self._space = threading.Condition()  # prefill: a staging block was given back
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._ready = threading.Event()
        self._started_at = 0.0
        self._inboxes: dict[bytes, Inbox] = {}
        self._held: set[int] = set()  # decode: offsets of landed regions not given back (the engine may read them)
        self._watchers: dict[bytes, Callable[[str], object]] = {}
        self.restarts = 0
        self.dropped = 0  # decode: batches that landed for no open transfer (given back at once)
        self.closed = False

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> ShipperLink:
        with self._lock:
            self._start_locked()
        return self

    def _start_locked(self) -> None:
        self._started_at = time.monotonic()
        if self._sock is not None:  # the previous shipper's link
            self._sock.close()
            self._sock = None
        ours, theirs = socket.socketpair()
        cmd = [
            sys.executable, "-m", "pdserve.kv.shipper", "--role", self.role, "--control-fd", str(theirs.fileno()),
            "--arena-fd", str(self.arena.fd), "--arena-bytes", str(self.arena.nbytes), "--host", self.host,
            "--port", str(self.port), "--max-shipment-bytes", str(self.max_shipment_bytes),
            "--arena-wait-s", str(self.arena_wait_s), "--log-level", self.log_level,
        ]  # fmt: skip
        if self.idle_close_s is not None:
            cmd += ["--idle-close-s", str(self.idle_close_s)]
        try:
            proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno(), self.arena.fd], env=self.environ)
        except OSError as e:
            ours.close()
            log.warning("kv shipper (%s) did not start: %s; KV goes over plain grpc", self.role, e)
            return
        finally:
            theirs.close()
        self._proc, self._sock = proc, ours
        self._ready = ready = threading.Event()
        threading.Thread(target=self._read, args=(ours, proc, ready), daemon=True, name="kv-shipper").start()
        if not ready.wait(START_TIMEOUT_S) or proc.poll() is not None:
            log.warning("kv shipper (%s) not ready within %.0fs; KV goes over plain grpc", self.role, START_TIMEOUT_S)
            proc.kill()
            return
        log.info("kv shipper (%s): process %d%s", self.role, proc.pid, f", Push on port {self.port}" * bool(self.port))

    def ready(self) -> bool:
        """Whether the shipper serves (started again if it exited and the last start is `RESTART_AFTER_S` old)."""
        with self._lock:
            if self.closed:
                return False
            if self.alive:
                return True
            if time.monotonic() - self._started_at < RESTART_AFTER_S:
                return False
            if self._held:  # a new shipper would land bytes over regions a receiver may still be reading
                return False
            if self._proc is not None:
                if self._proc.poll() is None:  # its control link broke: whatever it does, it is done
                    self._proc.kill()
                    self._proc.wait()
                log.warning("kv shipper (%s) exited (%s); starting it again", self.role, self._proc.returncode)
                self.restarts += 1
            self._start_locked()
            return self._proc is not None and self._proc.poll() is None and self._ready.is_set()

    @property
    def alive(self) -> bool:
        """The shipper runs and said it serves (no restart attempted: `ready` does that)."""
        proc = self._proc
        return proc is not None and proc.poll() is None and self._ready.is_set() and not self.closed

    def events(self) -> dict[str, int]:
        """Counters for metrics."""
        with self._lock:
            return {"restarts": self.restarts, "dropped": self.dropped}

    def address(self, host: str) -> str:
        """decode: where prefill's shipper pushes (`host`: this service's advertised host)."""
        return f"{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def close(self) -> None:
        with self._lock:
            self.closed = True
            proc, sock = self._proc, self._sock
            self._proc = self._sock = None
        if sock is not None:
            try:  # the shipper sees EOF and exits (a close alone would wait for the event reader's recv)
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        if proc is not None:
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._fail_all("the KV shipper was closed")
        self.arena.close()

    # ---- events ------------------------------------------------------------------------------------------------
    def _read(self, sock: socket.socket, proc: subprocess.Popen, ready: threading.Event) -> None:
        try:
            while (ev := recv_event(sock)) is not None:
                kind = ev.WhichOneof("event")
                if kind == "arrived":
                    with self._lock:
                        inbox = self._inboxes.get(ev.arrived.transfer_key)
                        self._held.add(ev.arrived.offset)
                        if inbox is None:
                            self.dropped += 1
                    if inbox is None:
                        self.release(Landed(self, ev.arrived.offset, ev.arrived.nbytes, self.arena.tensor[:0]))
                    else:
                        inbox._arrived(ev.arrived, self)
                elif kind == "failed":
                    with self._lock:
                        watcher = self._watchers.get(ev.failed.transfer_key)
                    if watcher is not None:
                        watcher(ev.failed.reason)
                elif kind == "ready":
                    if self.role == "decode":
                        self.port = ev.ready.port
                    ready.set()
        except (OSError, ConnectionError) as e:
            if not self.closed:
                log.warning("kv shipper link broke: %s", e)
        except Exception:
            log.exception("kv shipper events")
        ready.clear()  # not `alive` from here on, even before the process is reaped
        proc.poll()
        if not self.closed:
            log.warning("kv shipper (%s) process %d ended (%s)", self.role, proc.pid, proc.returncode)
        self._fail_all(f"the {self.role} side's KV shipper process exited")

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            inboxes, watchers = list(self._inboxes.values()), list(self._watchers.values())
        for inbox in inboxes:
            inbox.fail(reason)
        for watcher in watchers:
            watcher(reason)

    def _send(self, cmd: kv_pb2.ShipperCommand) -> None:
        sock = self._sock
        if sock is None:
            raise ShipperDown("the KV shipper is not running")
        with self._send_lock:
            try:
                send_message(sock, cmd)
            except OSError as e:
                raise ShipperDown(f"the KV shipper is gone: {e}") from e

    # ---- prefill -----------------------------------------------------------------------------------------------
    def try_reserve(self, nbytes: int) -> ArenaBlock | None:
        """A staging block of the arena if one is free now (None otherwise)."""
        self._check_batch(nbytes)
        with self._space:
            return self.arena.alloc(nbytes)

    def reserve(self, nbytes: int, timeout: float) -> ArenaBlock:
        """A staging block of the arena; waits for blocks given back up to `timeout` (TimeoutError)."""
        self._check_batch(nbytes)
        deadline = time.monotonic() + timeout
        with self._space:
            while (block := self.arena.alloc(nbytes)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {nbytes}-byte shipper arena block free within {timeout}s")
                self._space.wait(left)
            return block

    def _check_batch(self, nbytes: int) -> None:
        if nbytes > self.arena.nbytes // 2:
            raise ValueError(f"a {nbytes}-byte batch exceeds half the {self.arena.nbytes}-byte shipper arena")

    def give(self, block: ArenaBlock) -> None:
        with self._space:
            self.arena.release(block)
            self._space.notify_all()

    def push(self, address: str, key: bytes, seq_no: int, block: ArenaBlock, nbytes: int) -> None:
        """Ship `nbytes` of `block` to decode's shipper at `address` as batch `seq_no` of transfer `key`."""
        out = kv_pb2.ShipOut(address=address, transfer_key=key, seq_no=seq_no, offset=block.offset, nbytes=nbytes)
        self._send(kv_pb2.ShipperCommand(push=out))

    def watch(self, key: bytes, on_failed: Callable[[str], object]) -> None:
        with self._lock:
            self._watchers[key] = on_failed

    def unwatch(self, key: bytes) -> None:
        with self._lock:
            self._watchers.pop(key, None)

    # ---- decode ------------------------------------------------------------------------------------------------
    def inbox(self, key: bytes) -> Inbox:
        """The arrivals of transfer `key` through this shipper alone."""
        inbox = Inbox([self], key)
        self._register(inbox)
        return inbox

    def _register(self, inbox: Inbox) -> None:
        """Batches of `inbox.key` that land through this shipper go to `inbox` (ValueError: the key is in use)."""
        with self._lock:
            if inbox.key in self._inboxes:
                raise ValueError("transfer key in use")
            self._inboxes[inbox.key] = inbox

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._inboxes.pop(key, None)

    def release(self, landed: Landed) -> None:
        """Give a landed batch's region back to decode's shipper (a shipper gone takes its arena use along)."""
        with self._lock:
            self._held.discard(landed.offset)
        try:
            self._send(kv_pb2.ShipperCommand(release=kv_pb2.ArenaRegion(offset=landed.offset, nbytes=landed.nbytes)))
        except ShipperDown:
            pass
