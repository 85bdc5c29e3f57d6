"""The SDK reconnects quickly to a router that restarts on its address: gRPC's default reconnect backoff grows to
120 s, so a long-lived client whose router was down for a while would keep failing UNAVAILABLE for many seconds
after the router is back."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest

import pdserve
from pdserve.v1 import generate_pb2, generate_pb2_grpc


class _Echo(generate_pb2_grpc.GenerationServicer):
    def Generate(self, request, context):
        return generate_pb2.GenerateResponse(
            request_id="r", text="ok", finish_reason=generate_pb2.FINISH_REASON_STOP, token_ids=[1]
        )


def _serve(port: int = 0) -> tuple[grpc.Server, int]:
    """A Generation server on `port` (0: any free one, read back)."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    generate_pb2_grpc.add_GenerationServicer_to_server(_Echo(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    assert bound and (port in (0, bound))
    server.start()
    return server, bound


@pytest.mark.parametrize("down_s", [10.0])
def test_client_reconnects_within_a_second_or_two_after_a_long_outage(down_s):
    server, port = _serve()
    with pdserve.Client(f"127.0.0.1:{port}", timeout=2, retry=False) as c:
        assert c.generate(token_ids=[1, 2]).text == "ok"
        server.stop(0).wait()
        t_down = time.monotonic()
        failures = 0
        while time.monotonic() - t_down < down_s:  # callers keep trying meanwhile; the backoff grows
            with pytest.raises(grpc.RpcError) as err:
                c.generate(token_ids=[1, 2])
            assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            failures += 1
            time.sleep(0.2)
        server, _ = _serve(port)  # the same address, as a restarted router
        try:
            t_up = time.monotonic()
            while True:
                try:
                    assert c.generate(token_ids=[1, 2]).text == "ok"
                    break
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE
                    time.sleep(0.05)
            back_s = time.monotonic() - t_up
        finally:
            server.stop(0)
    assert failures > 0
    # gRPC's default backoff (1 s x 1.6 per attempt, up to 120 s) puts the next attempt ~5 s after a 10 s outage
    assert back_s < 2.0, f"client needed {back_s:.1f} s to use the restarted server"
