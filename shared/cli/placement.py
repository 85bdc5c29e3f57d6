"""Where `pdserve up`'s engine instances run: which GPUs each instance's ranks get, and how much of each GPU's memory
it may fill. A pure plan (no torch): `plan_placement` turns instance counts, tensor-parallel sizes and the `--gpus`
list into one `Placement` per instance, whose `args()` / `env()` its `pdserve serve` process is started with.

Tensor parallel: an instance of TP size N takes N consecutive entries of its role's GPU list, rank r on the r-th
(`pdserve.engine.tp.supervisor.rank_device` puts rank r on cuda:<rank 0's index + r>). Consecutive ids (2,3) are
passed as `--device cuda:2`; any other run of ids (1,3) is made consecutive for that process with
CUDA_VISIBLE_DEVICES (`--device cuda:0`), mapped through the launcher's own CUDA_VISIBLE_DEVICES when it has one
(`--gpus` ids index the GPUs the launcher sees). A role's GPU count that is not a multiple of its TP size is an
error: a rank left without its own GPU would share one with another rank of its instance.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pdserve.engine.config import EngineConfig

PREFILL, DECODE = "prefill", "decode"
GPU_MEMORY_UTILIZATION: float = EngineConfig.gpu_memory_utilization  # what one GPU's instances share


@dataclass(frozen=True)
class Placement:
    """Where one engine instance runs: its GPUs (rank r on `gpus[r]`; none: the engine's own `auto` device), the
    fraction of each of those GPUs' total memory it may fill (None: the service's default) and its TP size (None:
    the engine's own setting)."""

    role: str  # prefill | decode
    index: int  # instance number within its role
    gpu: int | None = None  # rank 0's GPU (the first of `gpus`)
    memory_fraction: float | None = None
    gpus: tuple[int, ...] = field(default=())  # every rank's GPU; () with `gpu` given: (gpu,)
    tp: int | None = None

    def __post_init__(self) -> None:
        if not self.gpus and self.gpu is not None:
            object.__setattr__(self, "gpus", (self.gpu,))
        elif self.gpus and self.gpu is None:
            object.__setattr__(self, "gpu", self.gpus[0])

    @property
    def consecutive(self) -> bool:
        """The ranks' GPU ids count up by one from rank 0's (rank r on cuda:<gpu + r> without remapping)."""
        return all(g == self.gpus[0] + r for r, g in enumerate(self.gpus))

    def args(self) -> list[str]:
        """`pdserve serve` flags of this placement."""
        out: list[str] = []
        if self.gpus:
            out += ["--device", f"cuda:{self.gpus[0] if self.consecutive else 0}"]
            if self.memory_fraction is not None:
                out += ["--gpu-memory-utilization", f"{self.memory_fraction:.4f}"]
        if self.tp is not None:
            out += ["--tensor-parallel-size", str(self.tp)]
        return out

    def env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """Environment for this instance's process: CUDA_VISIBLE_DEVICES where its GPUs are not consecutive ids
        (mapped through `environ`'s own list, which `--gpus` ids index), else nothing."""
        if not self.gpus or self.consecutive:
            return {}
        seen = [d.strip() for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        if seen and max(self.gpus) >= len(seen):
            raise ValueError(f"GPU {max(self.gpus)} is not among CUDA_VISIBLE_DEVICES={','.join(seen)}")
        return {"CUDA_VISIBLE_DEVICES": ",".join(seen[g] if seen else str(g) for g in self.gpus)}

    def describe(self) -> str:
        """`cuda:0` or `cuda:0,1 (tensor parallel 2)`: the line `pdserve up` prints, with the memory share."""
        where = f"cuda:{','.join(map(str, self.gpus))}"
        if len(self.gpus) > 1:
            where += f" (tensor parallel {len(self.gpus)})"
        whose = "each one's" if len(self.gpus) > 1 else "its"
        share = f", {self.memory_fraction:.0%} of {whose} memory"
        return where + (share if self.memory_fraction is not None else "")


def _split(n_gpus: int, num: dict[str, int], size: dict[str, int]) -> int | None:
    """GPUs of the prefill group when both roles get their own: a multiple of prefill's TP size, the rest a
    multiple of decode's, closest to the instance counts' share (None: no such split)."""
    target = n_gpus * num[PREFILL] / (num[PREFILL] + num[DECODE])
    fits = [
        k * size[PREFILL]
        for k in range(1, n_gpus // size[PREFILL] + 1)
        if n_gpus - k * size[PREFILL] >= size[DECODE] and (n_gpus - k * size[PREFILL]) % size[DECODE] == 0
    ]
    if not fits:
        return None
    if size[PREFILL] == size[DECODE] == 1:  # round half to even, as one GPU per instance always split
        return min(n_gpus - 1, max(1, round(target)))
    return min(fits, key=lambda n: (abs(n - target), n))


def plan_placement(
    num_prefill: int,
    num_decode: int,
    gpus: list[int],
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
    prefill_tp: int | None = None,
    decode_tp: int | None = None,
) -> list[Placement]:
    """Prefill instances first, then decode. Without GPUs every instance keeps the engine's default device.
    With enough GPUs for each role's instance (`prefill_tp` + `decode_tp`, 1 each when None) the roles get disjoint
    GPU groups sized by their instance counts (prefill compute never slows decode steps), else they share them; an
    instance takes the next TP-size run of its group's GPUs, round-robin. The instances on one GPU split
    `gpu_memory_utilization` (a fraction of its total memory) evenly, so two instances on one GPU at 0.85 get
    0.425 each. ValueError when a role's GPUs are not a whole number of its instances' runs."""
    roles = [(PREFILL, i) for i in range(num_prefill)] + [(DECODE, i) for i in range(num_decode)]
    tps = {PREFILL: prefill_tp, DECODE: decode_tp}
    size = {r: 1 if t is None else t for r, t in tps.items()}
    if any(t < 1 for t in size.values()):
        raise ValueError(f"tensor parallel sizes must be >= 1, got {size}")
    if not gpus:
        return [Placement(r, i, tp=tps[r]) for r, i in roles]
    if len(gpus) != len(set(gpus)) or any(g < 0 for g in gpus):
        raise ValueError(f"GPU ids must be distinct and >= 0, got {gpus}")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    num = {PREFILL: num_prefill, DECODE: num_decode}
    present = [r for r in (PREFILL, DECODE) if num[r]]
    n_pre = _split(len(gpus), num, size) if len(present) == 2 else None
    groups = {PREFILL: gpus[:n_pre], DECODE: gpus[n_pre:]} if n_pre else {PREFILL: gpus, DECODE: gpus}
    for r in present:
        if len(groups[r]) % size[r]:
            whose = ""
            if len(present) == 2:
                whose = f" for {r} instances" + ("" if n_pre else " (shared by both roles: too few for a group each)")
            raise ValueError(
                f"{len(groups[r])} GPUs {groups[r]}{whose} are not a multiple of the tensor parallel size "
                f"{size[r]}: each instance takes {size[r]} GPUs of its own"
            )
    runs = {r: [tuple(g[i : i + size[r]]) for i in range(0, len(g), size[r])] for r, g in groups.items()}
    chosen = [runs[r][i % len(runs[r])] for r, i in roles]
    sharing = {g: sum(g in run for run in chosen) for g in gpus}
    return [
        Placement(r, i, memory_fraction=gpu_memory_utilization / max(sharing[g] for g in run), gpus=run, tp=tps[r])
        for (r, i), run in zip(roles, chosen)
    ]
