"""A decode service taking layer groups from a scripted prefill: the request says decode accepts them, pages whose
layers all landed decode, and a prefill that dies after some layers (its RPC aborted, its stream ended, or
PrefillDone with pages half in) fails the request with the status the router fails over on (UNAVAILABLE, DATA_LOSS),
every partly filled page freed."""

from __future__ import annotations

import grpc
import pytest
import torch
from services_testutil import pool_empty, tiny_decode

from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.transfer.layers import LayerRange
from pdserve.kv.transfer.page_format import PageFormat
from pdserve.kv.transfer.wire import batch_message_bytes, make_header
from pdserve.prefill.servicer import add_prefill_servicer
from pdserve.testing.impostors import serve
from pdserve.testing.wait import wait_until
from pdserve.v1 import generate_pb2, internal_pb2, kv_pb2

PAGE, PROMPT = 4, 10  # three pages, the last partial


class LayeredPrefill:
    """Sends the transport choice, then per `script[request_id]`: "ok" layer 0 of every page, layer 1 of every page,
    PrefillDone; "abort" layer 0, then the RPC fails UNAVAILABLE; "end" layer 0, then the stream ends; "half" layer
    0, then PrefillDone counting those shipments."""

    def __init__(self):
        self.script: dict[str, str] = {}
        self.accepted: dict[str, bool] = {}

    def Prefill(self, request_iterator, context):
        req = next(request_iterator).request
        self.accepted[req.request_id] = req.kv_layer_groups
        kind = self.script[req.request_id]
        lay = KVLayoutSpec.from_proto(req.kv_layout)
        n = -(-len(req.prompt_token_ids) // lay.page_size)
        tokens = [min(lay.page_size, len(req.prompt_token_ids) - i * lay.page_size) for i in range(n)]
        yield internal_pb2.PrefillServerMessage(transport=kv_pb2.KVTransportChoice(transport="grpc"))
        seq = 0
        for layer in range(lay.num_layers if kind == "ok" else 1):
            fmt = PageFormat(lay, 1)
            data = 0.1 * torch.randn(n, *fmt.data_shape, generator=torch.Generator().manual_seed(layer))
            payload = fmt.pack(data.to(lay.torch_dtype), None, None).numpy().tobytes()
            header = make_header(
                request_id=req.request_id,
                fingerprint=req.model_fingerprint,
                layout=lay,
                first_seq_no=seq,
                page_indexes=list(range(n)),
                num_tokens=tokens,
                payload=payload,
                layers=LayerRange(layer, layer + 1),
            )
            yield batch_message_bytes(header, payload)
            seq += n
        if kind == "abort":
            context.abort(grpc.StatusCode.UNAVAILABLE, "prefill died after layer 0")
        if kind in ("ok", "half"):
            yield internal_pb2.PrefillServerMessage(done=internal_pb2.PrefillDone(first_token_id=7, num_pages=seq))

    def Stats(self, request, context):
        return internal_pb2.InstanceStats()


@pytest.fixture(scope="module")
def scripted():
    servicer = LayeredPrefill()
    addr, server = serve(lambda s: add_prefill_servicer(servicer, s))  # type: ignore[arg-type]  # Prefill, Stats
    yield addr, servicer
    server.stop(0)


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    with tiny_decode(tmp_path_factory.mktemp("decode-layers"), page_size=PAGE, kv_dtype="auto") as stub:
        yield stub


def generate(stub, target: str, rid: str) -> list[int]:
    req = internal_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=[5 + i for i in range(PROMPT)],
        prefill_target=target,
        sampling=generate_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
    )
    return [t for r in stub.Generate(req, timeout=30) for t in r.token_ids]


def test_pages_arriving_in_layer_groups_decode(decode, scripted):
    addr, servicer = scripted
    servicer.script["ok"] = "ok"
    tokens = generate(decode, addr, "ok")
    assert servicer.accepted["ok"] and tokens[0] == 7 and len(tokens) == 3
    assert wait_until(lambda: pool_empty(decode), 10)


@pytest.mark.parametrize(
    "kind, code, reason",
    [
        ("abort", grpc.StatusCode.UNAVAILABLE, "prefill died after layer 0"),
        ("end", grpc.StatusCode.UNAVAILABLE, "ended without finishing"),
        ("half", grpc.StatusCode.DATA_LOSS, "pages missing"),
    ],
)
def test_prefill_dying_after_some_layers_fails_cleanly_and_frees_the_pages(decode, scripted, kind, code, reason):
    addr, servicer = scripted
    servicer.script[kind] = kind
    with pytest.raises(grpc.RpcError) as err:
        generate(decode, addr, kind)
    assert err.value.code() == code and reason in err.value.details(), err.value.details()
    assert wait_until(lambda: pool_empty(decode), 10)  # the partly filled pages too
