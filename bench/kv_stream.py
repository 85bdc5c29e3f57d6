"""KV page stream throughput over loopback gRPC vs a plain memcpy, measured in the same run.

    python bench/kv_stream.py [--pages 256] [--layers 32 --kv-heads 8 --head-dim 128 --page-size 16]

A real gRPC server streams encoded KVPage messages (the Prefill RPC's wire format, checksums included) to a
client that verifies and decodes every page (pdserve.kv.codec.decode_page), as decode does. Default shape:
one Llama-3-8B int8 page (all 32 layers) ≈ 1.06 MB per message.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.kv.codec import KVLayoutSpec, decode_page, encode_page
from pdserve.kv.payload import PagePayload, quantize_payload
from pdserve.server.grpc_util import bind, channel, make_server
from pdserve.v1 import internal_pb2, internal_pb2_grpc


class StreamingPrefill(internal_pb2_grpc.PrefillServicer):
    def __init__(self, messages):
        self.messages = messages

    def Prefill(self, request_iterator, context):
        next(request_iterator)
        for m in self.messages:
            yield internal_pb2.PrefillServerMessage(page=m)
        yield internal_pb2.PrefillServerMessage(done=internal_pb2.PrefillDone(num_pages=len(self.messages)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    shape = (2, args.layers, args.page_size, args.kv_heads, args.head_dim)
    rows = []
    for dtype in ("int8", "bfloat16"):
        layout = KVLayoutSpec(
            dtype=dtype,
            page_size=args.page_size,
            num_layers=args.layers,
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            group_size=64 if dtype == "int8" else 0,
        )
        dense = PagePayload(0, args.page_size, 0, torch.randn(shape).to(torch.bfloat16), None, None)
        msgs = []
        for i in range(args.pages):
            p = quantize_payload(dense, 64, False) if dtype == "int8" else dense
            p.page_index = i
            msgs.append(encode_page(p, request_id="bench", seq_no=i, layout=layout, fingerprint="f"))
        page_bytes = len(msgs[0].data) + len(msgs[0].scales) + len(msgs[0].zero_points)
        server = make_server(4, 16)
        internal_pb2_grpc.add_PrefillServicer_to_server(StreamingPrefill(msgs), server)
        port = bind(server, "127.0.0.1", 0)
        server.start()
        times = []
        with channel(f"127.0.0.1:{port}") as ch:
            stub = internal_pb2_grpc.PrefillStub(ch)
            for _ in range(args.repeats + 1):
                t0 = time.perf_counter()
                for msg in stub.Prefill(
                    iter([internal_pb2.PrefillClientMessage(request=internal_pb2.PrefillRequest(request_id="bench"))])
                ):
                    if msg.HasField("page"):
                        decode_page(
                            msg.page, expected_layout=layout, expected_fingerprint="f", expected_request_id="bench"
                        )
                times.append(time.perf_counter() - t0)
        server.stop(0)
        med = statistics.median(times[1:])
        rows.append((f"gRPC stream + verify/decode ({dtype} pages)", page_bytes, args.pages * page_bytes / med / 1e9))
    src = torch.empty(args.pages * rows[0][1], dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    for _ in range(args.repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    rows.append(
        ("memcpy (torch copy_, same bytes as int8 run)", rows[0][1], src.numel() / statistics.median(times[1:]) / 1e9)
    )
    print(f"{'path':52s} {'bytes/page':>11s} {'GB/s':>8s}")
    for name, b, gbs in rows:
        print(f"{name:52s} {b:11d} {gbs:8.2f}")
    print(f"stream/memcpy ratio (int8): {rows[0][2] / rows[-1][2]:.3f}")


if __name__ == "__main__":
    main()
