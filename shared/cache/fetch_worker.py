"""The prefix fetch's helper process: Redis values read into a shared arena, their MACs checked, outside the engine.

    python -m pdserve.cache.fetch_worker --arena-fd FD --arena-bytes N --conn-fds A,B,...   (config JSON on stdin)

Why a process: an engine process that also reads the megabyte values of a cached prefix from its sockets hands
the GIL back and forth with every `recv_into`, MAC update and checksum, and both slow down (docs/benchmarks.md,
"One GPU"). Here one thread a
connection socket (`--conn-fds`, socketpairs whose other ends the engine holds) serves requests one at a time:
pipelined GETEX of the named keys (`resp_fetch.getex_into` through `RedisStore.get_many_into`), each value of the
expected size written straight to its offset in the arena (a memfd the engine mapped and pinned), others (values
under a previous secret, or of another size) sent back in the reply; then each value's MAC is checked under the
key index the request names, and the value itself (`check_value`). The engine then only builds views of the pages
and copies the arena to the GPU.

Frames on a socket: `<I` length + body. Request body: JSON {"ttl_ms", "max_value_bytes", "blocks" (optional: the
value's blocks as [bytes, item size, unusable-bits mask]), "keys": [[name (latin-1), key index, chain digest
(hex), arena offset (-1: none), expected size, expected header (hex; "" : not checked)], ...]}. Reply body: `<I`
JSON length + JSON {"lens": [n or null], "ok": [true / false (MAC) / "why it is corrupt" / null], "extra": [index,
...]} + the extra values' bytes in that order; or JSON {"error": text, "refused": bool}. With "blocks" and a
row's header, a value whose MAC verifies is also checked as `value.decode_value` checks it (`check_value`: its
header, length, CRC32C and values), so the engine's process only builds views of it. The config on stdin:
{"store": RedisStore.spec(), "mac_keys": [hex, ...]}. The process ends when its stdin config is read and every
connection socket closed (the engine exited or closed it). Nothing here unpickles anything.
"""

from __future__ import annotations

import argparse
import json
import mmap
import socket
import struct
import sys
import threading

import crc32c
import numpy as np

from pdserve.cache.value_auth import CacheKey

_LEN = struct.Struct("<I")
MAX_FRAME = 64 << 20  # a request names at most a few thousand keys; a reply carries at most a batch's extras


