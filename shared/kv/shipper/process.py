"""A shipper: the process beside a prefill or decode engine process that moves `grpc-shm` batches' bytes.

    python -m pdserve.kv.shipper --role prefill|decode --control-fd FD --arena-fd FD --arena-bytes N
                                 [--host H --port P] [--max-shipment-bytes N] [--arena-wait-s S]
                                 [--idle-close-s S] [--log-level L]

Why a process: gRPC's Python copies of a KV stream's messages (into a core slice on send, into a `bytes` on receive)
hold the GIL, and in the engine processes they share it with the engine thread, the stream readers and the copy
threads (docs/kv_transfer.md). Here they hold this process's own.

- prefill: each `ShipOut` command names a region of the engine's arena (a memfd both map) and a destination; the
  region's bytes become one `KVShipment` (copied once, outside the GIL, on a builder thread) on a long-lived
  `KVShipper.Push` stream to that decode's shipper, one stream per destination, in command order. A stream that
  fails reports `ShipFailed` for every transfer key it carried (their requests fail; nothing is retried here).
- decode: serves `KVShipper.Push` on --host:--port (internal: the service's token and TLS, from the environment
  the engine process hands over). Each shipment lands in a free region of this side's arena (the engine reads it
  there and gives it back with `ArenaRegion`); a full arena holds the stream (gRPC's flow control reaches the
  sender) up to `--arena-wait-s`, then fails it RESOURCE_EXHAUSTED. The engine hears `ShipIn` per shipment.

The process ends when the engine process closes its end of the control socket (however it ended). Nothing here
unpickles anything: commands and events are protobuf.
"""

from __future__ import annotations

import argparse
import logging
import mmap
import os
import queue
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc

from pdserve.errors import CorruptPage
from pdserve.kv.shipper.frames import address_of, memmove, parse_shipment, recv_command, send_message, shipment_bytes
from pdserve.memory_ranges import FreeRanges
from pdserve.server.auth import InternalAuth
from pdserve.server.grpc_util import CHANNEL_OPTIONS, SERVER_OPTIONS
from pdserve.server.host_memory import tune_malloc
from pdserve.server.security import ChannelSecurity, tls_from, token_from
from pdserve.v1 import kv_pb2

log = logging.getLogger("pdserve.kv.shipper")
PUSH_METHOD = "/pdserve.v1.KVShipper/Push"
ALIGN = 512  # arena regions (the engine's device copies read them at this alignment)
BUILD_AHEAD = 3  # shipments built ahead of gRPC's writer per stream
IDLE_CLOSE_S = 60.0  # prefill: a Push stream with nothing to send this long ends (it holds a thread at decode)
PUSH_STREAMS = 64  # decode: Push streams at once (one per prefill shipper sending to it); beyond: RESOURCE_EXHAUSTED


class Control:
    """This end of the control socket: events out (one writer at a time), commands in."""

    def __init__(self, fd: int):
        self.sock = socket.socket(fileno=fd)
        self._lock = threading.Lock()

    def emit(self, **event) -> None:
        with self._lock:
            try:
                send_message(self.sock, kv_pb2.ShipperEvent(**event))
            except OSError:
                pass  # the engine process is gone; the command loop sees EOF and ends the process


