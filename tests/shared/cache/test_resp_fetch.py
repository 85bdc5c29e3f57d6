"""`resp_fetch.getex_into` against a scripted server socket: bodies that arrive in pieces are read whole, a server
that stalls mid-value ends the read within the socket's timeout, and the socket's own timeout is left as it was."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from pdserve.cache.resp_fetch import getex_into


def scripted_pair(chunks: list[bytes], pause_s: float, then_stall: bool = False):
    """A connected (client, thread): the server side reads the request, then sends `chunks` `pause_s` apart (and,
    `then_stall`, keeps the link open without sending more until the client goes)."""
    server, client = socket.socketpair()

    def serve():
        server.recv(1 << 16)
        for c in chunks:
            server.sendall(c)
            time.sleep(pause_s)
        if then_stall:
            server.recv(1)  # until the client closes
        server.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return client, t


def into(store: dict):
    def dest(i: int, n: int) -> memoryview:
        store[i] = bytearray(n)
        return memoryview(store[i])

    return dest


def test_a_body_in_pieces_is_read_whole_and_the_timeout_kept():
    body = bytes(range(256)) * 4000  # ~1 MB
    reply = b"$%d\r\n" % len(body) + body + b"\r\n$-1\r\n"
    pieces = [reply[i : i + 100_000] for i in range(0, len(reply), 100_000)]
    sock, t = scripted_pair(pieces, pause_s=0.01)
    sock.settimeout(2.0)
    got: dict = {}
    assert getex_into(sock, [b"k", b"absent"], 1000, into(got), 1 << 21) == [len(body), None]
    assert bytes(got[0]) == body
    assert sock.gettimeout() == 2.0
    sock.close()
    t.join(5)


def test_a_server_stalling_mid_value_ends_the_read_within_the_timeout():
    sock, t = scripted_pair([b"$100000\r\n" + b"x" * 5000], pause_s=0.0, then_stall=True)
    sock.settimeout(0.3)
    t0 = time.monotonic()
    with pytest.raises(OSError):
        getex_into(sock, [b"k"], 1000, into({}), 1 << 20)
    assert time.monotonic() - t0 < 2.0
    assert sock.gettimeout() == 0.3
    sock.close()
    t.join(5)
