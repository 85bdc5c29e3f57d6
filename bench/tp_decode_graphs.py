"""Decode at tensor parallel 2 on two GPUs with and without the decode CUDA graphs (the NCCL all-reduces captured
inside), beside TP=1 with its graphs (issue 31): median wall ms per decode step at batch 1 and 32, context 512.

    python bench/tp_decode_graphs.py [--layers 32] [--json docs/bench/tp_decode_graphs.json]

The Llama-3-8B shape with random weights made on the device (`load_format="dummy"`: no checkpoint), bf16 KV, FA3,
fused kernels. Each engine is built, measured and its ranks stopped before the next (one TP group per process).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from benchutil import log
from fp8_weights import write_config_dir

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.models.random_llama import LLAMA3_8B_SHAPE

CONTEXT, STEPS = 512, 48


def step_ms(e: LLMEngine, batch: int) -> float:
    """Median wall ms of a decode step of `batch` sequences at about CONTEXT tokens (after their prefills)."""
    sp = SamplingParams(max_tokens=STEPS + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        e.add_request(EngineRequest(f"b{batch}-{i}", [5 + (i + j) % 1000 for j in range(CONTEXT)], sp))
    started: set[str] = set()
    while len(started) < batch:  # every prefill done: each sequence has its first token
        started |= {o.request_id for o in e.step() if o.new_token_ids}
    times = []
    while e.has_unfinished_requests():
        t0 = time.perf_counter()
        e.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[4:-4])


def measure(model_dir: Path, tp: int, graphs: bool) -> dict:
    cfg = EngineConfig(model_dir=str(model_dir), dtype="bfloat16", device="cuda:0", page_size=16, chunk_size=2048,
                       num_pages=4096, max_num_seqs=64, kv_dtype="auto", attention_backend="fa3",
                       load_format="dummy", tensor_parallel_size=tp, cuda_graphs=graphs)  # fmt: skip
    t0 = time.perf_counter()
    e = LLMEngine(cfg)
    kind = type(e.runner.graph_runner).__name__ if e.runner.graph_runner is not None else "eager"
    log(f"TP={tp} graphs={graphs}: {kind}, load + capture {time.perf_counter() - t0:.1f}s")
    out = {"tp": tp, "cuda_graphs": graphs, "runner": kind}
    for b in (1, 32):
        out[f"step_ms_b{b}"] = round(step_ms(e, b), 3)
        log(f"  batch {b}: {out[f'step_ms_b{b}']:.2f} ms / step")
    if e.runner._supervisor is not None:
        e.runner._supervisor.stop()
    del e
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    assert torch.cuda.device_count() >= 2, "needs two GPUs"
    with tempfile.TemporaryDirectory() as tmp:
        model = write_config_dir(Path(tmp) / "llama8b", LLAMA3_8B_SHAPE, args.layers, None)
        rows = [measure(model, tp, g) for tp, g in ((1, True), (2, False), (2, True))]
    doc = {"gpu": torch.cuda.get_device_name(0), "context": CONTEXT, "layers": args.layers, "rows": rows}
    print(json.dumps(doc, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
