"""Pipelined GETEX whose values are read from the socket straight into the caller's buffers (pinned host memory on
CUDA): the prompt cache's fast path for the megabyte values of KV pages.

    getex_into(sock, keys, ttl_ms, dest, max_value_bytes) -> [value length or None per key]
    send_getex(sock, keys, ttl_ms); read_getex(sock, len(keys), dest, max_value_bytes)   the same in two halves

redis-py's parser copies every value several times while holding the GIL (socket buffer, BytesIO, bytes); here
a value's header line is parsed from a small read-ahead, and its body is `recv_into` the buffer `dest(i, n)`
returns (a few KiB of read-ahead aside, one kernel copy, outside the GIL), so several connections on several
threads fetch at the host's speed. `sock` is a connected socket of a redis-py connection (AUTH, TLS, SELECT
already done by redis-py); RESP2 and RESP3 replies are read. A value longer than `max_value_bytes`, or one
`dest` declines, is read and discarded (None); an error reply or a broken link raises ConnectionError and the
caller drops the connection (its pipeline state is unknown).
"""

from __future__ import annotations

import socket
from collections.abc import Callable

READ_AHEAD = 64 * 1024  # header reads: at most this much of a value body is copied from the read-ahead


def pack_getex(keys: list[bytes], ttl_ms: int) -> bytes:
    """The RESP commands `GETEX key PX ttl_ms` for every key, as one buffer."""
    ttl = str(int(ttl_ms)).encode()
    tail = b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl)
    return b"".join(b"*4\r\n$5\r\nGETEX\r\n$%d\r\n%s\r\n%s" % (len(k), k, tail) for k in keys)


class _Reader:
    """RESP replies from a socket: header lines through a small read-ahead, bodies into caller buffers."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()
        self.pos = 0
        self._chunk = bytearray(READ_AHEAD)

    def _fill(self) -> None:
        n = self.sock.recv_into(self._chunk)
        if n == 0:
            raise ConnectionError("Redis closed the connection mid-reply")
        if self.pos:
            del self.buf[: self.pos]
            self.pos = 0
        self.buf += memoryview(self._chunk)[:n]

    def line(self, limit: int = 1024) -> bytes:
        while True:
            end = self.buf.find(b"\r\n", self.pos)
            if end >= 0:
                out = bytes(self.buf[self.pos : end])
                self.pos = end + 2
                return out
            if len(self.buf) - self.pos > limit:
                raise ConnectionError("Redis reply header too long")
            self._fill()

    def read_into(self, dest: memoryview | None, n: int) -> None:
        """The next `n` bytes into `dest` (None: discarded)."""
        have = min(n, len(self.buf) - self.pos)
        if dest is not None and have:
            dest[:have] = self.buf[self.pos : self.pos + have]
        self.pos += have
        got = have
        while got < n:
            if dest is not None:
                k = self.sock.recv_into(dest[got:], n - got)
            else:
                k = self.sock.recv_into(self._chunk, min(n - got, len(self._chunk)))
            if k == 0:
                raise ConnectionError("Redis closed the connection mid-value")
            got += k

    def crlf(self) -> None:
        while len(self.buf) - self.pos < 2:
            self._fill()
        if self.buf[self.pos : self.pos + 2] != b"\r\n":
            raise ConnectionError("Redis reply out of step (no CRLF after a value)")
        self.pos += 2


def getex_into(
    sock: socket.socket,
    keys: list[bytes],
    ttl_ms: int,
    dest: Callable[[int, int], memoryview | None],
    max_value_bytes: int,
) -> list[int | None]:
    """Pipelined GETEX of `keys` on `sock`: value i of length n is read into `dest(i, n)` (a writable buffer of n
    bytes, or None to discard it). Returns each value's length, None where absent or discarded. Raises
    ConnectionError (error reply, closed link, protocol trouble) and socket timeouts (OSError)."""
    if not keys:
        return []
    send_getex(sock, keys, ttl_ms)
    return read_getex(sock, len(keys), dest, max_value_bytes)


def send_getex(sock: socket.socket, keys: list[bytes], ttl_ms: int) -> None:
    """The first half of `getex_into`: the pipelined commands sent (a caller with several servers sends to each
    before it reads any, so they all work at once)."""
    if keys:
        sock.sendall(pack_getex(keys, ttl_ms))


def read_getex(
    sock: socket.socket, count: int, dest: Callable[[int, int], memoryview | None], max_value_bytes: int
) -> list[int | None]:
    """The second half of `getex_into`: the `count` replies of a `send_getex` on `sock`, read as it says."""
    r = _Reader(sock)
    out: list[int | None] = []
    for i in range(count):
        head = r.line()
        kind = head[:1]
        if kind == b"$":
            n = int(head[1:])
            if n < 0:
                out.append(None)
                continue
            buf = dest(i, n) if n <= max_value_bytes else None
            if buf is not None and len(buf) != n:
                raise ValueError(f"dest gave {len(buf)} bytes for a value of {n}")
            r.read_into(buf, n)
            r.crlf()
            out.append(n if buf is not None else None)
        elif kind == b"_":  # RESP3 null
            out.append(None)
        elif kind in (b"-", b"!"):
            raise ConnectionError(f"Redis error reply: {head[1:200].decode(errors='replace')}")
        else:
            raise ConnectionError(f"unexpected Redis reply type {head[:16]!r}")
    if r.pos != len(r.buf):
        raise ConnectionError("Redis sent more than the replies asked for")
    return out
