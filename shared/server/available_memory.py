"""How much host memory this process may still use: the kernel's MemAvailable, capped by the cgroup's limit (a
container sees the host's /proc/meminfo, not its own limit). Used to size memory tiers that default to a share
of the host (the prompt cache's local tier)."""

from __future__ import annotations

from pathlib import Path

# cgroup v2 (unified) and v1 (memory controller): (limit file, usage file)
CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)
NO_LIMIT = 1 << 60  # v1 reports "no limit" as a huge page-rounded number


def meminfo_available(path: str = "/proc/meminfo") -> int | None:
    """MemAvailable in bytes (None where the file or the field is missing)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_headroom(files: tuple[tuple[str, str], ...] = CGROUP_FILES) -> int | None:
    """Limit minus usage of this process's memory cgroup (None: no limit, or no cgroup files)."""
    for limit_file, usage_file in files:
        try:
            raw = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if raw == "max" or int(raw) >= NO_LIMIT:
            return None
        return max(0, int(raw) - usage)
    return None


def available_memory_bytes() -> int | None:
    """Bytes this process can still allocate without swapping or hitting its cgroup limit (None: unknown)."""
    known = [b for b in (meminfo_available(), cgroup_headroom()) if b is not None]
    return min(known) if known else None