# ---- prefill: pushing --------------------------------------------------------------------------------------------
class PeerStream:
    """One Push stream to a decode's shipper: shipments built ahead on a thread, sent in order."""

    def __init__(
        self,
        address: str,
        arena: memoryview,
        security: ChannelSecurity,
        control: Control,
        on_end,
        first: kv_pb2.ShipOut,
        idle_close_s: float = IDLE_CLOSE_S,
    ):
        """`first`: the shipment that opens the stream (queued before the call starts: a call that fails at once
        still fails it)."""
        self.address = address
        self.arena = arena
        self.control = control
        self._on_end = on_end
        self._todo: queue.Queue[kv_pb2.ShipOut | None] = queue.Queue()
        self._built: queue.Queue[bytes | None] = queue.Queue(BUILD_AHEAD)
        self._keys: set[bytes] = {first.transfer_key}  # every transfer this stream carried (failed together)
        self._todo.put(first)
        self._lock = threading.Lock()
        self._ended = False
        self.idle_close_s = idle_close_s
        channel = security.open(address, CHANNEL_OPTIONS)
        ident = lambda b: b  # noqa: E731  (bytes as they are: written by `shipment_bytes`)
        push = channel.stream_unary(PUSH_METHOD, request_serializer=ident, response_deserializer=ident)
        self._channel = channel
        threading.Thread(target=self._build, daemon=True, name=f"build-{address}").start()
        self._call = push.future(self._messages())
        self._call.add_done_callback(self._done)

    def put(self, cmd: kv_pb2.ShipOut) -> bool:
        """Queue a shipment; False when this stream already ended (the caller opens another)."""
        with self._lock:  # queued under the lock: the builder's idle end checks the queue under it too
            if self._ended:
                return False
            self._keys.add(cmd.transfer_key)
            self._todo.put(cmd)
        return True

    def _build(self) -> None:
        while True:
            try:
                cmd = self._todo.get(timeout=self.idle_close_s)
            except queue.Empty:
                with self._lock:  # idle: end the stream, unless a shipment came in meanwhile
                    if self._todo.empty():
                        self._ended = True
                        break
                continue
            if cmd is None:
                break
            region = self.arena[cmd.offset : cmd.offset + cmd.nbytes]
            self._built.put(shipment_bytes(cmd.transfer_key, cmd.seq_no, region))
        self._built.put(None)

    def _messages(self) -> Iterator[bytes]:
        while (msg := self._built.get()) is not None:
            yield msg

    def _done(self, call) -> None:
        with self._lock:
            self._ended = True
            keys, self._keys = self._keys, set()
        self._todo.put(None)
        err = call.exception()
        if err is not None:
            code = err.code().name if hasattr(err, "code") else type(err).__name__
            detail = err.details() if hasattr(err, "details") else str(err)
            reason = f"push to decode's shipper {self.address} failed: {code}: {detail}"
            log.warning("%s (%d transfers)", reason, len(keys))
            for key in keys:
                self.control.emit(failed=kv_pb2.ShipFailed(transfer_key=key, reason=reason))
        self._on_end(self)
        threading.Thread(target=self._channel.close, daemon=True).start()  # not from the call's own callback

    def close(self) -> None:
        self._todo.put(None)


class Pusher:
    """Prefill's shipper: one PeerStream per destination, opened on first use and again after it ended."""

    def __init__(self, arena: memoryview, security: ChannelSecurity, control: Control, idle_close_s: float):
        self.arena = arena
        self.security = security
        self.control = control
        self.idle_close_s = idle_close_s
        self._lock = threading.Lock()
        self._streams: dict[str, PeerStream] = {}
        self.opened = 0  # streams opened (a log line at exit; tests)

    def push(self, cmd: kv_pb2.ShipOut) -> None:
        if cmd.offset + cmd.nbytes > len(self.arena):
            self.control.emit(failed=kv_pb2.ShipFailed(transfer_key=cmd.transfer_key, reason="region outside arena"))
            return
        with self._lock:
            stream = self._streams.get(cmd.address)
        if stream is not None and stream.put(cmd):
            return
        if stream is not None:
            self._ended(stream)
        # a new stream takes `cmd` first; if it fails, `cmd`'s transfer fails with it (no retry loop)
        stream = PeerStream(
            cmd.address, self.arena, self.security, self.control, self._ended, first=cmd, idle_close_s=self.idle_close_s
        )
        self.opened += 1
        log.info("push stream %d to %s opened", self.opened, cmd.address)
        with self._lock:
            self._streams[cmd.address] = stream

    def _ended(self, stream: PeerStream) -> None:
        with self._lock:
            if self._streams.get(stream.address) is stream:
                del self._streams[stream.address]

    def close(self) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for s in streams:
            s.close()


