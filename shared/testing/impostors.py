"""Impostor services for a fault suite, run in the harness's own process on free loopback ports.

- `ImpostorPrefill`: answers `Prefill` streams with KV pages damaged the way `variant_of(prompt)` says (NaN / inf
  scales under a valid checksum, a flipped payload byte, sizes, indexes, identity fields or the first token wrong;
  "valid": well-formed pages, the control). Stands in for a prefill instance gone bad: put its address on the
  router's prefill list and every request the router sends it gets that page stream.
- `ImpostorDecode`: a Decode service that answers every `Generate` with tokens of its own: what an attacker's
  server registered as a decode instance would send the router's callers.
Both count the calls they get (`calls`), so a suite can tell whether anything reached them at all."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.transfer.page_format import PageFormat
from pdserve.kv.transfer.wire import batch_message_bytes, checksum, make_header
from pdserve.prefill.servicer import add_prefill_servicer
from pdserve.server.tls import TlsConfig
from pdserve.v1 import generate_pb2, internal_pb2, internal_pb2_grpc, kv_pb2

# Variants of a damaged page stream, and the status decode must answer each with (through the router: the same).
HOSTILE_VARIANTS = {
    "nan_scale": ("DATA_LOSS",),
    "inf_scale": ("DATA_LOSS",),
    "neg_inf_scale": ("DATA_LOSS",),
    "flipped_byte": ("DATA_LOSS",),
    "short_payload": ("DATA_LOSS",),
    "wrong_nbytes": ("DATA_LOSS",),
    "zero_tokens": ("DATA_LOSS",),
    "page_index_out_of_range": ("DATA_LOSS", "INVALID_ARGUMENT"),
    "wrong_fingerprint": ("DATA_LOSS",),
    "wrong_request_id": ("DATA_LOSS",),
    "wrong_layout": ("DATA_LOSS",),
    "first_token_out_of_vocab": ("DATA_LOSS",),
    "missing_pages": ("DATA_LOSS", "INVALID_ARGUMENT"),
    "garbage_message": ("DATA_LOSS",),
}
VALID = "valid"
VARIANTS = [VALID, *HOSTILE_VARIANTS]


def serve(
    add: Callable[[grpc.Server], None], tls: TlsConfig | None = None, workers: int = 8
) -> tuple[str, grpc.Server]:
    """Start a gRPC server on a free loopback port with `add(server)` and an open health service: TLS with `tls`'s
    certificate (no client certificates asked), else plaintext."""
    server = grpc.server(futures.ThreadPoolExecutor(workers))
    add(server)
    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    hs.set("", health_pb2.HealthCheckResponse.SERVING)
    if tls is not None and tls.on:
        port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(require_client_auth=False))
    else:
        port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return f"127.0.0.1:{port}", server


def kv_batch(
    req: internal_pb2.PrefillRequest,
    fmt: PageFormat,
    data: torch.Tensor,
    scales: torch.Tensor | None,
    zeros: torch.Tensor | None,
    pages: list[int],
) -> tuple[kv_pb2.KVBatchHeader, bytes]:
    """The header and payload of one KV batch answering prefill request `req` with `pages`: those rows of data /
    scales / zeros packed with `fmt`, each page holding its share of the prompt's tokens."""
    size = fmt.layout.page_size
    payload = fmt.pack(data, scales, zeros)[pages].contiguous().numpy().tobytes()
    header = make_header(
        request_id=req.request_id,
        fingerprint=req.model_fingerprint,
        layout=fmt.layout,
        first_seq_no=0,
        page_indexes=pages,
        num_tokens=[min(size, len(req.prompt_token_ids) - i * size) for i in pages],
        payload=payload,
    )
    return header, payload


