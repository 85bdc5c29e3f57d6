"""pdserve.engine.fa3_call on CPU: without the op (no FA3 here) every call goes through the interface functions
with the arguments they took before; an op whose schema lacks an argument is not called."""

from __future__ import annotations

import torch

from pdserve.engine import fa3_call
from pdserve.engine.fa3_call import FA3Forward


class Interface:
    """A stand-in for flash_attn_interface that records its calls."""

    def __init__(self):
        self.calls = []

    def flash_attn_varlen_func(self, *args, **kw):
        self.calls.append(("varlen", args, kw))
        return args[0] + 1, None  # (out, lse), as with return_attn_probs

    def flash_attn_with_kvcache(self, *args, **kw):
        self.calls.append(("kvcache", args, kw))
        return args[0] * 2


class _NoOps:
    """torch.ops as a process without FA3 sees it: no flash_attn_3.fwd."""

    flash_attn_3 = object()


def test_without_the_op_the_interface_runs(monkeypatch):
    monkeypatch.setattr(torch, "ops", _NoOps())  # also where FA3 is installed (the GPU host)
    fa = Interface()
    fwd = FA3Forward(fa)
    assert not fwd.direct
    q, k, cu = torch.zeros(3, 2, 4), torch.zeros(5, 1, 4), torch.tensor([0, 3], dtype=torch.int32)
    out = fwd.varlen(q, k, k, cu, cu, 3, 5, None, 0.5, causal=True)
    assert torch.equal(out, q + 1)
    name, args, kw = fa.calls[-1]
    assert name == "varlen" and args[5:] == (3, 5) and kw == dict(seqused_k=None, softmax_scale=0.5, causal=True)
    table, lens = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([4], dtype=torch.int32)
    out = fwd.with_kvcache(q, k, k, lens, table, 0.5, causal=True, num_splits=3)
    assert torch.equal(out, q * 2)
    name, _, kw = fa.calls[-1]
    assert name == "kvcache" and kw["num_splits"] == 3 and kw["cache_seqlens"] is lens and kw["page_table"] is table


class _Arg:
    def __init__(self, name):
        self.name = name


class _Op:
    """An op packet whose schema takes `names` and returns two tensors."""

    def __init__(self, names):
        self.default = type("D", (), {"_schema": type("S", (), {"arguments": [_Arg(n) for n in names],
                                                                 "returns": [0, 1]})()})()  # fmt: skip


def test_an_op_missing_an_argument_is_not_used(monkeypatch):
    full = ["q", "k", "v", *fa3_call._USED]

    class Ops:
        def __init__(self, names):
            self.flash_attn_3 = type("NS", (), {"fwd": _Op(names)})()

    monkeypatch.setattr(torch, "ops", Ops(full))
    assert fa3_call.direct_op(Interface()) is not None
    assert FA3Forward(Interface(), direct=False).op is None  # direct=False: the interface, always
    monkeypatch.setattr(torch, "ops", Ops([n for n in full if n != "is_rotary_interleaved"]))
    assert fa3_call.direct_op(Interface()) is None
