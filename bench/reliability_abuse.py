"""The abuse half of bench/reliability.py: calls a hostile or clumsy party makes (anonymous internal RPCs, a bogus
registration, a prefill sending damaged KV pages, oversized and malformed requests). Each scenario takes the suite
(`reliability.Suite`) and returns a `pdserve.testing.stream_audit.Result`."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import grpc

from pdserve.server.grpc_util import CHANNEL_OPTIONS
from pdserve.server.security import ChannelSecurity
from pdserve.server.tls import TlsConfig
from pdserve.testing.fault_stack import FaultStack
from pdserve.testing.impostors import HOSTILE_VARIANTS, VALID, VARIANTS, ImpostorDecode, ImpostorPrefill
from pdserve.testing.stream_audit import Result, Tally, status_name, stream_once, token_request
from pdserve.v1 import (
    generate_pb2,
    generate_pb2_grpc,
    internal_pb2,
    internal_pb2_grpc,
    kv_pb2,
    router_admin_pb2,
    router_admin_pb2_grpc,
)

REFUSED = ["UNAUTHENTICATED", "PERMISSION_DENIED", "UNIMPLEMENTED"]
TOO_BIG = ["INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"]
VOCAB, PAGE = 512, 4


def _call(fn) -> tuple[str, str]:
    """Run one blocking call; ("OK", "") when it was served (a stream: it sent anything or ended cleanly)."""
    try:
        out = fn()
        if hasattr(out, "__next__"):
            for _ in out:
                break
            out.cancel()
        return "OK", ""
    except grpc.RpcError as e:
        return status_name(e), e.details() or ""


def _layout(model_dir, kv_dtype: str) -> kv_pb2.KVLayout:
    cfg = json.loads((model_dir / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dtype = kv_pb2.KV_DTYPE_INT8 if kv_dtype == "int8" else kv_pb2.KV_DTYPE_FLOAT32
    return kv_pb2.KVLayout(
        format_version=1,
        dtype=dtype,
        page_size=PAGE,
        num_layers=cfg["num_hidden_layers"],
        num_kv_heads=kv_heads,
        head_dim=cfg["hidden_size"] // heads,
        group_size=64 if kv_dtype == "int8" else 0,
    )


def _internal_calls(suite, impostor: str) -> list[tuple[str, str, object]]:
    """(label, address, call(channel)) for every internal RPC on every port of the stack, the public one included."""
    st = suite.stack
    rid = "anon-" + os.urandom(4).hex()
    prompt = [5 + i for i in range(12)]
    s = generate_pb2.SamplingParams(max_tokens=4, temperature=0.0)
    stats = internal_pb2.StatsRequest()
    out = []
    for a in st.prefill:
        msg = internal_pb2.PrefillClientMessage(
            request=internal_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=s, kv_layout=_layout(suite.model, "auto")
            )
        )
        out.append(
            ("Prefill.Prefill", a, lambda ch, m=msg: internal_pb2_grpc.PrefillStub(ch).Prefill(iter([m]), timeout=10))
        )
        out.append(("Prefill.Stats", a, lambda ch: internal_pb2_grpc.PrefillStub(ch).Stats(stats, timeout=10)))
    dreq = internal_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=s, prefill_target=impostor)
    for a in st.decode:
        out.append(("Decode.Generate", a, lambda ch: internal_pb2_grpc.DecodeStub(ch).Generate(dreq, timeout=10)))
        out.append(("Decode.Stats", a, lambda ch: internal_pb2_grpc.DecodeStub(ch).Stats(stats, timeout=10)))
    pb, role = router_admin_pb2, router_admin_pb2.INSTANCE_ROLE_DECODE
    registry = [
        ("Register", pb.RegisterRequest(role=role, address=impostor)),
        ("Heartbeat", pb.HeartbeatRequest(role=role, address=impostor)),
        ("Deregister", pb.DeregisterRequest(role=role, address=st.decode[0])),
        ("ListInstances", pb.ListInstancesRequest()),
    ]
    for a in sorted({st.registry_address(), st.router}):
        for method, msg in registry:
            out.append((f"Registry.{method}", a, _registry_call(method, msg)))
        if a == st.router and a != st.registry_address():  # the internal services on the public port
            out.append(("Decode.Stats@public", a, lambda ch: internal_pb2_grpc.DecodeStub(ch).Stats(stats, timeout=10)))
            out.append(
                ("Prefill.Stats@public", a, lambda ch: internal_pb2_grpc.PrefillStub(ch).Stats(stats, timeout=10))
            )
    return out


def _registry_call(method: str, msg):
    return lambda ch: getattr(router_admin_pb2_grpc.RegistryStub(ch), method)(msg, timeout=10)


def _anonymous_channels(suite) -> dict[str, ChannelSecurity]:
    """The ways an outsider calls: plaintext without identity or with a guessed token; with TLS on, also TLS without
    a client certificate, and with a well-formed certificate from another CA."""
    wrong = "wrong-" + os.urandom(12).hex()
    tls = suite.identity.tls
    if not tls.on:
        return {"no identity": ChannelSecurity.anonymous(), "wrong token": ChannelSecurity(token=wrong)}
    from pdserve.testing.certs import CertAuthority

    rogue = CertAuthority.create(suite.work / "rogue-pki").issue("intruder")
    return {
        "plaintext": ChannelSecurity.anonymous(),
        "TLS, no client certificate": ChannelSecurity(TlsConfig(ca=tls.ca)),
        "TLS, no client certificate, wrong token": ChannelSecurity(TlsConfig(ca=tls.ca), token=wrong),
        "TLS, certificate from another CA": ChannelSecurity(TlsConfig(rogue.cert, rogue.key, tls.ca)),
    }


def _refused(suite) -> list[str]:
    """Refusals: a missing or wrong identity; the service not served on that port; with TLS on, the handshake
    itself refused (UNAVAILABLE on a port that, as the insider calls show, is up)."""
    return [*REFUSED, "UNAVAILABLE"] if suite.identity.tls.on else REFUSED


async def anonymous_internal(suite) -> Result:
    """Every internal RPC (Prefill, Decode, Registry) on every port, without the internal identity and with a wrong
    token: each must be refused (UNAUTHENTICATED / PERMISSION_DENIED, or UNIMPLEMENTED where the service is not
    served), and nothing may reach the impostor prefill a decode was told to dial."""
    impostor = ImpostorPrefill(lambda p: VALID, PAGE)
    addr, server = impostor.start()
    tally, extras = Tally(), {"calls": []}
    try:
        calls = _internal_calls(suite, addr)
        for variant, sec in _anonymous_channels(suite).items():
            for label, target, fn in calls:
                with sec.open(target, CHANNEL_OPTIONS) as ch:
                    code, details = await asyncio.to_thread(_call, lambda: fn(ch))
                tally.refusal(code, _refused(suite), label=f"{label} on {target} ({variant})", details=details)
                extras["calls"].append(f"{label} ({variant}): {code}")
        insider = {}
        for label, target, fn in calls:  # the same calls as an insider, read-only ones only: the ports do serve
            registry_here = not label.startswith("Registry") or target == suite.stack.registry_address()
            read_only = label.endswith("Stats") or label.endswith("ListInstances")
            if read_only and registry_here and "@public" not in label:
                insider[f"{label} on {target}"] = (
                    await asyncio.to_thread(_call, lambda: fn(suite.stack.channel_for(target)))
                )[0]
        states = await asyncio.to_thread(suite.stack.states)
    finally:
        server.stop(0)
    extras.update(insider_calls=insider, impostor_prefill_calls=impostor.calls, instances_after=states)
    suite.leaked(tally, extras)
    checks = {
        "every anonymous call refused": tally.completed == 0,
        "decode never dialled the caller's prefill target": impostor.calls == 0,
        "insider calls served (the ports are up)": all(c == "OK" for c in insider.values()),
        "no impostor in the router's table, every instance still up": _all_up(states, suite.stack),
    }  # fmt: skip
    return Result(tally, {"anonymous internal call": _refused(suite)}, extras, checks=checks)


def _all_up(states: dict[str, str], st: FaultStack) -> bool:
    return set(states) == set(st.prefill + st.decode) and all(v == "up" for v in states.values())


async def bogus_registration(suite) -> Result:
    """Anonymous Register of an impostor decode and prefill and Deregister of the real instances, on the router's
    public and internal ports; then prompts through the router: none may reach an impostor, all must be exact."""
    st = suite.stack
    dec, pre = ImpostorDecode(), ImpostorPrefill(lambda p: VALID, PAGE)
    (dec_addr, dec_server), (pre_addr, pre_server) = dec.start(), pre.start()
    pb, tally, extras = router_admin_pb2, Tally(), {}
    try:
        reqs = [pb.RegisterRequest(role=pb.INSTANCE_ROLE_DECODE, address=dec_addr)]
        reqs += [pb.RegisterRequest(role=pb.INSTANCE_ROLE_PREFILL, address=pre_addr)]
        beats = [pb.HeartbeatRequest(role=pb.INSTANCE_ROLE_DECODE, address=dec_addr)]
        dereg = [pb.DeregisterRequest(role=pb.INSTANCE_ROLE_DECODE, address=a) for a in st.decode]
        dereg += [pb.DeregisterRequest(role=pb.INSTANCE_ROLE_PREFILL, address=a) for a in st.prefill]
        for variant, sec in _anonymous_channels(suite).items():
            for target in sorted({st.registry_address(), st.router}):
                with sec.open(target, CHANNEL_OPTIONS) as ch:
                    stub = router_admin_pb2_grpc.RegistryStub(ch)
                    for _rounds in range(suite.count(5, 1)):
                        for label, fn, msgs in (("Register", stub.Register, reqs), ("Heartbeat", stub.Heartbeat, beats),
                                                ("Deregister", stub.Deregister, dereg)):  # fmt: skip
                            for m in msgs:
                                code, details = await asyncio.to_thread(_call, lambda: fn(m, timeout=10))
                                tally.refusal(
                                    code, _refused(suite), label=f"{label} on {target} ({variant})", details=details
                                )
        prompts = suite.prompts("bogus", suite.count(40, 4), 16, 40)
        refs = await suite.reference(prompts, 16)
        outs = await suite.run_all([token_request(p, 16) for p in prompts], 8)
        for i, o in enumerate(outs):
            tally.add(o, ["OK"], refs[i], must_complete=True, label=f"prompt {i}")
        states = await asyncio.to_thread(st.states)
    finally:
        dec_server.stop(0)
        pre_server.stop(0)
    extras.update(impostor_decode_calls=dec.calls, impostor_prefill_calls=pre.calls, instances_after=states)
    suite.leaked(tally, extras)
    checks = {
        "no prompt reached an impostor": dec.calls == 0 and pre.calls == 0,
        "router table unchanged, all up": _all_up(states, st),
    }  # fmt: skip
    return Result(tally, {"registry call": _refused(suite), "prompt": ["OK"]}, extras, checks=checks)


async def hostile_kv(suite) -> Result:
    """A prefill instance gone bad: the router's only prefill is an impostor that answers each request with KV
    pages damaged one way (NaN / inf scales, flipped byte, sizes, indexes, identity fields, out-of-vocab first
    token, missing pages, garbage). Decode (int8 pool) must refuse each with its status, send no token, free every
    page; the impostor's well-formed pages ("valid", the control) must generate."""
    per = suite.count(8, 1)
    impostor = ImpostorPrefill(lambda p: VARIANTS[p[0] - 100] if 100 <= p[0] < 100 + len(VARIANTS) else VALID, PAGE)
    addr, server = impostor.start(suite.identity.tls)  # a prefill gone bad: it holds the stack's certificate
    stack = FaultStack(
        suite.model,
        suite.work / "hostile",
        prefill=0,
        decode=1,
        engine_args=[a if a != "auto" else "int8" for a in suite.engine_args],
        router_args=["--auth-tokens-file", str(suite.work / "auth-tokens.json")],
        extra_prefill=[addr],
        identity=suite.identity,
    )
    tally, extras = Tally(), {}
    try:
        await asyncio.to_thread(stack.start)
        rng = random.Random("hostile")
        plan = [(v, [100 + VARIANTS.index(v)] + [rng.randrange(5, VOCAB) for _ in range(rng.randrange(9, 24))])
                for v in VARIANTS for _ in range(per)]  # fmt: skip
        async with suite.identity.public_channel(stack.router) as ch:
            stub, sem = generate_pb2_grpc.GenerationStub(ch), asyncio.Semaphore(8)

            async def one(p):
                async with sem:
                    return await stream_once(stub, token_request(p, 8), metadata=suite.metadata(), timeout=60)

            outs = await asyncio.gather(*(one(p) for _, p in plan))
        for (v, _), o in zip(plan, outs):
            if v == VALID:
                tally.add(o, ["OK"], None, must_complete=True, label=v)
            else:  # any token delivered is a garbage token
                tally.add(o, list(HOSTILE_VARIANTS[v]), None, must_complete=False, label=v)
                tally.no_tokens(o, v)
        by_variant: dict[str, dict[str, int]] = {}
        for (v, _), o in zip(plan, outs):
            by_variant.setdefault(v, {}).setdefault(o.code, 0)
            by_variant[v][o.code] += 1
        used = await asyncio.to_thread(stack.wait_drained, 30)
        tally.leaked_pages = sum(p for p, _ in used.values())
        extras.update(
            by_variant=by_variant,
            impostor_served=dict(impostor.served),
            leaked_requests=sum(r for _, r in used.values()),
        )
    finally:
        await asyncio.to_thread(stack.stop)
        server.stop(0)
    return Result(
        tally,
        {"valid pages (control)": ["OK"], **{v: list(c) for v, c in HOSTILE_VARIANTS.items()}},
        extras,
        exercised=sum(impostor.served.values()) >= len(plan),
    )