def send_frame(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    """One frame made of `parts` (joined on the wire)."""
    size = sum(memoryview(p).nbytes for p in parts)
    sock.sendall(_LEN.pack(size))
    for p in parts:
        sock.sendall(p)


def recv_exact(sock: socket.socket, n: int) -> bytearray | None:
    """`n` bytes, or None on a clean EOF before the first of them (EOF inside them raises ConnectionError)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0:
                return None
            raise ConnectionError("fetch worker link closed mid-frame")
        got += k
    return buf


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME) -> bytearray | None:
    """The next frame's body (None: the peer closed the link)."""
    head = recv_exact(sock, _LEN.size)
    if head is None:
        return None
    (size,) = _LEN.unpack(head)
    if size > limit:
        raise ConnectionError(f"fetch worker frame of {size} bytes over the {limit} limit")
    body = recv_exact(sock, size) if size else bytearray()
    if body is None:
        raise ConnectionError("fetch worker link closed mid-frame")
    return body


def reply_parts(header: dict, extras: list[bytes | memoryview] = ()) -> list[bytes | memoryview]:  # type: ignore[assignment]
    js = json.dumps(header).encode()
    return [_LEN.pack(len(js)), js, *extras]


def parse_reply(body: bytearray) -> tuple[dict, memoryview]:
    """(the reply's JSON, the raw bytes after it)."""
    (n,) = _LEN.unpack_from(body)
    view = memoryview(body)
    return json.loads(bytes(view[_LEN.size : _LEN.size + n])), view[_LEN.size + n :]


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_CRC = struct.Struct("<I")


def check_value(value: memoryview, header: bytes, blocks: list[list[int]]) -> str | None:
    """Why `value` (a stored value without its MAC tag) is not a usable page whose header is `header` and whose
    blocks follow its CRC32C as `blocks` ([bytes, item size, mask]: an element with every bit of mask set is NaN or
    infinite) say; None: it is. The checks of `value.decode_value`, without torch."""
    n, size = len(header), len(header) + _CRC.size + sum(b[0] for b in blocks)
    if len(value) != size:
        return f"value has {len(value)} bytes, expected {size}"
    if value[:n] != header:
        return "value header differs (another key, page, layout or model)"
    (crc,) = _CRC.unpack_from(value, n)
    if crc32c.crc32c(value[n + _CRC.size :], crc32c.crc32c(value[:n])) != crc:
        return "value checksum mismatch"
    at = n + _CRC.size
    for nbytes, item, mask in blocks:
        if mask and nbytes:
            bits = np.frombuffer(value[at : at + nbytes], dtype=_UINT[item])
            if ((bits & mask) == mask).any():
                return "value holds NaN or infinity"
        at += nbytes
    return None


class Worker:
    """The helper's state: the store, the MAC keys, the arena mapping."""

    def __init__(self, store, mac_keys: list[bytes], arena: mmap.mmap):
        self.store = store
        self.keys = [CacheKey(k, b"", "") for k in mac_keys]
        self.arena = memoryview(arena)

    def handle(self, req: dict) -> list[bytes | memoryview]:
        rows = req["keys"]
        extras: dict[int, memoryview] = {}

        def dest(i: int, n: int) -> memoryview:
            at, size = rows[i][3], rows[i][4]
            if at >= 0 and n == size and at + n <= len(self.arena):
                return self.arena[at : at + n]
            extras[i] = memoryview(bytearray(n))
            return extras[i]

        names = [r[0].encode("latin-1") for r in rows]
        lens = self.store.get_many_into(names, int(req["ttl_ms"]), dest, int(req["max_value_bytes"]))
        blocks = req.get("blocks")
        ok: list[bool | str | None] = []
        for i, n in enumerate(lens):
            if n is None:
                ok.append(None)
                continue
            stored = extras[i] if i in extras else self.arena[rows[i][3] : rows[i][3] + n]
            key_index = rows[i][1]
            key = self.keys[key_index] if 0 <= key_index < len(self.keys) else None
            value = None if key is None else key.verify(bytes.fromhex(rows[i][2]), stored)
            header = rows[i][5] if len(rows[i]) > 5 else ""
            if value is None or not blocks or not header:
                ok.append(value is not None)
            else:
                ok.append(check_value(value, bytes.fromhex(header), blocks) or True)
        order = sorted(i for i in extras if lens[i] is not None)
        return reply_parts({"lens": lens, "ok": ok, "extra": order}, [extras[i] for i in order])

    def serve(self, sock: socket.socket) -> None:
        """Requests on one connection socket until the engine closes it."""
        from pdserve.cache.redis_store import StoreRefused

        with sock:
            while True:
                try:
                    body = recv_frame(sock)
                except OSError:
                    return
                if body is None:
                    return
                try:
                    parts = self.handle(json.loads(bytes(body)))
                except Exception as e:  # a store error (or a malformed request): the engine computes instead
                    parts = reply_parts({"error": f"{type(e).__name__}: {e}", "refused": isinstance(e, StoreRefused)})
                try:
                    send_frame(sock, parts)
                except OSError:
                    return


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arena-fd", type=int, required=True)
    ap.add_argument("--arena-bytes", type=int, required=True)
    ap.add_argument("--conn-fds", required=True)
    args = ap.parse_args(argv)
    config = json.loads(sys.stdin.buffer.read())
    from pdserve.cache.redis_store import RedisStore

    store = RedisStore(**config["store"])
    arena = mmap.mmap(args.arena_fd, args.arena_bytes)
    worker = Worker(store, [bytes.fromhex(k) for k in config["mac_keys"]], arena)
    socks = [socket.socket(fileno=int(fd)) for fd in args.conn_fds.split(",")]
    threads = [threading.Thread(target=worker.serve, args=(s,), daemon=True) for s in socks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
