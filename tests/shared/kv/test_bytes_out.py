"""`concat` equals `b"".join` for every mix of part sizes and kinds, and returns a real, independent bytes object;
`copy_into` fills a tensor from any buffer of its size and refuses any other."""

import pytest
import torch

from pdserve.kv.bytes_out import LARGE, concat, copy_into


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


def test_copy_into_fills_a_tensor_from_received_bytes():
    src = bytes(torch.randint(0, 256, (3 * LARGE + 5,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))
    dst = torch.zeros(3, LARGE + 2, dtype=torch.uint8)[:, :-1]  # not contiguous: refused
    with pytest.raises(ValueError, match="copy_into"):
        copy_into(dst, src[: dst.numel()])
    dst = torch.zeros(3 * LARGE + 5, dtype=torch.uint8)
    copy_into(dst, memoryview(src))  # a read-only view, as the receiver holds
    assert bytes(dst.numpy()) == src
    with pytest.raises(ValueError, match="copy_into"):
        copy_into(dst, src[:-1])  # a size mismatch is never a partial copy
    copy_into(torch.empty(0, dtype=torch.uint8), b"")
