"""The M = 1 FP8 GEMV's machine code without a GPU: Triton compiles the "stream" kernel of
pdserve.engine.quant.fp8_gemv for Hopper (sm_90) on this host, once per way of widening the weights, and cuobjdump
(shipped with Triton) disassembles it; prints per variant the registers, local memory, the K loop's instruction
count and its most frequent instructions, and the loop's weight bytes per instruction issued.

    python bench/diag/gemv_sass.py [--variants conv,bits,half] [--block-n 8] [--block-k 1024] [--num-warps 4]
                                   [--num-stages 3] [--sass-dir DIR]

Why: an SM issues at most 4 warp instructions a clock, so a loop of I instructions per thread over B weight bytes
per thread streams at most 128 * B / I bytes a clock per SM (x 132 SMs x the clock); where that is near what the
memory delivers (an H200: ~18 bytes a clock per SM), the instruction count, not the memory, paces the GEMV.
Compiled as the engine launches it (the argument divisibility Triton specializes on for 16-aligned shapes)."""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pdserve.engine.quant import fp8_gemv

ARGS = {
    "x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": "*bf16", "part_ptr": "*fp32",
    "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "KG": "i32", "steps_per_split": "i32", "x_stride": "i32",
    "w_stride": "i32", "split": "i32",
}  # fmt: skip
ALIGNED = ["x_ptr", "w_ptr", "s_ptr", "b_ptr", "y_ptr", "part_ptr", "cnt_ptr", "N", "K", "KG", "x_stride", "w_stride"]
INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def compile_stream(variant: str, block_n: int, block_k: int, num_warps: int, num_stages: int):
    """The stream kernel at M = 1, per-channel scales, PDL, for sm_90: Triton's compiled kernel."""
    constexprs = dict(SBN=1, SCALES=0, ACC_K=True, PREFETCH=False, HAS_BIAS=False, BITS=variant == "bits",
                      HALF=variant == "half", USE_PDL=True, BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k)  # fmt: skip
    sig = {**ARGS, **dict.fromkeys(constexprs, "constexpr")}
    names = list(sig)
    src = ASTSource(
        fn=fp8_gemv._fp8_stream_kernel,
        signature=sig,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(names.index(a),): [["tt.divisibility", 16]] for a in ALIGNED},
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                             num_stages=num_stages))  # fmt: skip


def cuobjdump() -> Path:
    import triton.backends.nvidia as nv

    return Path(nv.__file__).parent / "bin" / "cuobjdump"


def sass_of(kernel, out: Path) -> tuple[str, dict[str, int]]:
    """The kernel's disassembly (also written to `out`) and its resource usage (REG, LOCAL, SHARED, ...)."""
    cubin = out.with_suffix(".cubin")
    cubin.write_bytes(kernel.asm["cubin"])

    def run(flag: str) -> str:
        return subprocess.run([str(cuobjdump()), flag, str(cubin)], capture_output=True, text=True, check=True).stdout

    text = run("-sass")
    out.write_text(text)
    usage = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", run("-res-usage"))}
    return text, usage


def k_loop(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body (the K loop; the split-K sums' loops are short)."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in map(INSTR.match, sass.splitlines()) if m]
    best: list[str] = []
    for addr, text in ins:
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            body = [t for a, t in ins if int(target.group(1), 16) <= a <= addr]
            best = max(best, body, key=len)
    return best


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def analyse(variant: str, block_n: int, block_k: int, num_warps: int, num_stages: int, sass_dir: Path) -> dict:
    kernel = compile_stream(variant, block_n, block_k, num_warps, num_stages)
    sass, usage = sass_of(kernel, sass_dir / f"stream_{variant}.sass")
    loop = k_loop(sass)
    ops = collections.Counter(map(opcode, loop))
    weight_bytes = block_n * block_k // (32 * num_warps)  # a thread's bytes of one step's tile
    return {
        "variant": variant,
        "registers": usage["REG"],
        "local_memory": usage["LOCAL"],
        "loop_instructions": len(loop),
        "bytes_per_instruction": weight_bytes / max(len(loop), 1),
        "top": ops.most_common(10),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="conv,bits,half", help="conv (e4m3 -> f16 -> f32), bits, half")
    for flag, default in [("--block-n", 8), ("--block-k", 1024), ("--num-warps", 4), ("--num-stages", 3)]:
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--sass-dir", default="/tmp/pdserve-gemv-sass", help="where the disassembly is written")
    args = ap.parse_args()
    out = Path(args.sass_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{'variant':<8} {'regs':>5} {'local':>6} {'loop':>6} {'B/instr':>8}  most frequent in the loop")
    for variant in args.variants.split(","):
        r = analyse(variant, args.block_n, args.block_k, args.num_warps, args.num_stages, out)
        top = ", ".join(f"{op} {c}" for op, c in r["top"])
        print(f"{variant:<8} {r['registers']:5d} {r['local_memory']:6d} {r['loop_instructions']:6d} "
              f"{r['bytes_per_instruction']:8.3f}  {top}")  # fmt: skip


if __name__ == "__main__":
    main()
