"""`concat` equals `b"".join` for every mix of part sizes and kinds, and returns a real, independent bytes object."""

import pytest
import torch

from pdserve.kv.bytes_out import LARGE, concat


@pytest.mark.parametrize(
    "sizes",
    [[0], [3, 5], [LARGE - 1], [LARGE], [7, LARGE, 0, 3], [1, 8 << 20], [LARGE + 1, LARGE + 2, 9]],
)
def test_equals_join(sizes):
    g = torch.Generator().manual_seed(sum(sizes))
    parts = []
    for i, n in enumerate(sizes):
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        parts.append(bytes(t.numpy()) if i % 2 else memoryview(t.numpy()))  # bytes and tensor-backed buffers
    got = concat(parts)
    assert type(got) is bytes and got == b"".join(parts) and hash(got) == hash(b"".join(parts))


def test_result_does_not_alias_its_parts():
    src = torch.zeros(2 * LARGE, dtype=torch.uint8)
    got = concat([b"h", memoryview(src.numpy())])
    src.fill_(7)  # the source changes afterwards: the bytes keep what was copied
    assert got == b"h" + bytes(2 * LARGE)
