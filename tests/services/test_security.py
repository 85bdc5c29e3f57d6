"""Trust boundaries over real processes (issue 13, part 1 and the message size of part 4; docs/security.md).

Two stacks of the tiny model: a plaintext loopback one (internal token only, as `pdserve up` runs by default) and a
TLS one (mTLS between router, prefill and decode with a private CA, plus the token; the gateway dials the router
over TLS). Both authenticate the public API with bearer tokens. Checked: generation end to end through TLS; every
internal RPC (Prefill, Decode, the Registry) refuses callers without the internal identity, and a forged one;
the public port refuses missing / unknown bearer tokens and does not serve the Registry; an oversized message is
refused at once; unsafe configurations refuse to start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from services_testutil import tiny_stack

import pdserve
from pdserve.models.checkpoints import build_checkpoint
from pdserve.server.grpc_util import channel
from pdserve.server.security import ChannelSecurity
from pdserve.server.tls import TlsConfig
from pdserve.testing.certs import CertAuthority
from pdserve.v1 import generate_pb2, generate_pb2_grpc, internal_pb2, internal_pb2_grpc, router_admin_pb2_grpc
from pdserve.v1 import router_admin_pb2 as admin_pb2

TOKENS = {"tok-alpha-0123456789abcdef": "alpha", "tok-beta-0123456789abcdef0": "beta"}
ALPHA = "tok-alpha-0123456789abcdef"
FORGED = "forged-token-0123456789abcdef"
RPCS = [
    *("Prefill.Stats", "Prefill.Prefill", "Prefill.Start", "Decode.Stats", "Decode.Generate"),
    *("Registry.Register", "Registry.Deregister", "Registry.ListInstances"),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("security") / "ckpt", arch="llama", seed=7)


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("auth") / "tokens"
    p.write_text("# token tenant\n" + "".join(f"{t} {tenant}\n" for t, tenant in TOKENS.items()))
    return p


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    ca = CertAuthority.create(tmp_path_factory.mktemp("pki"))
    rogue = CertAuthority.create(tmp_path_factory.mktemp("rogue"), name="rogue CA")
    return ca, ca.issue("stack"), rogue.issue("intruder")


@pytest.fixture(scope="module")
def plain_stack(model, tmp_path_factory, tokens_file):
    with tiny_stack(
        model, tmp_path_factory.mktemp("plain"), kv_dtype="auto", router_extra=["--auth-tokens-file", str(tokens_file)]
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def tls_stack(model, tmp_path_factory, tokens_file, pki):
    _, tls, _ = pki
    flags = ["--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca]
    with tiny_stack(
        model,
        tmp_path_factory.mktemp("tls"),
        kv_dtype="auto",
        extra=flags,
        router_extra=[*flags, "--auth-tokens-file", str(tokens_file)],
        gateway_port=0,
        gateway_extra=["--tls-ca", tls.ca],
        model_name="m",
    ) as stack:
        yield stack


def _generate(client: pdserve.Client) -> list[int]:
    return client.generate(prompt="hello there", max_tokens=6, temperature=0, ignore_eos=True).token_ids


def test_tls_stack_generates_what_the_plaintext_stack_does(plain_stack, tls_stack, pki):
    _, tls, _ = pki
    with pdserve.Client(plain_stack.router, token=ALPHA, timeout=60) as c:
        want = _generate(c)
    with pdserve.Client(tls_stack.router, token=ALPHA, tls_ca=tls.ca, timeout=60) as c:
        assert _generate(c) == want and len(want) == 6
    with pdserve.Client(tls_stack.router, token=ALPHA, timeout=10, retry=False) as c:  # plaintext to a TLS port
        with pytest.raises(grpc.RpcError) as e:
            _generate(c)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


# ---- internal RPCs ------------------------------------------------------------------------------------------------
def _calls(stack) -> dict[str, tuple[str, Callable[[grpc.Channel], object]]]:
    """Every internal RPC: (target address, call through a channel)."""
    stats = internal_pb2.StatsRequest()
    prefill_msg = internal_pb2.PrefillClientMessage(
        request=internal_pb2.PrefillRequest(request_id="intruder", prompt_token_ids=[5, 6, 7])
    )
    decode_req = internal_pb2.DecodeRequest(
        request_id="intruder",
        prompt_token_ids=[5, 6, 7],
        prefill_target="127.0.0.1:1",  # the attack: decode dialing a target the caller names
        sampling=generate_pb2.SamplingParams(max_tokens=2),
    )
    start = internal_pb2.PrefillStart(request_id="intruder", prompt_token_ids=[5, 6, 7], start_key=b"k" * 16)
    reg = router_admin_pb2_grpc.RegistryStub
    bogus = admin_pb2.RegisterRequest(role=admin_pb2.INSTANCE_ROLE_DECODE, address="127.0.0.1:9")
    real_decode = admin_pb2.DeregisterRequest(role=admin_pb2.INSTANCE_ROLE_DECODE, address=stack.decode[0])
    p, d, r = stack.prefill[0], stack.decode[0], stack.router.internal
    return {
        "Prefill.Stats": (p, lambda ch: internal_pb2_grpc.PrefillStub(ch).Stats(stats, timeout=5)),
        "Prefill.Prefill": (
            p,
            lambda ch: list(internal_pb2_grpc.PrefillStub(ch).Prefill(iter([prefill_msg]), timeout=5)),
        ),
        "Prefill.Start": (p, lambda ch: internal_pb2_grpc.PrefillStub(ch).Start(start, timeout=5)),
        "Decode.Stats": (d, lambda ch: internal_pb2_grpc.DecodeStub(ch).Stats(stats, timeout=5)),
        "Decode.Generate": (d, lambda ch: list(internal_pb2_grpc.DecodeStub(ch).Generate(decode_req, timeout=5))),
        "Registry.Register": (r, lambda ch: reg(ch).Register(bogus, timeout=5)),
        "Registry.Deregister": (r, lambda ch: reg(ch).Deregister(real_decode, timeout=5)),
        "Registry.ListInstances": (r, lambda ch: reg(ch).ListInstances(admin_pb2.ListInstancesRequest(), timeout=5)),
    }


def _refused(target: str, security: ChannelSecurity, call, want: grpc.StatusCode) -> str:
    with channel(target, security) as ch, pytest.raises(grpc.RpcError) as e:
        t0 = time.monotonic()
        call(ch)
    assert e.value.code() == want, (e.value.code(), e.value.details())
    assert time.monotonic() - t0 < 5
    return e.value.details()


def _stack_intact(stack, security: ChannelSecurity | None = None) -> None:
    """The bogus registration is absent and the real decode still registered: nothing an intruder sent took."""
    with channel(stack.router.internal, security) as ch:
        listing = router_admin_pb2_grpc.RegistryStub(ch).ListInstances(admin_pb2.ListInstancesRequest(), timeout=5)
    addrs = {i.address: i.state for i in listing.instances}
    assert "127.0.0.1:9" not in addrs and addrs[stack.decode[0]] == "up" and addrs[stack.prefill[0]] == "up"


@pytest.mark.parametrize("rpc", RPCS)
def test_plaintext_stack_refuses_internal_calls_without_the_token(plain_stack, rpc):
    target, call = _calls(plain_stack)[rpc]
    details = _refused(target, ChannelSecurity.anonymous(), call, grpc.StatusCode.UNAUTHENTICATED)
    assert "internal token" in details
    assert _refused(target, ChannelSecurity(token=FORGED), call, grpc.StatusCode.PERMISSION_DENIED)
    _stack_intact(plain_stack)


@pytest.mark.parametrize("rpc", RPCS)
def test_tls_stack_refuses_internal_calls_without_the_identity(tls_stack, pki, rpc):
    ca, tls, rogue = pki
    token = tls_stack.internal_token
    target, call = _calls(tls_stack)[rpc]
    no_cert = ChannelSecurity(TlsConfig(ca=tls.ca), token)  # the right token, but no client certificate
    _refused(target, no_cert, call, grpc.StatusCode.UNAVAILABLE)  # the TLS handshake fails
    forged_cert = ChannelSecurity(TlsConfig(rogue.cert, rogue.key, tls.ca), token)  # a certificate of another CA
    _refused(target, forged_cert, call, grpc.StatusCode.UNAVAILABLE)
    _refused(target, ChannelSecurity(), call, grpc.StatusCode.UNAVAILABLE)  # plaintext to a TLS port
    _refused(target, ChannelSecurity(tls), call, grpc.StatusCode.UNAUTHENTICATED)  # certificate, no token
    _refused(target, ChannelSecurity(tls, FORGED), call, grpc.StatusCode.PERMISSION_DENIED)
    _stack_intact(tls_stack, ChannelSecurity(tls, token))


def test_internal_identity_is_accepted(tls_stack, pki):
    _, tls, _ = pki
    ok = ChannelSecurity(tls, tls_stack.internal_token)
    calls = _calls(tls_stack)
    for rpc in ("Prefill.Stats", "Decode.Stats", "Registry.ListInstances"):
        target, call = calls[rpc]
        with channel(target, ok) as ch:
            call(ch)


# ---- the public port --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["plain", "tls"])
def test_public_port_needs_a_known_bearer_token(which, plain_stack, tls_stack, pki):
    _, tls, _ = pki
    stack = plain_stack if which == "plain" else tls_stack
    kw = {"tls_ca": tls.ca} if which == "tls" else {}
    for token, code in ((None, grpc.StatusCode.UNAUTHENTICATED), (FORGED, grpc.StatusCode.PERMISSION_DENIED)):
        with pdserve.Client(stack.router, token=token, timeout=10, retry=False, **kw) as c:
            with pytest.raises(grpc.RpcError) as e:
                _generate(c)
            assert e.value.code() == code, e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                list(c.stream(prompt="hi", max_tokens=2))
            assert e.value.code() == code
    creds = grpc.ssl_channel_credentials(Path(tls.ca).read_bytes()) if which == "tls" else None
    ch = grpc.secure_channel(stack.router, creds) if creds else grpc.insecure_channel(stack.router)
    with ch:  # the Registry is not served on the public port, whatever the caller presents
        with pytest.raises(grpc.RpcError) as e:
            router_admin_pb2_grpc.RegistryStub(ch).ListInstances(
                admin_pb2.ListInstancesRequest(),
                timeout=5,
                metadata=[("x-pdserve-internal-token", stack.internal_token)],
            )
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _http(url: str, body: dict | None = None, token: str | None = None) -> int:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_gateway_forwards_bearer_tokens_over_tls(tls_stack):
    url = f"http://{tls_stack.gateway}/v1/completions"
    body = {"model": "m", "prompt": "hello", "max_tokens": 2}
    assert _http(url, body) == 401
    assert _http(url, body, FORGED) == 403
    assert _http(url, body, ALPHA) == 200
    assert _http(f"http://{tls_stack.gateway}/ready") == 200  # its health channel to the router is TLS too


def test_oversized_message_is_refused_at_once(plain_stack):
    """The public port takes at most --max-receive-mb (4 MiB): larger fails RESOURCE_EXHAUSTED before parsing,
    and the SDK does not retry it (no pushback)."""
    prompt = "a" * (5 << 20)
    with pdserve.Client(plain_stack.router, token=ALPHA, timeout=30) as c:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            c.generate(prompt=prompt, max_tokens=2)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - t0 < 3 and c.retries == 0
    with grpc.insecure_channel(plain_stack.router) as ch:  # also without a token: refused before authentication
        with pytest.raises(grpc.RpcError) as e:
            generate_pb2_grpc.GenerationStub(ch).Generate(generate_pb2.GenerateRequest(prompt=prompt), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


# ---- unsafe configurations ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "service, flags, env, reason",
    [
        ("decode", ["--host", "0.0.0.0"], {"PDSERVE_INTERNAL_TOKEN": FORGED}, "non-loopback"),
        ("prefill", ["--host", "0.0.0.0"], {"PDSERVE_INTERNAL_TOKEN": FORGED}, "non-loopback"),
        ("router", ["--host", "0.0.0.0"], {"PDSERVE_INTERNAL_TOKEN": FORGED}, "non-loopback"),
        ("gateway", ["--host", "0.0.0.0", "--router", "127.0.0.1:1"], {}, "non-loopback"),
        ("decode", [], {}, "internal identity"),  # loopback, but anyone could call it
        ("router", [], {}, "internal identity"),
    ],
)
def test_unsafe_configurations_refuse_to_start(model, service, flags, env, reason):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_INTERNAL_TOKEN", "PDSERVE_TLS_"))}
    args = [] if service == "gateway" else ["--model", str(model)]
    res = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", service, *args, *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **env},
    )
    assert res.returncode != 0 and reason in res.stderr, res.stderr[-2000:]
