"""Prompt-cache options, mixed into the config dataclass of each service that uses the cache (prefill)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.server.available_memory import available_memory_bytes
from pdserve.server.service_config import opt

if TYPE_CHECKING:
    import torch  # not at run time: the launcher reads these options without torch

MiB = 1 << 20
AUTO = -1.0
AUTO_LOCAL_SHARE = 1 / 8  # of the available host memory, for `--cache-local-mb -1`
AUTO_LOCAL_MIN_MB, AUTO_LOCAL_MAX_MB = 256.0, 64 * 1024.0
MAX_FETCH_BATCH_PAGES = 64  # --cache-fetch-batch-pages: one request's pages (its reply is held whole in memory)


@dataclass
class CacheOptions:
    prompt_cache: bool = opt(True, "prefix KV page cache: Redis when a Redis URL is set, else in-process")
    redis_url: str = opt(
        "",
        "prompt cache Redis: redis://[:password@]host:port/db, rediss:// (TLS), unix://; "
        "empty: $REDIS_URL, and without it an in-process cache",
    )
    redis_password_file: str = opt(
        "",
        "file with the Redis password (AUTH as the URL's user, an ACL user, else the default user), kept out of the "
        "URL; $REDIS_PASSWORD_FILE",
    )
    cache_secret_file: str = opt(
        "",
        "file with the cache secret every prefill instance of the deployment shares (values are MACed and key names "
        "hashed with it): first line signs new values, further lines are previous secrets still accepted "
        "(rotation); $PDSERVE_CACHE_SECRET_FILE, or the secret in $PDSERVE_CACHE_SECRET. Without one: a remote "
        "Redis refuses to start, a Redis on this host is private to the process (docs/prompt_cache.md)",
    )
    redis_cluster: bool = opt(False, "the Redis URL names a Redis Cluster node (redis-py cluster client)")
    cache_ttl_s: float = opt(1800.0, "lifetime of a cached page, refreshed on every hit")
    cache_timeout_ms: float = opt(250.0, "Redis socket timeout; a slower answer counts as an error (a miss)")
    cache_breaker_failures: int = opt(3, "consecutive Redis errors that open the circuit breaker")
    cache_breaker_cooldown_s: float = opt(5.0, "how long an open breaker skips Redis before one probe")
    cache_local_mb: float = opt(
        -1.0,
        "in-memory LRU tier in front of Redis, MiB (0 = off; -1 = auto: 1/8 of the host memory available at start, "
        "the cgroup limit included, between 256 MiB and 64 GiB)",
    )
    cache_memory_mb: float = opt(1024.0, "size of the in-process cache used without Redis, MiB")
    cache_max_value_mb: float = opt(32.0, "pages whose value is larger than this are not cached, MiB")
    cache_write_queue: int = opt(1024, "pages waiting for asynchronous write-back; beyond it they are dropped")
    cache_write_behind_mb: float = opt(
        1024.0,
        "pages of finished requests waiting to be written to the prompt cache, MiB (their export buffers: device "
        "memory on a GPU); written only while the instance is idle; a request that does not fit is not cached",
    )
    cache_write_wait_s: float = opt(
        2.0, "longest wait of a waiting write-back for an idle moment; then the rest of its pages are not cached"
    )
    cache_lookup_batch: int = opt(32, "pages fetched per pipelined Redis round trip")
    cache_fetch_race: str = opt(
        "auto",
        "Redis pages of a prompt race its compute: the engine loads those that land before it reaches them and "
        "computes the rest (on; auto: on GPU engines; off: the lookup waits for them)",
    )
    cache_fetch_connections: int = opt(8, "Redis connections (threads) that fetch cached prefixes in parallel")
    cache_fetch_batch_pages: int = opt(
        8,
        "pages one racing-fetch request reads (one pipelined round trip on one connection; larger batches land "
        "together, later)",
    )
    cache_fetch_process: str = opt(
        "auto",
        "racing prefix fetches read Redis and check MACs in a helper process writing a shared (pinned) arena, so the "
        "engine's process keeps its GIL (on; auto: on GPU engines; off: threads of the engine's process)",
    )
    cache_fetch_arena_mb: float = opt(
        1024.0, "the helper process's shared arena, MiB (a fetch that finds no room in it runs in the engine's process)"
    )
    cache_key_prefix: str = opt("pdserve:kv:", "prefix of every Redis key the cache writes")

    def validate_cache(self) -> None:
        if self.cache_ttl_s <= 0:
            raise SystemExit(f"--cache-ttl-s must be > 0, got {self.cache_ttl_s}")
        if self.cache_timeout_ms <= 0:
            raise SystemExit(f"--cache-timeout-ms must be > 0, got {self.cache_timeout_ms}")
        if self.cache_breaker_failures < 1 or self.cache_breaker_cooldown_s < 0:
            raise SystemExit("--cache-breaker-failures must be >= 1 and --cache-breaker-cooldown-s >= 0")
        if self.cache_local_mb < 0 and self.cache_local_mb != AUTO:
            raise SystemExit(f"--cache-local-mb must be >= 0 or -1 (auto), got {self.cache_local_mb}")
        if self.cache_max_value_mb < 0 or self.cache_memory_mb <= 0:
            raise SystemExit("cache sizes must be >= 0 (--cache-memory-mb > 0)")
        if self.cache_write_behind_mb <= 0 or self.cache_write_wait_s <= 0:
            raise SystemExit("--cache-write-behind-mb and --cache-write-wait-s must be > 0")
        if min(self.cache_write_queue, self.cache_lookup_batch, self.cache_fetch_connections) < 1:
            raise SystemExit("--cache-write-queue, --cache-lookup-batch and --cache-fetch-connections must be >= 1")
        if not 1 <= self.cache_fetch_batch_pages <= MAX_FETCH_BATCH_PAGES:
            raise SystemExit(
                f"--cache-fetch-batch-pages must be in 1..{MAX_FETCH_BATCH_PAGES}, got {self.cache_fetch_batch_pages}"
            )
        if self.cache_fetch_race not in ("auto", "on", "off"):
            raise SystemExit(f"--cache-fetch-race must be auto, on or off, got {self.cache_fetch_race!r}")
        if self.cache_fetch_process not in ("auto", "on", "off"):
            raise SystemExit(f"--cache-fetch-process must be auto, on or off, got {self.cache_fetch_process!r}")
        if self.cache_fetch_arena_mb <= 0:
            raise SystemExit(f"--cache-fetch-arena-mb must be > 0, got {self.cache_fetch_arena_mb}")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise SystemExit(f"--redis-url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")

    def fetch_race_device(self, device: torch.device) -> torch.device | None:
        """The engine device whose prompts race the store's pages (`PrefixPolicy(fetch_device=)`), None: no race."""
        race = self.cache_fetch_race == "on" or (self.cache_fetch_race == "auto" and device.type == "cuda")
        return device if race else None

    def fetch_process_arena(self, race_device: torch.device | None) -> tuple[int, bool] | None:
        """(arena bytes, pinned) of the fetch helper process for an engine racing on `race_device`; None: no helper
        (no race, or --cache-fetch-process off / auto on CPU)."""
        if race_device is None:
            return None
        cuda = race_device.type == "cuda"
        if self.cache_fetch_process == "off" or (self.cache_fetch_process == "auto" and not cuda):
            return None
        return int(self.cache_fetch_arena_mb * MiB), cuda

    def local_tier_mb(self, available_bytes: int | None = None) -> float:
        """The local tier's size in MiB: as given, or for auto (-1) a share of `available_bytes` (default: what
        this host / cgroup has available now), clamped to [AUTO_LOCAL_MIN_MB, AUTO_LOCAL_MAX_MB]."""
        if self.cache_local_mb != AUTO:
            return self.cache_local_mb
        if available_bytes is None:
            available_bytes = available_memory_bytes()
        if available_bytes is None:
            return AUTO_LOCAL_MIN_MB
        return min(AUTO_LOCAL_MAX_MB, max(AUTO_LOCAL_MIN_MB, available_bytes * AUTO_LOCAL_SHARE / MiB))
