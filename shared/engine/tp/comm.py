"""`TPGroup`: the collectives a tensor-parallel model and its rank runtime use, over torch.distributed (NCCL on
CUDA devices, gloo on CPU). One process per rank; the group is the whole world of the process group (one TP
instance per set of processes). Step plans travel as int64 tensors (never pickled objects) over a gloo group, so a
rank reads them on the host without a device sync even when the model's collectives run on NCCL.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0  # a collective waiting this long on a missing rank fails (worker.py heartbeats idle time)
MAX_BROADCAST_INTS = 1 << 24  # one broadcast's int64 count (128 MiB): a bound on a corrupt or hostile length
MAX_BROADCAST_BYTES = 1 << 32  # one tensor broadcast (KV pages of an import): a bound on a corrupt length


def free_tcp_init_method() -> str:
    """`tcp://127.0.0.1:<port>` on a port free now (bound to port 0 and released: no fixed port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class TPGroup:
    """This process's rank in a TP group of `world_size` processes on `device`."""

    def __init__(self, rank: int, world_size: int, device: torch.device, plan_group):
        self.rank, self.world_size, self.device = rank, world_size, device
        self._plan_group = plan_group  # gloo: the step plans (the world group itself on CPU)

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
        return cls(rank, world_size, device, plan_group)

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
        dist.all_reduce(x)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, C] from each rank (the same C everywhere) -> [N, world * C], rank r's at columns [r * C, (r+1) * C)."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

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