# ---- decode: receiving -------------------------------------------------------------------------------------------
class Landing:
    """Decode's shipper: shipments into free arena regions, `ShipIn` to the engine, regions back on `ArenaRegion`."""

    def __init__(self, arena: memoryview, control: Control, max_shipment_bytes: int, wait_s: float):
        self.arena = arena
        self.base = address_of(arena)
        self.control = control
        self.max_shipment_bytes = max_shipment_bytes
        self.wait_s = wait_s
        self._cv = threading.Condition()
        self._ranges = FreeRanges(len(arena), ALIGN)

    def release(self, region: kv_pb2.ArenaRegion) -> None:
        with self._cv:
            try:
                self._ranges.give(region.offset, region.nbytes)
            except ValueError as e:
                log.error("engine gave back a region it does not hold: %s", e)
            self._cv.notify_all()

    def _reserve(self, n: int, context) -> int:
        deadline = time.monotonic() + self.wait_s
        with self._cv:
            while (offset := self._ranges.take(n)) is None:
                left = deadline - time.monotonic()
                if left <= 0 or not context.is_active():
                    context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"decode's shipper arena had no {n} free bytes for {self.wait_s:.0f}s "
                        "(its engine is not taking KV batches)",
                    )
                self._cv.wait(min(left, 1.0))
            return offset

    def push(self, request_iterator, context) -> bytes:
        count = 0
        for raw in request_iterator:
            try:
                key, seq, payload = parse_shipment(raw)
            except CorruptPage as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad KV shipment: {e}")
            n = payload.nbytes
            if n > self.max_shipment_bytes:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"KV shipment of {n} bytes over this shipper's {self.max_shipment_bytes}-byte limit",
                )
            offset = self._reserve(n, context)
            memmove(self.base + offset, payload, n)  # GIL released
            self.control.emit(arrived=kv_pb2.ShipIn(transfer_key=key, seq_no=seq, offset=offset, nbytes=n))
            count += 1
        return kv_pb2.KVShipReceipt(shipments=count).SerializeToString()


def serve_landing(landing: Landing, host: str, port: int, environ) -> tuple[grpc.Server, int]:
    tls = tls_from("", "", "", environ)
    token = token_from("", environ)
    handler = grpc.method_handlers_generic_handler(
        "pdserve.v1.KVShipper",
        {"Push": grpc.stream_unary_rpc_method_handler(landing.push)},  # raw bytes in and out
    )
    server = grpc.server(  # each Push stream holds a thread while it lasts (prefill ends idle ones)
        futures.ThreadPoolExecutor(max_workers=PUSH_STREAMS, thread_name_prefix="push"),
        options=[*SERVER_OPTIONS, ("grpc.max_receive_message_length", landing.max_shipment_bytes + (1 << 16))],
        interceptors=[InternalAuth(token)],
        maximum_concurrent_rpcs=PUSH_STREAMS,
    )
    server.add_generic_rpc_handlers((handler,))
    address = f"{host}:{port}"
    if tls.on:
        bound = server.add_secure_port(address, tls.server_credentials(require_client_auth=bool(tls.ca)))
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise SystemExit(f"shipper: could not bind {address}")
    server.start()
    return server, bound


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.kv.shipper", description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--control-fd", type=int, required=True)
    ap.add_argument("--arena-fd", type=int, required=True)
    ap.add_argument("--arena-bytes", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--max-shipment-bytes", type=int, default=64 << 20)
    ap.add_argument("--arena-wait-s", type=float, default=60.0)
    ap.add_argument("--idle-close-s", type=float, default=IDLE_CLOSE_S)
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s shipper[%(process)d] %(levelname)s %(message)s")
    tune_malloc()  # each shipment is a fresh multi-MB bytes: reuse faulted-in heap pages (as the services do)
    control = Control(args.control_fd)
    mm = mmap.mmap(args.arena_fd, args.arena_bytes)
    os.close(args.arena_fd)
    arena = memoryview(mm)
    server = None
    pusher = landing = None
    if args.role == "decode":
        landing = Landing(arena, control, args.max_shipment_bytes, args.arena_wait_s)
        server, port = serve_landing(landing, args.host, args.port, os.environ)
        control.emit(ready=kv_pb2.ShipperReady(port=port))
    else:
        pusher = Pusher(arena, ChannelSecurity.from_env(), control, args.idle_close_s)
        control.emit(ready=kv_pb2.ShipperReady(port=0))
    try:
        while (cmd := recv_command(control.sock)) is not None:
            kind = cmd.WhichOneof("cmd")
            if kind == "push" and pusher is not None:
                pusher.push(cmd.push)
            elif kind == "release" and landing is not None:
                landing.release(cmd.release)
            else:
                log.error("command %r does not apply to a %s shipper", kind, args.role)
    except (OSError, ConnectionError) as e:
        log.warning("control link broke: %s", e)
    finally:
        if server is not None:
            server.stop(0)
        if pusher is not None:
            pusher.close()
    os._exit(0)  # the engine is gone: gRPC's threads are not worth joining
