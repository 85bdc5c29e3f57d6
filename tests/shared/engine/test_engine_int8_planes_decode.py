"""The lean int8 decode loop's arithmetic (kernels/int8_planes_decode.py: offsets folded out of the conversion, lazy
rescaling, masks on the last block only) run by Triton's interpreter on the CPU against fp64 attention over the same
dequantized pages. The interpreter cannot run inline PTX, so the byte-plane conversion is replaced by the same
arithmetic in Triton ops (1152 + byte); everything else is the kernel as compiled for the GPU, where
test_engine_gpu_kernels.py checks the real conversion. The dev extra installs Triton (and numpy < 2.3, which its
interpreter needs), so CI runs it; skipped elsewhere without them."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
if tuple(int(x) for x in importlib.metadata.version("numpy").split(".")[:2]) >= (2, 3):
    pytest.skip("Triton 3.6's interpreter needs numpy < 2.3 (the dev extra pins it)", allow_module_level=True)

SCRIPT = r"""
import torch, triton, triton.language as tl
from pdserve.engine.kernels import int8_decode_attention as kd, int8_planes_decode as pk
from pdserve.kv import quant as Q

@triton.jit
def planes(w):  # what the PTX computes: byte r of each word as fp16 1152 + byte
    return (
        (((w >> 0) & 0xFF) ^ 0x80).to(tl.float16) + 1024.0,
        (((w >> 8) & 0xFF) ^ 0x80).to(tl.float16) + 1024.0,
        (((w >> 16) & 0xFF) ^ 0x80).to(tl.float16) + 1024.0,
        (((w >> 24) & 0xFF) ^ 0x80).to(tl.float16) + 1024.0,
    )
pk._words_to_offset_planes = planes

def reference(q, kv, table, lens, ps, scale):
    out = torch.empty(q.shape, dtype=torch.float64)
    B, HQ, D = q.shape
    group = HQ // kv.shape[2]
    for b in range(B):
        rows = (table[b].long()[:, None] * ps + torch.arange(ps)).view(-1)[: int(lens[b])]
        k, v = kv[0][rows].double(), kv[1][rows].double()  # [n, KVH, D]
        for h in range(HQ):
            p = torch.softmax(k[:, h // group] @ q[b, h].double() * scale, 0)
            out[b, h] = p @ v[:, h // group]
    return out

torch.manual_seed(0)
# two KV heads (kh > 0 in the pool row offsets) of four query heads each (QPK 4 of QP 16 rows: masked q rows); the
# interpreter runs a program per (sequence, KV head, split), so more heads only repeat the same blocks
ps, KVH, D, HQ, W = 16, 2, 128, 8, 20
lens = torch.tensor([1, 16, 31, 32, 33, 100, 128, 300], dtype=torch.int32)  # 300: flushes mid-split
B = len(lens)
P = B * W
# fast-rise's V only at large magnitude: V's int8 bytes do not change with it (up to the fp16 rounding of its
# scales, which carry the 3000) and the lazy rescales follow the scores alone, so the kernel takes the same branches
# as with V at normal magnitude; "normal" keeps V at the small scales where P * v_scale rounds lowest
for data in ("normal", "slow-rise", "fast-rise-large-v"):
    for splits in (1, 3):
        k, v, q = torch.randn(P, ps, KVH, D), torch.randn(P, ps, KVH, D), torch.randn(B, HQ, D)
        table = torch.randperm(P).view(B, W).int()
        if "rise" in data:  # scores grow along the sequence: below / above the lazy bound per block
            rows = (table.long()[:, :, None] * ps + torch.arange(ps)).view(B, W * ps)
            pos = torch.zeros(P * ps)
            pos[rows] = torch.arange(W * ps, dtype=torch.float32).expand(B, -1)
            u = torch.nn.functional.normalize(torch.randn(D), dim=0)
            q = 4 * u + 0.1 * q
            k = 0.1 * k + ((0.03 if data == "slow-rise" else 0.4) * pos).view(P, ps, 1, 1) * u
        if data.endswith("large-v"):  # P * v_scale in fp16 overflows unless the max follows the scores closely
            v = v * 3000.0
        q8, s, _ = Q.quantize(torch.stack([k, v]), 64, False)
        q = q.bfloat16()
        assert kd.reads_planes(D, 2, False)
        out = kd.int8_paged_decode(
            q, q8[0], q8[1], s[0], s[1], None, None, table, lens, D**-0.5, splits,
        )  # symmetric, two groups per head, head_dim 128: the lean loop
        kvf = Q.dequantize(q8, s, None, 64, torch.float32).view(2, P * ps, KVH, D)
        ref = reference(q.float(), kvf, table, lens, ps, D**-0.5)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert out.isfinite().all() and err < 6e-3, (data, splits, err)
        print(data, splits, f"{err:.2e}")
"""


def test_lean_loop_vs_fp64_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert len(r.stdout.splitlines()) == 6
