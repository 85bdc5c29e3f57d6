"""Slow and too many clients against a gateway with small limits: headers trickled one line at a time and a body
stalled after `{` are cut off at their deadlines, a body over the cap is 413, a connection over the cap is 503, a
kept-alive connection idles until the keep-alive timeout (not the header one)."""

from __future__ import annotations

import json
import socket
import time

import pytest
from gateway_testutil import post, read_response, running_gateway, scripted_router

HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 2.0
KEEP_ALIVE_S = 4.0
MAX_CONNECTIONS = 2
MAX_BODY_BYTES = 10 * 1024
SLACK_S = 3.0  # scheduling on a busy box: a deadline fires at most this late
GET_HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    flags = [
        *("--header-timeout-s", str(HEADER_TIMEOUT_S), "--body-timeout-s", str(BODY_TIMEOUT_S)),
        *("--keep-alive-s", str(KEEP_ALIVE_S), "--max-connections", str(MAX_CONNECTIONS)),
        *("--max-body-mb", str(MAX_BODY_BYTES / (1 << 20))),
    ]
    with scripted_router() as (_, router):
        with running_gateway(router, tmp_path_factory.mktemp("gw-limits"), *flags) as address:
            yield address


def _closed_within(s: socket.socket, seconds: float) -> bool:
    """Whether the server closes `s` within `seconds` (whatever it sends first is read and dropped)."""
    s.settimeout(seconds)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            if not s.recv(4096):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


@pytest.mark.parametrize("trickle", [False, True])
def test_slow_headers_are_cut_off(gateway, trickle):
    """A client that sends nothing, or one header line every 0.5 s, gets 408 and a closed connection once the
    header deadline passes (it would have kept going for 20 s)."""
    with socket.create_connection(gateway) as s:
        t0 = time.monotonic()
        s.settimeout(0.5)
        answer = b""
        if trickle:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        for i in range(40):
            try:
                chunk = s.recv(4096)
            except TimeoutError:
                if trickle:
                    s.sendall(f"x-slow-{i}: 1\r\n".encode())
                continue
            except ConnectionResetError:
                break
            answer += chunk
            if not chunk:
                break
        cut_after = time.monotonic() - t0
    assert HEADER_TIMEOUT_S - 0.2 <= cut_after <= HEADER_TIMEOUT_S + SLACK_S, cut_after
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "header_timeout"


def test_stalled_body_is_408(gateway):
    with socket.create_connection(gateway, timeout=BODY_TIMEOUT_S + SLACK_S + 5) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n")
        s.sendall(b"content-length: 100\r\n\r\n{")
        status, headers, body = read_response(s)
        took = time.monotonic() - t0
        assert status == 408 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "body_timeout"
        assert BODY_TIMEOUT_S - 0.2 <= took <= BODY_TIMEOUT_S + SLACK_S, took
        assert _closed_within(s, 2)


def test_unread_body_is_cut_off(gateway):
    """A route that answers without reading the body (here 405): the connection is still closed once the body
    deadline (and its grace) passed without the rest of the body."""
    with socket.create_connection(gateway, timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /health HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
        status, _, _ = read_response(s)
        assert status == 405
        assert _closed_within(s, BODY_TIMEOUT_S + 1 + SLACK_S)
        assert time.monotonic() - t0 >= BODY_TIMEOUT_S


def test_body_over_the_cap_is_413(gateway):
    big = json.dumps({"model": "m", "prompt": "x" * MAX_BODY_BYTES}).encode()
    status, answer = post(gateway, "/v1/completions", big)
    assert status == 413 and answer["error"]["code"] == "body_too_large"
    status, answer = post(gateway, "/v1/completions", big[: MAX_BODY_BYTES // 2])  # under the cap: parsed
    assert status == 400 and answer["error"]["code"] == "invalid_json"


def test_connections_over_the_cap_get_503(gateway):
    held = [socket.create_connection(gateway, timeout=10) for _ in range(MAX_CONNECTIONS)]
    try:
        for s in held:  # each has a request under way (well within the header deadline)
            s.sendall(b"GET /health HTTP/1.1\r\n")
        with socket.create_connection(gateway, timeout=10) as extra:
            extra.sendall(GET_HEALTH)
            assert read_response(extra)[0] == 503
        held.pop().close()
        time.sleep(0.3)  # the server sees the close
        with socket.create_connection(gateway, timeout=10) as extra:
            extra.sendall(GET_HEALTH)
            assert read_response(extra)[0] == 200
    finally:
        for s in held:
            s.close()


def test_kept_alive_connection_outlives_the_header_deadline(gateway):
    """Idle between requests is the keep-alive timeout's business: a second request after longer than the header
    deadline is served; then the idle connection is closed after the keep-alive time."""
    with socket.create_connection(gateway, timeout=10) as s:
        s.sendall(GET_HEALTH)
        assert read_response(s)[0] == 200
        time.sleep(HEADER_TIMEOUT_S + 0.5)
        s.sendall(GET_HEALTH)
        assert read_response(s)[0] == 200
        t0 = time.monotonic()
        assert _closed_within(s, KEEP_ALIVE_S + SLACK_S)
        assert time.monotonic() - t0 >= KEEP_ALIVE_S - 0.2


def test_headers_over_the_cap_are_400(gateway):
    """Request line + headers still incomplete after --max-header-kb (16 KiB by default; h11's bound on what it
    buffers): 400 in the OpenAI error shape, connection closed."""
    with socket.create_connection(gateway, timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ")
        try:
            for _ in range(20):  # 1 KiB pieces: the server buffers them, incomplete, until the cap
                s.sendall(b"a" * 1024)
                time.sleep(0.02)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered and closed before the last pieces
        status, headers, body = read_response(s)
        assert status == 400 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "invalid_http"
