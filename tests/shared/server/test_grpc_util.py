"""pdserve's synchronous channels: a server stream is received on the iterating thread (no channel spin thread),
and still ends at once when another thread cancels it, as the router cancels decode's call when its caller leaves."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from pdserve.server.grpc_util import channel, make_server
from pdserve.server.security import ChannelSecurity


@pytest.fixture
def endless_stream():
    """A server whose method streams one message, then holds the call open until it is cancelled."""
    released = threading.Event()

    def stream(request: bytes, context):
        yield b"first"
        while context.is_active() and not released.wait(0.05):
            pass

    server = make_server(max_workers=4, max_concurrent_rpcs=8)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("t.Hop", {"Stream": grpc.unary_stream_rpc_method_handler(stream)})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    released.set()
    server.stop(None)


def test_a_stream_blocked_in_next_ends_when_another_thread_cancels_it(endless_stream):
    with channel(endless_stream, ChannelSecurity.anonymous()) as ch:
        call = ch.unary_stream("/t.Hop/Stream")(b"x", timeout=30)
        assert next(call) == b"first"
        assert type(call).__name__ == "_SingleThreadedRendezvous"  # received on this thread
        timer = threading.Timer(0.2, call.cancel)
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            next(call)
        assert err.value.code() == grpc.StatusCode.CANCELLED
        assert time.monotonic() - t0 < 5
        timer.join()


def test_a_stream_past_its_deadline_ends_deadline_exceeded(endless_stream):
    with channel(endless_stream, ChannelSecurity.anonymous()) as ch:
        call = ch.unary_stream("/t.Hop/Stream")(b"x", timeout=0.3)
        assert next(call) == b"first"
        with pytest.raises(grpc.RpcError) as err:
            next(call)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
