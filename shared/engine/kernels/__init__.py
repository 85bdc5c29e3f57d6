"""Triton kernels for the GPU engine (one file per kernel). CPU never uses them: every caller keeps its torch
path and asks `enabled(tensor)` first. Import a kernel module only after `enabled` returned True (it imports
triton, which a CPU-only install may lack)."""
from __future__ import annotations

import importlib.util
import os

import torch

# Read once at import: whether triton is installed, and the opt-out switch (PDSERVE_TRITON=0).
HAVE_TRITON = importlib.util.find_spec("triton") is not None and os.environ.get("PDSERVE_TRITON", "1") != "0"


def enabled(t: torch.Tensor) -> bool:
    """True when `t` lives on a CUDA device (or the triton interpreter is on) and triton is importable."""
    return HAVE_TRITON and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: Hopper or newer, a triton with grid dependency control, not the interpreter
    (PDSERVE_PDL=0 turns it off)."""
    if not HAVE_TRITON or device.type != "cuda" or os.environ.get("PDSERVE_PDL", "1") == "0":
        return False
    if torch.cuda.get_device_capability(device)[0] < 9:
        return False
    return importlib.util.find_spec("triton.language.extra.cuda.gdc") is not None
