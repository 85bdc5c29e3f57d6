"""pdserve.server.auth / security / tls / stream_gate in one process: token lists, the startup refusals, mTLS
handshakes with a private CA, the internal-token check and the stream gate on a real gRPC server."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.server.auth import Authenticator, InternalAuth, parse_tokens
from pdserve.server.grpc_util import bind, channel, make_server
from pdserve.server.security import ChannelSecurity, ServiceSecurity
from pdserve.server.stream_gate import StreamGate
from pdserve.server.tls import TlsConfig, is_loopback
from pdserve.testing.certs import CertAuthority
from pdserve.testing.wait import wait_until
from pdserve.v1 import internal_pb2, internal_pb2_grpc

TOKEN = "internal-token-0123456789"


def test_token_lists_parse_and_refuse_mistakes():
    assert parse_tokens("# c\ntok-0123456789abcdef a\n\ntok-1123456789abcdef b # x\n", "f") == {
        "tok-0123456789abcdef": "a",
        "tok-1123456789abcdef": "b",
    }
    assert parse_tokens('{"tok-0123456789abcdef": "a"}', "f") == {"tok-0123456789abcdef": "a"}
    assert parse_tokens("tok-0123456789abcdef a,tok-1123456789abcdef b", "env") == {
        "tok-0123456789abcdef": "a",
        "tok-1123456789abcdef": "b",
    }
    for bad in ("short a", "tok-0123456789abcdef", "tok-0123456789abcdef a b", "tok-0123456789abcdef a/b", "",
                "tok-0123456789abcdef a\ntok-0123456789abcdef b"):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_tokens(bad, "f")
    off = Authenticator.from_config("", {})
    assert not off.enabled
    assert Authenticator.from_config("", {"PDSERVE_AUTH_TOKENS": "tok-0123456789abcdef a"}).tenants == {"a"}


def test_startup_refusals():
    plain = ServiceSecurity(TlsConfig(), None, insecure=False)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and not is_loopback("0.0.0.0")
    assert "non-loopback" in plain.refusal("x", "0.0.0.0", internal=False)
    assert "internal identity" in plain.refusal("x", "127.0.0.1", internal=True)
    assert plain.refusal("x", "127.0.0.1", internal=False) is None
    assert ServiceSecurity(TlsConfig(), TOKEN, False).refusal("x", "127.0.0.1", internal=True) is None
    assert ServiceSecurity(TlsConfig("c", "k", "ca"), None, False).refusal("x", "0.0.0.0", internal=True) is None
    assert ServiceSecurity(TlsConfig("c", "k"), None, False).refusal("x", "0.0.0.0", internal=True)  # no mTLS, no token
    assert ServiceSecurity(TlsConfig(), None, True).refusal("x", "0.0.0.0", internal=True) is None  # --insecure
    assert TlsConfig("c", "").problems(serving=True) and TlsConfig(ca="ca").problems(serving=True)


class _Decode(internal_pb2_grpc.DecodeServicer):
    def __init__(self):
        self.release = threading.Event()

    def Stats(self, request, context):
        return internal_pb2.InstanceStats(page_size=16)

    def Generate(self, request, context):
        context.add_callback(self.release.set)
        yield internal_pb2.DecodeResponse(token_ids=[1])
        self.release.wait(30)


@contextlib.contextmanager
def _serving(interceptors, credentials=None, limit=None) -> Iterator[tuple[str, StreamGate | None]]:
    """A `_Decode` server (and health) on a free loopback port, behind a StreamGate of `limit` streams when given:
    its target and gate; stopped on exit."""
    gate = StreamGate("test", limit) if limit else None
    server = make_server(8, 32, [*interceptors, *([gate] if gate else [])], max_receive_bytes=1 << 16)
    internal_pb2_grpc.add_DecodeServicer_to_server(_Decode(), server)
    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = bind(server, "127.0.0.1", 0, credentials)
    server.start()
    try:
        yield f"127.0.0.1:{port}", gate
    finally:
        server.stop(0)


@contextlib.contextmanager
def _gated(limit: int) -> Iterator[tuple[internal_pb2_grpc.DecodeStub, StreamGate]]:
    """A plaintext Decode stub to a `_serving` server of `limit` streams at once, and its gate."""
    with _serving([], limit=limit) as (target, gate), channel(target, ChannelSecurity()) as ch:
        assert gate is not None
        yield internal_pb2_grpc.DecodeStub(ch), gate


def _stats_code(target: str, security: ChannelSecurity) -> grpc.StatusCode:
    with channel(target, security) as ch:
        try:
            internal_pb2_grpc.DecodeStub(ch).Stats(internal_pb2.StatsRequest(), timeout=5)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()


def test_internal_token_and_message_size():
    with _serving([InternalAuth(TOKEN)]) as (target, _):
        assert _stats_code(target, ChannelSecurity()) == grpc.StatusCode.UNAUTHENTICATED
        assert _stats_code(target, ChannelSecurity(token="x" * 20)) == grpc.StatusCode.PERMISSION_DENIED
        assert _stats_code(target, ChannelSecurity(token=TOKEN)) == grpc.StatusCode.OK
        with channel(target, ChannelSecurity()) as ch:  # health stays open
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        big = internal_pb2.DecodeRequest(prompt_token_ids=list(range(100_000)))  # > 64 KiB
        with channel(target, ChannelSecurity(token=TOKEN)) as ch, pytest.raises(grpc.RpcError) as e:
            list(internal_pb2_grpc.DecodeStub(ch).Generate(big, timeout=5))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_mutual_tls_handshake(tmp_path):
    ca = CertAuthority.create(tmp_path / "ca")
    server_tls, client_tls = ca.issue("server"), ca.issue("client")
    rogue = CertAuthority.create(tmp_path / "rogue").issue("rogue")
    sec = ServiceSecurity(server_tls, None, False)
    with _serving([InternalAuth(None)], sec.server_credentials(internal=True)) as (target, _):
        assert _stats_code(target, ChannelSecurity(client_tls)) == grpc.StatusCode.OK
        assert _stats_code(target, ChannelSecurity(TlsConfig(ca=server_tls.ca))) == grpc.StatusCode.UNAVAILABLE
        forged = TlsConfig(rogue.cert, rogue.key, server_tls.ca)
        assert _stats_code(target, ChannelSecurity(forged)) == grpc.StatusCode.UNAVAILABLE
        assert _stats_code(target, ChannelSecurity()) == grpc.StatusCode.UNAVAILABLE
        other_ca = TlsConfig(client_tls.cert, client_tls.key, str(tmp_path / "rogue" / "ca.pem"))
        assert _stats_code(target, ChannelSecurity(other_ca)) == grpc.StatusCode.UNAVAILABLE  # server not trusted


def test_stream_gate_limits_and_drains():
    with _gated(2) as (stub, gate):
        held = [stub.Generate(internal_pb2.DecodeRequest(), timeout=30) for _ in range(2)]
        for call in held:
            next(call)
        with pytest.raises(grpc.RpcError) as e:
            next(stub.Generate(internal_pb2.DecodeRequest(), timeout=5))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(e.value.trailing_metadata())["grpc-retry-pushback-ms"] == "500"
        gate.close()
        with pytest.raises(grpc.RpcError) as e:
            next(stub.Generate(internal_pb2.DecodeRequest(), timeout=5))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not gate.wait_idle(0.2)
        assert gate.end_all() == 2  # runs the servicer's callback: its wait ends, the gate sends the status
        for call in held:
            with pytest.raises(grpc.RpcError) as e:
                next(call)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and e.value.details() == "test shutting down"
        assert gate.wait_idle(5)
        wait_until(lambda: gate.active == 0)


def test_gate_releases_slots_of_cancelled_calls():
    with _gated(1) as (stub, gate):
        for _ in range(3):
            call = stub.Generate(internal_pb2.DecodeRequest(), timeout=30)
            next(call)
            call.cancel()
            wait_until(lambda: gate.active == 0, timeout=5)


def test_gate_gives_back_the_slot_of_a_call_that_ended_before_its_callback():
    """A call whose RPC ended before the gate registered its leave-callback (gRPC then runs no callback): the slot
    comes back at once instead of staying taken for good."""

    class EndedContext:  # what grpc's context does once the RPC is over: add_callback refuses
        def add_callback(self, callback) -> bool:
            return False

    gate = StreamGate("test", 1)
    gate._enter(EndedContext())  # type: ignore[arg-type]
    assert gate.active == 0
    gate._enter(EndedContext())  # type: ignore[arg-type]  # the one slot is free again: no RESOURCE_EXHAUSTED
    assert gate.active == 0 and gate.rejected == 0
