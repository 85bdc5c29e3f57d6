"""Helpers shared by the engine tests (imported as a plain module; pytest puts this folder on sys.path)."""

from __future__ import annotations

import queue

import pytest
import torch

from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.dtypes import QUANTIZED
from pdserve.kv.payload import PagePayload
from pdserve.kv.transfer.base import ExportedPages
from pdserve.kv.transfer.page_format import PageFormat
from pdserve.testing.teacher_forcing import forced_logits as teacher_forced_logits

NOISE_MARGIN = 1e-4  # a top-2 logit gap below this is float noise: divergence there is not a bug


def assert_same_greedy(ours: list[int], ref: list[int], ref_logits: torch.Tensor, what: str) -> None:
    """Token-identical, unless the first divergence sits on a float-noise tie in HF's logits (then skip)."""
    if ours == ref:
        return
    j = (
        next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
        if len(ours) == len(ref)
        else min(len(ours), len(ref))
    )
    if j < len(ref):
        top2 = torch.topk(ref_logits[j], 2).values
        margin = float(top2[0] - top2[1])
        if margin < NOISE_MARGIN:
            pytest.skip(
                f"{what}: diverges at step {j} where HF's top-2 logit margin is {margin:.2e} "
                f"(< {NOISE_MARGIN}): float noise, not a mismatch"
            )
    raise AssertionError(f"{what}: greedy tokens differ at step {j}\nours={ours}\nhf  ={ref}")


def hf_generate(model, prompt: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    """HF generate(do_sample=False) of `new` tokens: (tokens, per-step logits [new, V] float32)."""
    out = model.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=new,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    assert len(tokens) == new
    return tokens, torch.stack([lg[0] for lg in out.logits]).float()


def random_prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (n,), generator=g).tolist()


def layout_for(
    engine: LLMEngine, kv_dtype: str = "auto", group_size: int | None = None, asymmetric: bool | None = None
) -> KVLayoutSpec:
    """The page format `kv_dtype` of this engine's model: "auto" (the model dtype), a dense dtype name, or "int8" /
    "fp8" with `group_size` / `asymmetric` (default: the engine's pool settings)."""
    mc = engine.model_config
    quantized = kv_dtype in QUANTIZED
    return KVLayoutSpec(
        engine.kv_storage_dtype_name if kv_dtype == "auto" else kv_dtype,
        engine.page_size,
        mc.num_layers,
        mc.num_kv_heads,
        mc.head_dim,
        (engine.kv_group_size if group_size is None else group_size) if quantized else 0,
        (engine.kv_asymmetric if asymmetric is None else asymmetric) if quantized else False,
    )


def export_payloads(
    engine: LLMEngine, request_id: str, page_indexes: list[int], layout: KVLayoutSpec
) -> list[PagePayload]:
    """Computed pages of a request as CPU PagePayloads in `layout` (what a prompt cache holds), through the batch
    export."""
    if not page_indexes:
        return []
    ex = engine.export_batch(request_id, list(page_indexes), layout)
    if ex.ready is not None:
        ex.ready.synchronize()
    return PageFormat(layout).payloads(ex.rows.cpu(), ex.page_indexes, ex.num_tokens)


def prefill_and_export(
    engine: LLMEngine, request_id: str, prompt: list[int], sampling: SamplingParams
) -> tuple[int, ExportedPages]:
    """Prefill `prompt` on `engine` (the prefill side of a handoff): its first token and its pages as one batch in
    the engine's own format; the request is released after the export."""
    engine.add_request(EngineRequest(request_id, prompt, sampling, prefill_only=True))
    first, ready = None, []
    while first is None:
        for o in engine.step():
            ready += o.ready_pages
            first = o.new_token_ids[0] if o.finished else None
    batch = engine.export_batch(request_id, ready, layout_for(engine))
    engine.release(request_id)
    return first, batch


def queued_tokens(q: queue.Queue, timeout: float = 20.0) -> list[int]:
    """The token ids of a request's outputs from an EngineLoop callback's queue, up to its final output."""
    out: list[int] = []
    while True:
        o = q.get(timeout=timeout)
        assert not isinstance(o, BaseException), o
        out += o.new_token_ids
        if o.finished:
            return out


def record_launches(engine: LLMEngine) -> list[tuple[bool, int]]:
    """Wrap the runner's launch_decode: the list it returns gets (chained, rows) of each launch from now on."""
    launches: list[tuple[bool, int]] = []
    launch = engine.runner.launch_decode

    def recorded(seqs, positions, prev):
        launches.append((prev is not None, len(seqs)))
        return launch(seqs, positions, prev)

    engine.runner.launch_decode = recorded  # type: ignore[method-assign]
    return launches


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict:
    """Step until idle; returns {request_id: {"tokens": [...], "text": str, "outputs": [StepOutput]}}."""
    res: dict = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return res
        for o in engine.step():
            r = res.setdefault(o.request_id, {"tokens": [], "text": "", "outputs": []})
            r["tokens"] += o.new_token_ids
            r["text"] += o.text_delta
            r["outputs"].append(o)
    raise AssertionError("engine did not finish")


def forced_logits(engine: LLMEngine, prompts: list[list[int]], forced: list[list[int]]) -> torch.Tensor:
    """Teacher-forced per-step logits [sum of steps, V] (float32), prompts in order."""
    return torch.cat(teacher_forced_logits(engine, prompts, forced))


def page_slots(table_row: torch.Tensor, n: int, page_size: int) -> torch.Tensor:
    """The flat KV slots (page * page_size + offset) of a sequence's first `n` tokens through its page-table row."""
    offsets = torch.arange(page_size, device=table_row.device)
    return (table_row.long()[:, None] * page_size + offsets).flatten()[:n]


def ref_paged_decode(q, kv, table, lens, page_size: int, scale: float) -> torch.Tensor:
    """fp64 attention of q [B, HQ, D] over dense kv [2, P*page_size, KVH, D] through the page table (the decode
    kernels' reference; grouped-query heads share their KV head)."""
    b, hq, d = q.shape
    kvh = kv.shape[2]
    out = torch.empty(b, hq, d, dtype=torch.float64, device=q.device)
    for i in range(b):
        slots = page_slots(table[i], int(lens[i]), page_size)
        k = kv[0, slots].double().repeat_interleave(hq // kvh, 1)
        v = kv[1, slots].double().repeat_interleave(hq // kvh, 1)
        a = torch.einsum("hd,nhd->hn", q[i].double(), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", a.softmax(-1), v)
    return out


def assert_gathered(out, full, table, lens, page_size: int) -> None:
    """`out` [2, B, T, ...] holds, for each sequence, its first lens[b] tokens of `full` [2, P*page_size, ...]."""
    for b in range(len(lens)):
        n = int(lens[b])
        assert torch.equal(out[:, b, :n], full[:, page_slots(table[b], n, page_size)])


def skip_without_fa3_gpu() -> None:
    """pytest.skip unless this host has a CUDA sm90 GPU, triton and FA3 (the GPU engine tests' needs)."""
    from pdserve.engine import kernels
    from pdserve.engine.attention import select_backend
    from pdserve.engine.kernel_choice import KernelChoice

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9 or not kernels.HAVE_TRITON:
        pytest.skip("needs a CUDA sm90 GPU and triton")
    backend, reason = select_backend("auto", torch.device("cuda"), torch.bfloat16, KernelChoice())
    if backend.name != "fa3":
        pytest.skip(f"FA3 unavailable: {reason}")
