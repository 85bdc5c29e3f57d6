"""`TPGroup`: the collectives a tensor-parallel model and its rank runtime use, over torch.distributed (NCCL on
CUDA devices, gloo on CPU). One process per rank; the group is the whole world of the process group (one TP
instance per set of processes). Step plans travel as int64 tensors (never pickled objects) over a gloo group, so a
rank reads them on the host without a device sync even when the model's collectives run on NCCL.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0  # a collective waiting this long on a missing rank fails (worker.py heartbeats idle time)
MAX_BROADCAST_INTS = 1 << 24  # one broadcast's int64 count (128 MiB): a bound on a corrupt or hostile length
MAX_BROADCAST_BYTES = 1 << 32  # one tensor broadcast (KV pages of an import): a bound on a corrupt length


def _all_gather_single(out: torch.Tensor, x: torch.Tensor) -> None:
    """Every rank's `x` into `out` ([world * N, ...], rank-major): `all_gather_single` where torch has it (2.13
    deprecates `all_gather_into_tensor` for it), else `all_gather_into_tensor`."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x)


def free_tcp_init_method() -> str:
    """`tcp://127.0.0.1:<port>` on a port free now (bound to port 0 and released: no fixed port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class TPGroup:
    """This process's rank in a TP group of `world_size` processes on `device`."""

    def __init__(self, rank: int, world_size: int, device: torch.device, plan_group, backend: str = ""):
        self.rank, self.world_size, self.device = rank, world_size, device
        self._plan_group = plan_group  # gloo: the step plans (the world group itself on CPU)
        self.backend = backend or ("nccl" if device.type == "cuda" else "gloo")  # the model's collectives
        self._capturing = False  # inside `capturing`: the model's collectives are being recorded into a CUDA graph
        self.captured_collectives = 0  # collectives recorded by the last `capturing` region

    @classmethod
    def init(
        cls,
        rank: int,
        world_size: int,
        init_method: str,
        device: torch.device,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> TPGroup:
        """Join the group: every rank calls this with the same `world_size` and `init_method` (`file://<path>` of a
        file that does not exist yet, or `tcp://127.0.0.1:<port>`; `env://`: MASTER_ADDR / MASTER_PORT)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a TP group of {world_size}")
        if not init_method.startswith(("file://", "tcp://", "env://")):
            raise ValueError(f"init_method must be file://, tcp:// or env://, got {init_method!r}")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
        plan_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
        return cls(rank, world_size, device, plan_group, backend)

    @classmethod
    def from_env(cls, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
        """Join from the torchrun-style environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT."""
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except (KeyError, ValueError) as e:
            raise ValueError(f"TP group from the environment needs integer RANK and WORLD_SIZE ({e})") from None
        return cls.init(rank, world, "env://", device, timeout_s)

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    # ---- the model's collectives -------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns `x`."""
        self.captured_collectives += self._capturing
        dist.all_reduce(x)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, C] from each rank (the same C everywhere) -> [N, world * C], rank r's at columns [r * C, (r+1) * C).
        One output tensor, no per-rank temporaries: on NCCL the same call is captured inside a decode CUDA graph."""
        self.captured_collectives += self._capturing
        n, c = x.shape
        out = torch.empty(self.world_size * n, c, dtype=x.dtype, device=x.device)  # [world * N, C], rank-major
        _all_gather_single(out, x.contiguous())
        return out.view(self.world_size, n, c).permute(1, 0, 2).reshape(n, self.world_size * c)

    # ---- CUDA graphs -----------------------------------------------------------------------------------------
    def capture_blocker(self) -> str:
        """Why the model's collectives (`all_reduce`, `all_gather_columns`) cannot run inside a captured CUDA graph
        ("" when they can: NCCL on CUDA devices). NCCL kernels are captured like any other (torch's NCCL process
        group enqueues no watchdog work while a stream captures); gloo runs on the host, which a graph cannot hold."""
        if self.device.type != "cuda" or self.backend != "nccl":
            return (
                f"the TP group's collectives run on {self.backend} ({self.device.type}): a CUDA graph cannot hold them"
            )
        return ""

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """The region in which a CUDA graph records the model's collectives: refused (RuntimeError) for a group
        that cannot be captured, rather than running gloo on the host while the graph records none of it; counts
        the collectives recorded (`captured_collectives`: none would mean the graph bypassed this group)."""
        why = self.capture_blocker()
        if why:
            raise RuntimeError(f"a CUDA graph cannot capture this tensor-parallel forward: {why}")
        self._capturing, self.captured_collectives = True, 0
        try:
            yield
        finally:
            self._capturing = False

    @property
    def capture_error_mode(self) -> str:
        """`torch.cuda.graph`'s capture_error_mode for graphs holding this group's collectives: thread_local, so
        that CUDA calls of other threads during a capture (the NCCL watchdog's event queries of work enqueued
        before it) are not taken for unsafe calls inside the capture (nccl-tests captures this way too)."""
        return "thread_local"

    # ---- step plans ----------------------------------------------------------------------------------------
    def broadcast_ints(self, values: torch.Tensor | None) -> torch.Tensor:
        """Rank 0 passes a 1-D int64 CPU tensor; every rank returns it (a length, then the values; gloo)."""
        if self.is_root:
            if values is None or values.dtype != torch.int64 or values.dim() != 1:
                raise ValueError("rank 0 broadcasts a 1-D int64 tensor")
            if values.numel() > MAX_BROADCAST_INTS:
                raise ValueError(f"broadcast of {values.numel()} ints exceeds {MAX_BROADCAST_INTS}")
            length = torch.tensor([values.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(length, src=0, group=self._plan_group)
        n = int(length[0])
        if not 0 <= n <= MAX_BROADCAST_INTS:
            raise ValueError(f"broadcast length {n} outside 0..{MAX_BROADCAST_INTS}")
        buf = values.contiguous() if self.is_root and values is not None else torch.empty(n, dtype=torch.int64)
        if n:
            dist.broadcast(buf, src=0, group=self._plan_group)
        return buf

    def broadcast_bytes(self, values: torch.Tensor | None, numel: int) -> torch.Tensor:
        """Rank 0 passes a 1-D uint8 tensor of `numel` bytes on this group's device (the others None); every rank
        returns it on that device (the model's group: NCCL on a GPU, device to device)."""
        if not 0 <= numel <= MAX_BROADCAST_BYTES:
            raise ValueError(f"broadcast of {numel} bytes outside 0..{MAX_BROADCAST_BYTES}")
        if self.is_root:
            if values is None or values.dtype != torch.uint8 or values.dim() != 1 or values.numel() != numel:
                raise ValueError(f"rank 0 broadcasts a 1-D uint8 tensor of {numel} bytes")
            buf = values.to(self.device).contiguous()
        else:
            buf = torch.empty(numel, dtype=torch.uint8, device=self.device)
        if numel:
            dist.broadcast(buf, src=0)
        return buf

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. the KV pages each rank's memory allows: one pool size)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._plan_group)
        return int(t[0])

    def close(self) -> None:
        """Leave the group (this process's default process group is destroyed)."""
        if dist.is_initialized():
            dist.destroy_process_group()
