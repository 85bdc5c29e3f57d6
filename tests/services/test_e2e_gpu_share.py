"""A prefill and a decode process sharing one share file (what `pdserve up` gives a shared GPU), the decode with
`--yield-tpot-ms`: concurrent requests stay token-identical to HF, the prefill's marks reach the decode, which
reports its waits when it stops (pdserve.engine.gpu_share)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import torch
from services_testutil import tiny_stack

import pdserve
from pdserve.engine.gpu_share import GpuShareFlag
from pdserve.testing.hf_reference import hf_greedy

LENGTHS = [3, 17, 40, 61, 9, 33]


def test_decode_holding_back_for_the_prefill_keeps_outputs(model_dir, hf_model, tmp_path, monkeypatch):
    share = tmp_path / "gpu-share-0"
    monkeypatch.setenv("PDSERVE_PREFILL_GPU_SHARE_FILE", str(share))
    monkeypatch.setenv("PDSERVE_DECODE_GPU_SHARE_FILE", str(share))
    monkeypatch.setenv("PDSERVE_DECODE_YIELD_TPOT_MS", "1000")  # room enough to wait out every prefill step
    prompts = [torch.randint(5, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in LENGTHS]
    long_ids = torch.randint(5, 512, (20,), generator=torch.Generator().manual_seed(99)).tolist()
    held_ids = torch.randint(5, 512, (11,), generator=torch.Generator().manual_seed(7)).tolist()
    with tiny_stack(model_dir, tmp_path / "stack", kv_dtype="auto", page_size=4, chunk_size=8) as stack:
        with pdserve.Client(stack.router, timeout=120) as c, ThreadPoolExecutor(len(prompts)) as ex:
            # a long decode first; the other prompts' prefill steps come while it decodes, so it may hold back
            chunks = c.stream(token_ids=long_ids, max_tokens=120, temperature=0, ignore_eos=True)
            long_out = list(next(chunks).token_ids)
            futs = [
                ex.submit(c.generate, token_ids=ids, max_tokens=12, temperature=0, ignore_eos=True) for ids in prompts
            ]
            long_out += [t for ch in chunks for t in ch.token_ids]
            outs = [f.result() for f in futs]
            # whether the prefill's short CPU steps overlap a decode step is timing; a mark held up for the whole
            # of a decode (by this process, in the prefill's place: its steps are done) is not
            chunks = c.stream(token_ids=held_ids, max_tokens=16, temperature=0, ignore_eos=True)
            held_out = list(next(chunks).token_ids)
            flag = GpuShareFlag(share)
            flag.mark(lease_ns=3_000_000_000)
            held_out += [t for ch in chunks for t in ch.token_ids]
            flag.clear()
            flag.close()
        assert long_out == hf_greedy(hf_model, long_ids, 120)
        for ids, out in zip(prompts, outs):
            assert out.token_ids == hf_greedy(hf_model, ids, 12), len(ids)
        assert held_out == hf_greedy(hf_model, held_ids, 16)
        stack.stop()
        log = stack.log_text()
    marked = re.search(r"marked (\d+) steps for a decode sharing the GPU", log)
    assert marked is not None and int(marked.group(1)) >= len(prompts) + 2  # every prefill step marks
    line = re.search(r"held steps back for the GPU's prefill (\d+) times, (\d+) ms", log)
    assert line is not None, "the decode's yield summary at stop"
    assert int(line.group(1)) >= 1  # the decode read the mark and waited
    assert share.stat().st_size == 8  # the mark's 8 bytes