class ImpostorPrefill:
    """A Prefill service sending the pages `variant_of(prompt_token_ids)` names (one of VARIANTS)."""

    def __init__(self, variant_of: Callable[[Sequence[int]], str], page_size: int):
        self.variant_of = variant_of
        self.page_size = page_size
        self.calls = 0
        self.served: dict[str, int] = {}
        self._lock = threading.Lock()

    def start(self, tls: TlsConfig | None = None) -> tuple[str, grpc.Server]:
        return serve(lambda s: add_prefill_servicer(self, s), tls)  # type: ignore[arg-type]  # the same two methods

    def Stats(self, request, context):
        return internal_pb2.InstanceStats(page_size=self.page_size, prefill_tokens_per_s=1e5)

    def Prefill(self, request_iterator, context):
        with self._lock:
            self.calls += 1
        req = next(request_iterator).request
        variant = self.variant_of(list(req.prompt_token_ids))
        with self._lock:
            self.served[variant] = self.served.get(variant, 0) + 1
        lay = KVLayoutSpec.from_proto(req.kv_layout)
        fmt = PageFormat(lay)
        n = -(-len(req.prompt_token_ids) // lay.page_size)
        g = torch.Generator().manual_seed(len(req.prompt_token_ids))
        if lay.quantized:
            data = torch.randint(-20, 20, (n, *fmt.data_shape), dtype=torch.int8, generator=g)
        else:
            data = (torch.randn((n, *fmt.data_shape), generator=g) * 0.1).to(lay.torch_dtype)
        scales = torch.full((n, *fmt.scales_shape), 0.01, dtype=torch.float16) if lay.quantized else None
        zeros = torch.zeros_like(scales) if lay.asymmetric and scales is not None else None
        bad = {"nan_scale": math.nan, "inf_scale": math.inf, "neg_inf_scale": -math.inf}.get(variant)
        if bad is not None and scales is not None:
            scales[n - 1].view(-1)[0] = bad
        pages = list(range(n - 1)) if variant == "missing_pages" and n > 1 else list(range(n))
        header, payload = _damage(variant, *kv_batch(req, fmt, data, scales, zeros, pages), lay, n)
        yield internal_pb2.PrefillServerMessage(transport=kv_pb2.KVTransportChoice(transport="grpc"))
        if variant == "garbage_message":
            yield b"\xff\xfe\x00 not a protobuf message \x01" * 4
        else:
            yield batch_message_bytes(header, payload)
        first = 10**6 if variant == "first_token_out_of_vocab" else 7
        yield internal_pb2.PrefillServerMessage(done=internal_pb2.PrefillDone(first_token_id=first, num_pages=n))


def _damage(variant: str, h: kv_pb2.KVBatchHeader, payload: bytes, lay: KVLayoutSpec, n: int):
    """The header and payload of `variant` (fields changed under a recomputed checksum unless the point is a
    checksum that does not match)."""
    if variant == "flipped_byte":
        b = bytearray(payload)
        b[len(b) // 2] ^= 0x40
        return h, bytes(b)
    if variant == "short_payload":
        return h, payload[:-1]
    if variant == "wrong_nbytes":
        h.nbytes += 1
    elif variant == "zero_tokens":
        h.num_tokens[0] = 0
    elif variant == "page_index_out_of_range":
        h.page_indexes[-1] = n + 1000
    elif variant == "wrong_fingerprint":
        h.model_fingerprint = "not-" + h.model_fingerprint
    elif variant == "wrong_request_id":
        h.request_id = h.request_id + "-other"
    elif variant == "wrong_layout":
        h.layout.page_size = lay.page_size * 2
    else:
        return h, payload
    h.checksum = checksum(h, payload)
    return h, payload


class ImpostorDecode(internal_pb2_grpc.DecodeServicer):
    """A Decode service that answers every request with `tokens` (an attacker's server, registered as decode)."""

    def __init__(self, tokens: Sequence[int] = (7, 7, 7, 7), kv_pages: int = 1 << 20):
        self.tokens = list(tokens)
        self.kv_pages = kv_pages
        self.calls = 0
        self._lock = threading.Lock()

    def start(self, tls: TlsConfig | None = None) -> tuple[str, grpc.Server]:
        return serve(lambda s: internal_pb2_grpc.add_DecodeServicer_to_server(self, s), tls)

    def Stats(self, request, context):
        return internal_pb2.InstanceStats(kv_pages_total=self.kv_pages, kv_pages_free=self.kv_pages, page_size=4)

    def Generate(self, request, context):
        with self._lock:
            self.calls += 1
        yield internal_pb2.DecodeResponse(
            token_ids=self.tokens,
            text="hijacked",
            finish_reason=generate_pb2.FINISH_REASON_LENGTH,
            usage=generate_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=len(self.tokens)),
        )
