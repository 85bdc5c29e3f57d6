"""KV stream vs raw gRPC stream on loopback, one process pair, same bytes (issue 32 item 6): how close the `grpc`
KV transport comes to the wire's speed without an engine in the way.

    python bench/kv_loopback.py [--tokens 2048] [--rounds 5] [--kv-layer-group 4] [--device cpu|cuda]   # prints, JSON
                                [--kv-transport grpc|grpc-shm] [--engine-load]

A child process serves two streams: `Pull` (bytes messages of `--kv-batch-mb`, what `gpu_serving.py --part raw`
measures) and `KV` (the Prefill stream's KV part: `pdserve.kv.transfer`'s prefill connector ships the pages of one
2k-token request of the 8B layout, int8, in layer groups as the served prefill does, answering decode's acks).
This process reads both: raw messages counted; KV messages through decode's connector (parse, checks, CRC32C, the
copy to `--device`, acks) to PrefillDone and `finish`. Rounds alternate raw and KV; the medians and their ratio
(`kv_loop_ratio`, the target is >= 0.7) are reported, and the CPU seconds both processes spent per GB moved in each
kind of round (`loop_*_cpu_s_per_gb`: steadier than the wall time on a shared host, shippers included). With
`--kv-transport grpc-shm` both ends run their shipper processes and the KV bytes go through them (keys end in
`_shm`). `bench/gpu_serving.py --part
loop` runs it on the GPU host.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import grpc
import torch

RAW, KV = "/bench.Loop/Pull", "/bench.Loop/KV"
OPTS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]


def layout():
    from pdserve.kv.codec import KVLayoutSpec

    # Llama-3-8B: 32 layers, 8 KV heads, head_dim 128; page 16; int8 KV with fp16 scales per 64 (the product default)
    return KVLayoutSpec("int8", page_size=16, num_layers=32, num_kv_heads=8, head_dim=128, group_size=64)


def settings(args) -> SimpleNamespace:
    """Both connectors' settings (PrefillConfig's / DecodeConfig's names and defaults)."""
    return SimpleNamespace(
        kv_transport=args.kv_transport, kv_batch_mb=args.kv_batch_mb, kv_ipc_staging_mb=1.0, kv_copy_threads=4,
        ack_timeout_s=60.0, page_timeout_s=60.0, page_timeout_max_s=60.0, page_timeout_slack=3.0,
        first_token_early=False, kv_layer_group=args.kv_layer_group, kv_shipper="off", kv_shipper_arena_mb=512.0,
    )  # fmt: skip


def group_rows(num_pages: int, group: int, device: torch.device) -> dict:
    """Per layer range of a chunk: its rows (uint8 [N, group page bytes], random int8 values, scales 1.0)."""
    from pdserve.kv.transfer.layers import layer_groups
    from pdserve.kv.transfer.page_format import PageFormat

    lay = layout()
    out = {}
    for r in layer_groups(lay.num_layers, group):
        fmt = PageFormat(lay, r.count)
        rows = torch.randint(-128, 127, (num_pages, fmt.page_bytes), dtype=torch.int8).view(torch.uint8)
        rows[:, fmt.data_bytes :].view(torch.float16).fill_(1.0)
        out[r] = rows.to(device)
    return out


def engine_load(stop: threading.Event) -> None:
    """A thread that holds the GIL as an engine thread does: Python between short torch ops (each releases it)."""
    x = torch.zeros(1024)
    while not stop.is_set():
        for _ in range(64):
            x.add_(1)
        sum(range(2000))


def start_load(on: bool) -> threading.Event:
    stop = threading.Event()
    if on:
        threading.Thread(target=engine_load, args=(stop,), daemon=True, name="engine-load").start()
    return stop


