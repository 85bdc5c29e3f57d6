"""Where a decode step's GPU time goes: the 8B shape (`bench/gpu_engine.py`'s, 32 layers, random weights made on the
device, int8 KV, decode graphs) at batch 1 (context 512) and batch 128 (context 2048), per weight format, each
step's kernels from torch.profiler (graph replays included) summed by name.

    python bench/diag/decode_kernels.py [--formats fp8_channel,fp8_block,bf16] [--steps 10] [--pdl on|off|both]
                                        [--prefill 8192] [--gemv-ab 3]

Prints, per format and batch, the step's wall median, the GPU kernel time per step and the kernels by total time
(time a step, launches a step, mean us). Under programmatic dependent launch (--pdl, on by default on Hopper) a
kernel's time includes its wait for the one before it, so at batch 1 the sum exceeds the wall time; at batch 128
the kernels are long and the sum is the step. Figures: docs/benchmarks.md (issue 30)."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fp8_weights as fw
import gpu_engine as ge


def kernel_table(e, steps: int, top: int = 22, run=None) -> None:
    """Profile `steps` engine steps (or `steps` calls of `run`) and print the kernels by total GPU time."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run() if run else e.step()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = {}  # name -> [launches, total us]
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            row = per_name.setdefault(ev.name[:90], [0, 0.0])
            row[0] += 1
            row[1] += ev.device_time_total
    total = sum(t for _, t in per_name.values())
    launches = sum(c for c, _ in per_name.values())
    print(f"  GPU kernel time per step {total / steps / 1e3:.3f} ms over {launches / steps:.0f} kernels")
    for name, (count, t) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {t / steps / 1e3:8.3f} ms  {count / steps:6.1f}/step  {t / count:8.2f} us  {name}")


# GEMV variants: name -> Fp8Linear attributes: the path "auto" takes ("stream" at M = 1, "dot" above) or a forced one
# ("stream, bits": e4m3 widened by integer ops instead of the conversion instructions, fp8_gemv's `bits`; "stream,
# half": products in packed float16, fp8_gemv's `half`, the default at M = 1; "stream, float32": not)
GEMV_VARIANTS = {
    f"GEMV path {p}": dict(gemv_path=p, gemv_bits=None, gemv_half=None) for p in ("auto", "stream", "tc", "dot")
}
GEMV_VARIANTS["GEMV path stream, bits"] = dict(gemv_path="stream", gemv_bits=True, gemv_half=None)
GEMV_VARIANTS["GEMV path stream, half"] = dict(gemv_path="stream", gemv_bits=None, gemv_half=True)
GEMV_VARIANTS["GEMV path stream, float32"] = dict(gemv_path="stream", gemv_bits=None, gemv_half=False)


def gemv_ab(e, rounds: int, name: str) -> None:
    """Decode step wall medians (the engine's running batch) of each GEMV_VARIANTS entry, rotated round by round,
    the decode graphs re-captured at each switch; prints each round and each median's ratio to the first entry.
    Leaves the defaults set."""
    from pdserve.engine.quant.fp8_linear import Fp8Linear

    layers = [m for m in e.runner.model.modules() if isinstance(m, Fp8Linear)]
    names = list(GEMV_VARIANTS)
    defaults = {k: getattr(layers[0], k) for k in GEMV_VARIANTS[names[0]]}
    got: dict[str, list[float]] = {v: [] for v in names}
    for r in range(rounds):
        for v in names[r % len(names) :] + names[: r % len(names)]:
            for m in layers:
                for k, val in GEMV_VARIANTS[v].items():
                    setattr(m, k, val)
            e.runner.graph_runner.capture()
            got[v].append(statistics.median(ge.time_decode_steps(e, 40)[10:]))
            print(f"[{name}] round {r} {v}: {got[v][-1]:.3f} ms")
    base = statistics.median(got[names[0]])
    for v in names:
        med = statistics.median(got[v])
        print(f"[{name}] {v}: {med:.3f} ms, {med / base:.3f}x {names[0]}")
    for m in layers:
        for k, val in defaults.items():
            setattr(m, k, val)
    e.runner.graph_runner.capture()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="fp8_channel,fp8_block", help=f"of {', '.join(fw.FORMATS_8B)}")
    ap.add_argument("--steps", type=int, default=10, help="profiled steps per batch")
    ap.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="also profile one prompt of this many tokens (whole prefill: its chunks of 2048, the serving chunk size)",
    )
    ap.add_argument(
        "--pdl",
        default="on",
        choices=("on", "off", "both"),
        help="the engine's programmatic dependent launches (off: each kernel's time is its own)",
    )
    ap.add_argument(
        "--gemv-ab",
        type=int,
        default=0,
        help="FP8: also time batches 1 and 4 under each GEMV_VARIANTS entry (the GEMV's path), rotated this many "
        "rounds on one engine (graphs re-captured each switch)",
    )
    args = ap.parse_args()
    from pdserve.engine.sampling import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        pdl_runs = {"on": [True], "off": [False], "both": [True, False]}[args.pdl]
        for name, pdl in [(n, p) for n in args.formats.split(",") for p in pdl_runs]:
            d = fw.write_config_dir(Path(tmp) / name, ge.SHAPE, 32, fw.FORMATS_8B[name])
            g = torch.Generator().manual_seed(8)
            e = ge.make_engine(d, "int8", num_pages=18400, load_format="dummy", pdl=pdl)
            name = f"{name} pdl {'on' if pdl else 'off'}"
            if args.prefill:
                ids = lambda: torch.randint(5, ge.SHAPE["vocab_size"], (args.prefill,), generator=g).tolist()
                ms = ge.time_prefill(e, ids, reps=3)
                print(f"[{name}] prefill {args.prefill} tokens: wall median {ms:.2f} ms")

                def one_prefill() -> None:
                    ge.submit(e, f"pp{time.monotonic_ns()}", ids(), SamplingParams(max_tokens=1, temperature=0.0))
                    while e.has_unfinished_requests():
                        e.step()

                kernel_table(e, 1, top=30, run=one_prefill)
            sp = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
            fw.submit(e, "itl", torch.randint(5, ge.SHAPE["vocab_size"], (512,), generator=g).tolist(), sp)
            e.step()  # its prefill
            wall = ge.time_decode_steps(e, 40)[10:]
            print(f"[{name}] b1 ctx512 step wall median {statistics.median(wall):.3f} ms")
            kernel_table(e, args.steps)
            if args.gemv_ab and name.startswith("fp8"):
                gemv_ab(e, args.gemv_ab, f"{name} b1")
                for i in range(3):  # batch 4 (ctx 512): the GEMV's tensor-core rows
                    fw.submit(e, f"itl{i}", torch.randint(5, ge.SHAPE["vocab_size"], (512,), generator=g).tolist(), sp)
                    e.step()
                gemv_ab(e, args.gemv_ab, f"{name} b4")
                for i in range(3):
                    e.abort(f"itl{i}")
            e.abort("itl")
            e.step()
            ge.fill_decode_batch(e, 128, 2048, g)
            wall = ge.time_decode_steps(e, 20)[5:]
            print(f"[{name}] b128 ctx2k step wall median {statistics.median(wall):.3f} ms")
            kernel_table(e, args.steps // 2 or 1)
            del e
            ge.free_memory()


if __name__ == "__main__":
    main()
