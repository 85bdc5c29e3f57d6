"""Large `bytes` objects built without holding the GIL for the copy.

gRPC's Python API takes a message as `bytes`, and so does redis-py. A KV batch or a cached page is several MB
copied from a pinned host tensor. `b"".join` does that copy with the GIL held unless every part is an exact `bytes`
object, and a tensor's memory never is. Meanwhile the stream writer (gRPC's own copy of each message), the
engine thread and the ack reader all wait for the GIL.

`concat` allocates the result uninitialized (`PyBytes_FromStringAndSize(NULL, n)`, the C API's way to build a bytes
object), fills it before any other code can see it, and copies each large part with `ctypes.memmove` (a foreign
call: the GIL is released, and the copy stays on this thread). The small parts (headers) are copied directly.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Sequence

import torch

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)

LARGE = 1 << 16  # parts from this size are copied with the GIL released; smaller results are a plain join


def _silence_readonly_warning() -> None:
    """torch warns once per process ("The given buffer is not writable") the first time `frombuffer` gets a
    read-only buffer; take that one warning here, so that `tensor_view` runs without `warnings.catch_warnings`
    (which is not thread-safe and costs more than the view itself on a per-page path)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(b"\0", dtype=torch.uint8)


_silence_readonly_warning()


def tensor_view(buf, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A CPU tensor over `buf` (any buffer, read-only ones too) without copying it: for readers, or for a new object
    filled before anything else sees it."""
    return torch.frombuffer(buf, dtype=dtype)


def concat(parts: Sequence) -> bytes:
    """The concatenation of `parts` (any contiguous buffers) as one new `bytes` object."""
    views = [memoryview(p).cast("B") for p in parts]
    total = sum(v.nbytes for v in views)
    if total < LARGE:
        return b"".join(views)
    out = _new_bytes(None, total)  # uninitialized; nothing else holds it until this returns
    dst = tensor_view(out)
    base = dst.data_ptr()
    small = memoryview(dst.numpy())  # type: ignore[arg-type]
    at = 0
    for v in views:
        n = v.nbytes
        if n >= LARGE:  # a plain memcpy; a ctypes call releases the GIL (a torch copy would fan out to OpenMP)
            ctypes.memmove(base + at, tensor_view(v).data_ptr(), n)
        elif n:
            small[at : at + n] = v
        at += n
    return out


def copy_into(dst: torch.Tensor, src) -> None:
    """Copy `src` (any contiguous buffer of `dst`'s size) into the contiguous CPU tensor `dst` with the GIL released
    (one `memmove`; pinned destinations included)."""
    view = memoryview(src).cast("B")
    n = view.nbytes
    if not dst.is_contiguous() or dst.device.type != "cpu" or dst.numel() * dst.element_size() != n:
        raise ValueError(f"copy_into: {n} bytes into a {tuple(dst.shape)} {dst.dtype} tensor on {dst.device}")
    if n:
        ctypes.memmove(dst.data_ptr(), tensor_view(view).data_ptr(), n)