def _raw_call(st: FaultStack, address: str, method: str, body: bytes, unary: bool = False):
    """A call of `method` with `body` as the serialized request, over the stack's insider channel."""
    ch = st.channel_for(address)
    ident = lambda b: b
    if unary:
        return lambda: ch.unary_unary(method, request_serializer=ident, response_deserializer=ident)(body, timeout=30)
    return lambda: ch.unary_stream(method, request_serializer=ident, response_deserializer=ident)(body, timeout=30)


def _oversized(suite) -> list[tuple[str, object, list[str]]]:
    """(name, request or raw call, allowed statuses): public requests far over the limits, and insider messages
    over the internal ports' size limits."""
    mb = 1 << 20
    s = lambda **kw: generate_pb2.SamplingParams(max_tokens=4, temperature=0.0, **kw)
    G = generate_pb2.GenerateRequest
    cases: list[tuple[str, object, list[str]]] = [
        ("prompt 10 MB", G(prompt="a" * (10 * mb), sampling=s()), TOO_BIG),
        ("prompt 10 MB of 3-byte characters", G(prompt="€" * (10 * mb // 3), sampling=s()), TOO_BIG),
        ("100k stop strings", G(prompt="hi", sampling=s(stop=["ab"] * 100_000)), TOO_BIG),
        ("one 1 MB stop string", G(prompt="hi", sampling=s(stop=["x" * mb])), TOO_BIG),
        ("100k stop_token_ids", G(prompt="hi", sampling=s(stop_token_ids=[5] * 100_000)), TOO_BIG),
        ("1M prompt token ids", G(token_ids=generate_pb2.TokenIds(ids=[5] * 1_000_000), sampling=s()), TOO_BIG),
        ("100k chat messages", G(messages=[generate_pb2.ChatMessage(role="user", content="hi")] * 100_000), TOO_BIG),
        ("request_id 1 MB", G(request_id="r" * mb, prompt="hi", sampling=s()), TOO_BIG),
        ("message 100 MB", G(prompt="a" * (100 * mb), sampling=s()), TOO_BIG),
    ]  # fmt: skip
    st = suite.stack
    # an 80 MB DecodeRequest (request_id, then 80M packed token ids of one byte each), built as bytes
    big = _field(1, b"big") + _field(2, b"\x05" * (80 * mb))
    reg = router_admin_pb2.RegisterRequest(role=router_admin_pb2.INSTANCE_ROLE_DECODE, address="h" * (16 * mb))
    decode_call = _raw_call(st, st.decode[0], "/pdserve.v1.Decode/Generate", big)
    registry_call = _raw_call(st, st.registry_address(), "/pdserve.v1.Registry/Register", reg.SerializeToString(), True)
    cases += [
        ("decode: 80 MB DecodeRequest (insider)", decode_call, TOO_BIG),
        ("registry: 16 MB Register (insider)", registry_call, TOO_BIG),
    ]
    return cases


async def oversized_inputs(suite) -> Result:
    """Requests far over every limit (10 MB prompts, 100k stop strings, 1M token ids, 100 MB messages, ...), each
    repeated, while exact control streams run: each refused at once, the controls unharmed."""
    reps = suite.count(3, 1)
    prompts = suite.prompts("oversized-control", 8, 16, 40)
    refs = await suite.reference(prompts, 96)
    tally, extras = Tally(), {"seconds_to_refuse": {}}
    router_rss0 = suite.stack.rss_mb().get(f"router@{suite.stack.router}")
    controls = asyncio.create_task(suite.run_all([token_request(p, 96) for p in prompts], 8, timeout=180))
    for name, req, allowed in _oversized(suite):
        for _ in range(reps):
            t0 = time.monotonic()
            if isinstance(req, generate_pb2.GenerateRequest):
                o = await suite.stream(req, retry=False, timeout=60)
                code, details, n = o.code, o.details, len(o.tokens)
            else:
                (code, details), n = await asyncio.to_thread(_call, req), 0
            dt = time.monotonic() - t0
            extras["seconds_to_refuse"][name] = round(max(dt, extras["seconds_to_refuse"].get(name, 0.0)), 3)
            tally.refusal(code, allowed, label=name, details=details)
            if n:
                tally.no_tokens(o, name)
    for i, o in enumerate(await controls):
        tally.add(o, ["OK"], refs[i], must_complete=True, label=f"control {i}")
    extras["router_rss_mb"] = [router_rss0, suite.stack.rss_mb().get(f"router@{suite.stack.router}")]
    suite.leaked(tally, extras)
    slowest = max(extras["seconds_to_refuse"].values())
    extras["slowest_refusal_s"] = slowest
    return Result(
        tally,
        {"oversized": TOO_BIG, "control": ["OK"]},
        extras,
        checks={"every refusal within 2 s": slowest < 2.0},
    )


def _field(num: int, data: bytes) -> bytes:
    """One length-delimited protobuf field (tag, varint length, bytes)."""
    n, out = len(data), bytearray([(num << 3) | 2])
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out) + data


def _raw_generate(prompt_bytes: bytes) -> bytes:
    """A GenerateRequest whose `prompt` holds `prompt_bytes` as they are (invalid UTF-8 cannot be built otherwise)."""
    s = generate_pb2.SamplingParams(max_tokens=4, temperature=0.0).SerializeToString()
    return _field(2, prompt_bytes) + _field(4, s)


async def malformed_inputs(suite) -> Result:
    """Malformed public requests (unknown priority, invalid UTF-8, token ids outside the vocabulary, no input,
    out-of-range sampling values): each INVALID_ARGUMENT with no token generated."""
    G, S = generate_pb2.GenerateRequest, generate_pb2.SamplingParams
    ids = lambda xs: generate_pb2.TokenIds(ids=xs)
    cases = [
        ("unknown priority", G(prompt="hi", priority=99, sampling=S(max_tokens=4))),
        ("token id -1", G(token_ids=ids([5, -1]), sampling=S(max_tokens=4))),
        ("token id 10^6", G(token_ids=ids([5, 10**6]), sampling=S(max_tokens=4))),
        ("empty token ids", G(token_ids=ids([]), sampling=S(max_tokens=4))),
        ("no input", G(sampling=S(max_tokens=4))),
        ("temperature NaN", G(prompt="hi", sampling=S(max_tokens=4, temperature=float("nan")))),
        ("temperature -1", G(prompt="hi", sampling=S(max_tokens=4, temperature=-1.0))),
        ("top_p 1.5", G(prompt="hi", sampling=S(max_tokens=4, top_p=1.5))),
        ("top_k -1", G(prompt="hi", sampling=S(max_tokens=4, top_k=-1))),
        ("max_tokens 0", G(prompt="hi", sampling=S(max_tokens=0))),
        ("max_tokens -5", G(prompt="hi", sampling=S(max_tokens=-5))),
        ("top_logprobs 50", G(prompt="hi", sampling=S(max_tokens=4, top_logprobs=50))),
        ("unknown chat role", G(messages=[generate_pb2.ChatMessage(role="wizard", content="hi")])),
    ]  # fmt: skip
    tally, extras = Tally(), {"statuses_by_case": {}}
    reps = suite.count(4, 1)
    for name, req in cases:
        for _ in range(reps):
            o = await suite.stream(req, retry=False, timeout=30)
            tally.refusal(o.code, ["INVALID_ARGUMENT"], label=name, details=o.details)
            tally.no_tokens(o, name)
            extras["statuses_by_case"][name] = o.code
    raw = suite.channel.unary_stream(
        "/pdserve.v1.Generation/GenerateStream", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    for _ in range(reps):
        try:
            call = raw(_raw_generate(b"\xff\xfe bad utf-8 \xc3\x28"), metadata=suite.metadata(), timeout=30)
            _ = [m async for m in call]
            code, details = "OK", ""
        except grpc.RpcError as e:
            code, details = status_name(e), e.details() or ""
        tally.refusal(code, ["INVALID_ARGUMENT"], label="invalid UTF-8 prompt", details=details)
        extras["statuses_by_case"]["invalid UTF-8 prompt"] = code
    suite.leaked(tally, extras)
    return Result(tally, {"malformed": ["INVALID_ARGUMENT"]}, extras)


ABUSE_SCENARIOS = {
    "anonymous_internal": anonymous_internal,
    "bogus_registration": bogus_registration,
    "hostile_kv": hostile_kv,
    "oversized_inputs": oversized_inputs,
    "malformed_inputs": malformed_inputs,
}
