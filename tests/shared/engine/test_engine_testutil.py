"""The references the GPU kernel tests compare against, checked on CPU (a wrong reference would pass a wrong
kernel): paged decode attention through a page table, and the gathered-pages check."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_testutil import assert_gathered, page_slots, ref_paged_decode


def test_ref_paged_decode_is_sdpa_over_the_gathered_sequence():
    g = torch.Generator().manual_seed(0)
    P, ps, KVH, HQ, D = 12, 4, 2, 6, 16
    kv = torch.randn(2, P * ps, KVH, D, generator=g)
    table = torch.randperm(P, generator=g)[:9].view(3, 3).int()
    lens = torch.tensor([1, 7, 12], dtype=torch.int32)
    q = torch.randn(3, HQ, D, generator=g)
    out = ref_paged_decode(q, kv, table, lens, ps, D**-0.5)
    for b in range(3):
        n = int(lens[b])
        slots = [int(table[b, t // ps]) * ps + t % ps for t in range(n)]  # token t: page t // ps, offset t % ps
        k = kv[0, slots].double().repeat_interleave(HQ // KVH, 1).transpose(0, 1)  # [HQ, n, D]
        v = kv[1, slots].double().repeat_interleave(HQ // KVH, 1).transpose(0, 1)
        want = F.scaled_dot_product_attention(q[b].double()[:, None], k, v)[:, 0]
        torch.testing.assert_close(out[b], want)


def test_assert_gathered_accepts_the_gather_and_rejects_a_wrong_slot():
    P, ps = 5, 4
    full = torch.arange(2 * P * ps * 3, dtype=torch.float32).view(2, P * ps, 3)
    table = torch.tensor([[3, 1], [0, 4]], dtype=torch.int32)
    lens = torch.tensor([6, 3], dtype=torch.int32)
    out = torch.zeros(2, 2, 8, 3)
    for b in range(2):
        n = int(lens[b])
        out[:, b, :n] = full[:, page_slots(table[b], n, ps)]
    assert_gathered(out, full, table, lens, ps)
    out[0, 0, 5] += 1
    with pytest.raises(AssertionError):
        assert_gathered(out, full, table, lens, ps)
