"""A receiver's copy of a batch onto the device, off the engine's stream, into memory the engine may use and free.

Decode's copy threads (`KVReceiver.receive_async`) copy each batch (grpc: from pinned host memory; cuda-ipc: from
the peer's staging buffer) on a side stream, so the copy never queues behind the decode step in flight. The
destination must then come from the side stream's own blocks of the caching allocator, never from the engine
stream's: the engine frees its temporaries (a scatter's page index tensor, an earlier batch's rows) as soon as it
has queued the kernels that read them, and the allocator hands such a block to the next allocation on the engine's
stream at once. A copy thread allocating there (its current stream is the engine's, the device's default stream)
and writing on the side stream overwrote a still-queued scatter's page indexes on the H200 (IndexKernel.cu "index
out of bounds": grpc, 32 layers in groups of 4, whose last batch of a chunk was a small block), or its rows.

`copy_to_device` allocates under the side stream, and marks the result used on the calling thread's current
stream (the engine's), so that once the engine frees it the block is reused only after the work the engine queued
on it is done.
"""

from __future__ import annotations

import torch


def copy_to_device(src: torch.Tensor, device: torch.device, stream: torch.cuda.Stream) -> torch.Tensor:
    """A new tensor on `device` holding `src` (pinned host memory, or device memory such as a peer's buffer), copied
    on `stream` and complete when this returns; safe to read and free on the caller's current stream (the engine
    runs on the device's default stream, which is every copy thread's current stream)."""
    consumer = torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        dst = torch.empty(src.shape, dtype=src.dtype, device=device)  # the side stream's blocks, never the engine's
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()  # this copy only: other threads' copies on the stream may still run
    dst.record_stream(consumer)  # freed after the engine's use: not reused before the work it queued by then
    return dst
