"""Where a KV transfer's time goes, step by step, in one process (issue 11): each step of the `grpc` and `cuda-ipc`
paths timed alone on the batch a 2048-token request of the 8B shape ships (int8 pages, 138 MB).

    python bench/kv_path.py [--tokens 2048] [--batch-mb 8] [--json FILE]

Steps (median of --reps runs each, GB/s over the request's page bytes):
- grpc sender: device -> pinned host copy (`to_host`), CRC32C, message bytes (`batch_message_bytes`);
- grpc receiver: message parse, CRC32C verify, pageable host -> device copy, value check (`check_values`);
- cuda-ipc: staging copy (device -> device on the sender's GPU), peer copy to the receiver's GPU (cuda:1 when present).
The sum of a path's steps is what the services cannot beat without overlapping them; the services' own GB/s
(bench/gpu_serving.py) beside it shows what the orchestration adds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from benchutil import log, print_rows, row

from pdserve.kv.bytes_out import tensor_view
from pdserve.kv.codec import KVLayoutSpec, check_values
from pdserve.kv.transfer.base import ExportedPages
from pdserve.kv.transfer.grpc_transport import to_host
from pdserve.kv.transfer.page_format import PageFormat
from pdserve.kv.transfer.wire import (
    BatchExpectation,
    batch_message_bytes,
    checksum,
    make_header,
    parse_server_message,
    verify_header,
)
from pdserve.server.host_memory import tune_malloc


def timed(fn: Callable[[], object], reps: int, sync: bool = True) -> float:
    """Median seconds of fn() over reps runs after one warm-up."""
    fn()
    out = []
    for _ in range(reps):
        if sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def other_thread_progress(fn: Callable[[], object], seconds: float = 0.5) -> float:
    """How far a pure-Python thread gets while `fn` runs in a loop, as a fraction of how far it gets alone in the
    same time: 1.0 means `fn` never holds the GIL, ~0.5 means it holds it all the time (they take turns)."""

    def spin(stop: threading.Event, out: list[int]) -> None:
        n = 0
        while not stop.is_set():
            n += 1
        out.append(n)

    def run(busy: bool) -> float:
        stop, out = threading.Event(), []
        t = threading.Thread(target=spin, args=(stop, out))
        t0 = time.perf_counter()
        t.start()
        while time.perf_counter() - t0 < seconds:
            if busy:
                fn()
            else:
                time.sleep(0.001)
        stop.set()
        t.join()
        return out[0] / (time.perf_counter() - t0)

    return run(True) / run(False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--batch-mb", type=float, default=8.0)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    src_dev = torch.device("cuda:0" if cuda else "cpu")
    dst_dev = torch.device("cuda:1" if cuda and torch.cuda.device_count() > 1 else src_dev)
    layout = KVLayoutSpec("int8", 16, 32, 8, 128, group_size=64)  # the 8B shape's pages
    fmt = PageFormat(layout)
    n = args.tokens // layout.page_size
    total = n * fmt.page_bytes
    rows = torch.randint(-127, 127, (n, fmt.page_bytes), dtype=torch.int8, device=src_dev).view(torch.uint8)
    data, scales, _ = fmt.unpack(rows)
    if scales is not None:
        scales.fill_(0.01)  # finite scales: the value check passes
    k = max(1, int(args.batch_mb * 2**20) // fmt.page_bytes)
    idx = list(range(n))
    tok = [layout.page_size] * n
    exp = BatchExpectation(layout, "fp", "rid")
    res: dict = {"tokens": args.tokens, "page_bytes": fmt.page_bytes, "request_bytes": total, "batch_pages": k}

    def gbps(sec: float) -> float:
        return total / sec / 1e9

    def record(name: str, sec: float) -> None:
        res[name] = {"ms": sec * 1e3, "gbps": gbps(sec)}
        row(name, f"{sec * 1e3:.2f} ms", f"{gbps(sec):.1f} GB/s")

    exported = ExportedPages(idx, tok, rows)
    record("grpc.sender.to_host", timed(lambda: to_host(exported), args.reps))
    host = to_host(exported)
    views = [memoryview(host[i : i + k].numpy()).cast("B") for i in range(0, n, k)]
    hdrs = [make_header(request_id="rid", fingerprint="fp", layout=layout, first_seq_no=i, page_indexes=idx[i : i + k],
                        num_tokens=tok[i : i + k]) for i in range(0, n, k)]  # fmt: skip
    record("grpc.sender.crc32c", timed(lambda: [checksum(h, v) for h, v in zip(hdrs, views)], args.reps, False))
    for h, v in zip(hdrs, views):
        h.has_checksum = True
        h.checksum = checksum(h, v)
    record(
        "grpc.sender.message_bytes",
        timed(lambda: [batch_message_bytes(h, v) for h, v in zip(hdrs, views)], args.reps, False),
    )
    tune_malloc()  # as the services do (pdserve.server.host_memory)
    record(
        "grpc.sender.message_bytes_tuned_malloc",
        timed(lambda: [batch_message_bytes(h, v) for h, v in zip(hdrs, views)], args.reps, False),
    )
    joined = [b"".join([h.SerializeToString(), v]) for h, v in zip(hdrs, views)]  # noqa: F841 (warm the heap)
    record("grpc.sender.join_reference", timed(lambda: [b"".join([b"h", v]) for v in views], args.reps, False))
    for name, build in (
        ("join", lambda: [b"".join([b"h", v]) for v in views]),
        ("message_bytes", lambda: [batch_message_bytes(h, v) for h, v in zip(hdrs, views)]),
    ):
        res[f"gil.{name}_other_thread_progress"] = other_thread_progress(build)
        row(f"gil: a Python thread's progress during {name}", f"{res[f'gil.{name}_other_thread_progress']:.0%}")
    with ThreadPoolExecutor(4) as pool:  # GrpcSender's builders: CRC32C + serialization, 4 threads
        record(
            "grpc.sender.build_4_threads",
            timed(lambda: list(pool.map(lambda hv: batch_message_bytes(*hv), zip(hdrs, views))), args.reps, False),
        )
    msgs = [batch_message_bytes(h, v) for h, v in zip(hdrs, views)]
    record("grpc.receiver.parse", timed(lambda: [parse_server_message(m) for m in msgs], args.reps, False))
    parsed = [parse_server_message(m) for m in msgs]
    record("grpc.receiver.verify", timed(lambda: [verify_header(h, exp, p) for _, h, p in parsed], args.reps, False))
    hviews = [tensor_view(p).view(-1, fmt.page_bytes) for _, _, p in parsed]

    def h2d() -> list[torch.Tensor]:
        return [v.to(dst_dev, non_blocking=False) for v in hviews]

    record("grpc.receiver.h2d_pageable", timed(h2d, args.reps))
    if cuda:
        pinned = [v.pin_memory() for v in hviews]
        record("grpc.receiver.h2d_pinned", timed(lambda: [v.to(dst_dev, non_blocking=True) for v in pinned], args.reps))
    on_dev = torch.cat(h2d())
    record("receiver.check_values", timed(lambda: check_values(*fmt.unpack(on_dev)), args.reps))
    staging = torch.empty(total, dtype=torch.uint8, device=src_dev)
    record("ipc.sender.stage", timed(lambda: staging.copy_(rows.reshape(-1)), args.reps))
    if dst_dev != src_dev:
        dst = torch.empty(total, dtype=torch.uint8, device=dst_dev)
        record("ipc.receiver.peer_copy", timed(lambda: dst.copy_(staging), args.reps))
    res["device"] = torch.cuda.get_device_name(0) if cuda else "cpu"
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, sort_keys=True)
    log(f"{n} pages of {fmt.page_bytes} B = {total / 1e6:.1f} MB, {k} pages per batch")
    print_rows()


if __name__ == "__main__":
    main()