def _tree_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) of process `pid` and its descendants (Linux /proc; 0.0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except (OSError, ValueError, IndexError):
        return 0.0
    return own + sum(_tree_cpu(int(k)) for k in kids)


def cpu_seconds(pid: int) -> float:
    """CPU time of this process, process `pid` and their helpers (grpc-shm's shippers) together: what a round costs
    the host, which on a loaded host says more than its wall time."""
    return _tree_cpu(os.getpid()) if Path(f"/proc/{pid}").exists() else 0.0


def serve(port_file: str, args) -> None:
    """Child: the raw stream and prefill's end of the KV stream."""
    from pdserve.kv.transfer import ExportedPages, for_prefill
    from pdserve.server.host_memory import tune_malloc
    from pdserve.v1 import internal_pb2

    tune_malloc()  # as the services do (pdserve.server.runner): multi-MB batches reuse faulted-in heap memory
    device = torch.device(args.device)
    raw_msg = bytes(int(args.kv_batch_mb * 2**20))
    num_pages = args.tokens // layout().page_size
    rows = group_rows(num_pages, args.kv_layer_group, device)
    connector = for_prefill(settings(args), device, "fp", release=lambda rid: None)

    def pull(request: bytes, context):
        for _ in range(int(request.decode())):
            yield raw_msg

    def kv(request_iterator, context):
        req = next(request_iterator).request
        tx = connector.open(req.request_id, num_pages, layout(), req.kv_transport, req.kv_layer_groups)
        if args.kv_ramp >= 0 and hasattr(tx.sender, "ramp"):
            tx.sender.ramp = args.kv_ramp  # type: ignore[attr-defined]  # GrpcSender's
        yield tx.choice
        tx.listen(request_iterator)
        pages = list(range(num_pages))
        for r, rws in rows.items():  # a chunk's layer groups, in order, as the forward hands them over
            yield from tx.send(ExportedPages(pages, [16] * num_pages, rws, layers=r))
        yield internal_pb2.PrefillServerMessage(done=internal_pb2.PrefillDone(num_pages=tx.pages.num_shipped))
        tx.finish(60)
        tx.abort()

    ser = lambda m: m if isinstance(m, bytes) else m.SerializeToString()
    handler = grpc.method_handlers_generic_handler(
        "bench.Loop",
        {
            "Pull": grpc.unary_stream_rpc_method_handler(pull),
            "KV": grpc.stream_stream_rpc_method_handler(
                kv, request_deserializer=internal_pb2.PrefillClientMessage.FromString, response_serializer=ser
            ),
        },
    )
    start_load(args.engine_load)
    server = grpc.server(futures.ThreadPoolExecutor(8), options=OPTS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(port_file).write_text(str(port))
    server.wait_for_termination()


def measure(args, workdir: Path) -> dict:
    """Alternating rounds of raw and KV over one channel to the child; medians and the ratio."""
    from pdserve.kv.transfer import for_decode
    from pdserve.kv.transfer.page_format import PageFormat
    from pdserve.server.host_memory import tune_malloc
    from pdserve.v1 import internal_pb2

    tune_malloc()
    device = torch.device(args.device)
    lay = layout()
    num_pages = args.tokens // lay.page_size
    total = num_pages * PageFormat(lay).page_bytes  # bytes of one request (every layer of every page)
    msg = int(args.kv_batch_mb * 2**20)
    port_file = workdir / "kvloop.port"
    port_file.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--serve", str(port_file), "--device", args.device, "--tokens", str(args.tokens)]
    cmd += ["--kv-batch-mb", str(args.kv_batch_mb), "--kv-layer-group", str(args.kv_layer_group)]
    cmd += ["--kv-ramp", str(args.kv_ramp), "--kv-transport", args.kv_transport]
    cmd += ["--engine-load"] if args.engine_load else []
    proc = subprocess.Popen(cmd)
    load = start_load(args.engine_load)
    dc = for_decode(settings(args), device, lay, "fp")
    raw_rates, kv_rates, wide_rates = [], [], []
    raw_cpu, kv_cpu = [], []  # CPU seconds of both processes per GB moved
    try:
        while not port_file.exists():
            time.sleep(0.05)
        addr = f"127.0.0.1:{port_file.read_text()}"
        with grpc.insecure_channel(addr, options=OPTS) as ch:
            pull, kv = ch.unary_stream(RAW), ch.stream_stream(KV, internal_pb2.PrefillClientMessage.SerializeToString)

            def raw_round() -> float:
                t0, got = time.perf_counter(), 0
                for m in pull(str(max(1, total // msg)).encode()):
                    got += len(m)
                return got / (time.perf_counter() - t0) / 1e9

            def wide_round() -> float:
                """The same bytes over `--raw-channels` connections at once (what several streams could reach)."""
                k = args.raw_channels
                chans = [grpc.insecure_channel(addr, options=[*OPTS, ("grpc.channel_id", i)]) for i in range(k)]
                n = max(1, total // msg // k)
                try:
                    one = lambda c: sum(len(m) for m in c.unary_stream(RAW)(str(n).encode()))
                    with futures.ThreadPoolExecutor(k) as ex:
                        t0 = time.perf_counter()
                        got = sum(ex.map(one, chans))
                    return got / (time.perf_counter() - t0) / 1e9
                finally:
                    for c in chans:
                        c.close()

            def kv_round(i: int) -> float:
                done: Future = Future()
                done.set_result(None)
                rx = dc.open(f"r{i}", num_pages, lambda: None, lambda *a: done, peer="loop")
                t0 = time.perf_counter()
                call = kv(rx.messages(internal_pb2.PrefillRequest(request_id=f"r{i}")), timeout=120)
                rx.attach(call.cancel)
                try:
                    for raw in call:
                        m = rx.receive(raw)
                        if m is not None and m.HasField("done"):
                            rx.finish(m.done)
                            break
                finally:
                    rx.close()
                return rx.pages.bytes_received / (time.perf_counter() - t0) / 1e9

            def timed(f, rates: list, cpu: list) -> None:
                c0 = cpu_seconds(proc.pid)
                rates.append(f())
                cpu.append((cpu_seconds(proc.pid) - c0) / (total / 1e9))

            raw_round(), kv_round(-1)  # warm-up: connection, threads, allocations
            for i in range(args.rounds):
                timed(raw_round, raw_rates, raw_cpu)
                timed(lambda: kv_round(i), kv_rates, kv_cpu)
                if args.raw_channels > 1:
                    wide_rates.append(wide_round())
    finally:
        load.set()
        proc.kill()
        dc.close()
    raw, kvr = statistics.median(raw_rates), statistics.median(kv_rates)
    return {
        "loop_raw_grpc_gbps": raw,
        "loop_kv_gbps": kvr,
        "kv_loop_ratio": kvr / raw,
        "loop_raw_cpu_s_per_gb": statistics.median(raw_cpu),
        "loop_kv_cpu_s_per_gb": statistics.median(kv_cpu),
        "loop_raw_all": raw_rates,
        "loop_kv_all": kv_rates,
        "loop_kv_cpu_all": kv_cpu,
        "loop_request_mb": total / 2**20,
        "loop_kv_batch_mb": args.kv_batch_mb,
        "loop_kv_layer_group": args.kv_layer_group,
        "loop_device": args.device,
        "loop_engine_load": args.engine_load,
        "loop_kv_ramp": args.kv_ramp,
        "loop_kv_transport": args.kv_transport,
        **({f"loop_raw_grpc_gbps_{args.raw_channels}ch": statistics.median(wide_rates)} if wide_rates else {}),
    }


def figures(workdir: Path, argv: list[str]) -> dict:
    """`measure` with these command-line options (bench/gpu_serving.py --part loop); keys of a run with
    `--engine-load` end in `_engine_load`."""
    args = parser().parse_args(argv)
    got = measure(args, workdir)
    suffix = "_shm" * (args.kv_transport == "grpc-shm") + "_engine_load" * args.engine_load
    return {f"{k}{suffix}": v for k, v in got.items()}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt tokens of a request (whole pages)")
    ap.add_argument("--kv-batch-mb", type=float, default=8.0, help="KV batch bound; the raw messages' size")
    ap.add_argument("--kv-layer-group", type=int, default=4, help="layers per shipment (0: whole pages)")
    ap.add_argument("--kv-ramp", type=int, default=-1, help="sender ramp steps (-1: default)")
    ap.add_argument("--kv-transport", choices=("grpc", "grpc-shm"), default="grpc",
                    help="grpc-shm: the bytes through shipper processes beside both ends")  # fmt: skip
    ap.add_argument("--engine-load", action="store_true", help="a GIL-holding thread in both processes, as engines")
    ap.add_argument("--raw-channels", type=int, default=1, help="also time raw over this many connections at once")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--serve", default="", help=argparse.SUPPRESS)
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.serve:
        return serve(args.serve, args)
    import tempfile

    got = measure(args, Path(tempfile.mkdtemp(prefix="kvloop-")))
    print(
        f"raw {got['loop_raw_grpc_gbps']:.2f} GB/s, kv {got['loop_kv_gbps']:.2f} GB/s, "
        f"ratio {got['kv_loop_ratio']:.2f} ({args.kv_transport}, {got['loop_request_mb']:.0f} MiB requests, "
        f"{args.device}"
        f"{', engine load' if args.engine_load else ''}); CPU s/GB of both processes: raw "
        f"{got['loop_raw_cpu_s_per_gb']:.2f}, kv {got['loop_kv_cpu_s_per_gb']:.2f}"
    )
    wide = got.get(f"loop_raw_grpc_gbps_{args.raw_channels}ch")
    if wide is not None:
        print(f"raw over {args.raw_channels} connections: {wide:.2f} GB/s")
    if args.json:
        from benchutil import merge_json

        merge_json(args.json, got)


if __name__ == "__main__":
    main()
