"""Triton kernels for the GPU engine (one file per kernel). CPU never uses them: `pdserve.engine.kernel_choice`
decides once at load which ops run as Triton kernels. Import a kernel module only after `enabled` returned True
(it imports triton, which a CPU-only install may lack)."""

from __future__ import annotations

import importlib.util
import os

import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None  # capability only; EngineConfig.triton opts out


def enabled(device: torch.device) -> bool:
    """True when triton is importable and `device` is CUDA (or triton's own interpreter is on)."""
    return HAVE_TRITON and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: Hopper or newer and a triton with grid dependency control."""
    if not HAVE_TRITON or device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(device)[0] < 9:
        return False
    return importlib.util.find_spec("triton.language.extra.cuda.gdc") is not None
