"""What one gRPC hop costs a synchronous Python caller, with pdserve's channel options and without the single-threaded
server-streaming receive (`pdserve.server.grpc_util.SYNC_CHANNEL_OPTIONS` against `CHANNEL_OPTIONS`):

    python bench/diag/grpc_hop.py [--calls 400] [--messages 3] [--bytes 8192] [--rounds 2]

A threaded server of `pdserve.server.grpc_util.make_server` answers each call with --messages messages of --bytes
bytes (a token chunk is ~100 bytes; a 2k prompt's ids ~8 KB); the client, over a channel of `grpc_util.channel`,
times to the first message (a new call's setup: the request path's hops router -> decode -> prefill are each one) and
to the end of the call, alternating the two option sets --rounds times. Prints per option set the medians in ms and
the later messages' ms each (what relaying one more token costs), then the ratio of the two sets."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator

import grpc

from pdserve.server.grpc_util import CHANNEL_OPTIONS, SYNC_CHANNEL_OPTIONS, channel, make_server
from pdserve.server.security import ChannelSecurity

METHOD = "/pdserve.diag.Hop/Stream"


def serve(messages: int, size: int) -> tuple[grpc.Server, int]:
    """A server whose one method streams `messages` messages of `size` bytes for any request; (server, port)."""

    def stream(request: bytes, context) -> Iterator[bytes]:
        for _ in range(messages):
            yield b"\x01" * size

    handler = grpc.method_handlers_generic_handler(
        "pdserve.diag.Hop", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
    )
    server = make_server(max_workers=8, max_concurrent_rpcs=64)
    server.add_generic_rpc_handlers([handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def time_calls(port: int, options: list, calls: int, size: int) -> tuple[list[float], list[float], int]:
    """ms to the first message and to the call's end, per call (the first tenth dropped: warm-up); messages seen."""
    with channel(f"127.0.0.1:{port}", ChannelSecurity.anonymous(), options) as ch:
        call_stream = ch.unary_stream(METHOD)
        request, firsts, ends, seen = b"\x02" * size, [], [], 0
        for i in range(calls):
            t0 = time.perf_counter()
            it = call_stream(request, timeout=10)
            next(it)
            t1 = time.perf_counter()
            n = 1 + sum(1 for _ in it)
            t2 = time.perf_counter()
            if i >= calls // 10:
                firsts.append((t1 - t0) * 1e3)
                ends.append((t2 - t0) * 1e3)
            seen = n
    return firsts, ends, seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default, what in [
        ("--calls", 400, "calls per option set and round"),
        ("--messages", 3, "messages each call streams back"),
        ("--bytes", 8192, "bytes of the request and of each message"),
        ("--rounds", 2, "times the two option sets alternate"),
    ]:
        ap.add_argument(flag, type=int, default=default, help=what)
    args = ap.parse_args()
    server, port = serve(args.messages, args.bytes)
    variants = {"spin-thread": CHANNEL_OPTIONS, "single-thread": SYNC_CHANNEL_OPTIONS}
    firsts: dict[str, list[float]] = {name: [] for name in variants}
    ends: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for _ in range(args.rounds):
            for name, options in variants.items():
                f, e, seen = time_calls(port, options, args.calls, args.bytes)
                if seen != args.messages:
                    raise SystemExit(f"{name}: {seen} messages, expected {args.messages}")
                firsts[name] += f
                ends[name] += e
    finally:
        server.stop(None)
    print(f"{'receive':<14} {'first_ms':>9} {'end_ms':>9} {'next_ms':>9}")
    medians = {}
    for name in variants:
        first, end = statistics.median(firsts[name]), statistics.median(ends[name])
        medians[name] = first, end
        later = (end - first) / (args.messages - 1) if args.messages > 1 else float("nan")
        print(f"{name:<14} {first:9.3f} {end:9.3f} {later:9.3f}")
    (f0, e0), (f1, e1) = medians["spin-thread"], medians["single-thread"]
    print(f"single/spin: first {f1 / f0:.2f}x, end {e1 / e0:.2f}x")


if __name__ == "__main__":
    main()
