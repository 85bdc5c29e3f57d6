"""The host allocator settings take on glibc and make a multi-MB message buffer reuse faulted-in memory."""

import platform
import resource

import pytest

from pdserve.server.host_memory import tune_malloc


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_tune_malloc_makes_batch_buffers_reuse_memory():
    payload = memoryview(bytearray(8 << 20))
    assert tune_malloc() is True
    batches = [b"".join([b"hdr", payload]) for _ in range(4)]  # warm-up: these fault their pages in
    del batches
    before = _minor_faults()
    batches = [b"".join([b"hdr", payload]) for _ in range(4)]  # 32 MiB again: reused, not fresh mmaps
    del batches
    # Untuned glibc maps each block afresh: ~8,200 faults for these 32 MiB (2,048 per 8 MiB block).
    assert _minor_faults() - before < 500
