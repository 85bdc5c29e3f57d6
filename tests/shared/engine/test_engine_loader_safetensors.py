"""`loader.read_safetensors`, the CPU load path: the same tensors as safetensors' own reader (names, dtypes, bytes),
every dtype a checkpoint ships (FP8 and 0-dim scales included), the file never mapped, and a clear ValueError
for a file whose header does not describe its bytes."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.loader import iter_weights, read_safetensors


def test_same_tensors_as_safetensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w.bf16": torch.randn(7, 5, generator=g).bfloat16(),
        "w.f32": torch.randn(3, 4, 2, generator=g),
        "w.f16": torch.randn(9, generator=g).half(),
        "w.fp8": torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn),
        "s.scale": torch.tensor(0.5),  # 0-dim
        "i.int8": torch.randint(-128, 127, (6,), dtype=torch.int8, generator=g),
        "empty": torch.empty(0, 3),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    ours = {}
    for name, t in read_safetensors(path):
        assert str(path) not in open("/proc/self/maps").read()  # the file is never mapped, even mid-load
        ours[name] = t
    ref = load_file(str(path))  # (its tensors map the file)
    assert ours.keys() == ref.keys()
    for name, t in ref.items():
        assert ours[name].dtype == t.dtype and ours[name].shape == t.shape, name
        assert torch.equal(ours[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def test_iter_weights_converts_on_cpu(checkpoint):
    d = checkpoint("llama")
    weights = dict(iter_weights(d, torch.device("cpu"), torch.bfloat16))
    ref = load_file(str(d / "model.safetensors"))
    assert weights.keys() == ref.keys()
    assert all(torch.equal(weights[n], t.to(torch.bfloat16)) for n, t in ref.items())


def test_a_header_that_does_not_fit_raises(tmp_path):
    path = tmp_path / "bad.safetensors"
    save_file({"w": torch.zeros(4, 4)}, str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["w"]["shape"] = [4, 5]  # 80 bytes claimed, 64 there
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])
    with pytest.raises(ValueError, match="does not fit"):
        dict(read_safetensors(path))
    path.write_bytes(raw[: 8 + n + 10])  # cut inside the tensor
    with pytest.raises(ValueError, match="does not fit"):
        dict(read_safetensors(path))
    path.write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(ValueError, match="not a safetensors file"):
        dict(read_safetensors(path))
