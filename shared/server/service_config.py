"""The settings every service process shares (`ServerOptions`) and those of the engine services (prefill, decode,
colocated: `EngineServiceConfig`, holding the engine's own `EngineConfig`); each service subclasses one into its
config, filled by `pdserve.config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.config import nested, opt
from pdserve.engine.config import EngineConfig

__all__ = ["EngineServiceConfig", "ServerOptions", "engine_settings", "kv_link_problems", "opt"]


@dataclass
class ServerOptions:
    host: str = opt("127.0.0.1", "interface to bind")
    port: int = opt(0, "port to bind (0 = any free port)")
    ready_file: str = opt("", "write {service, address, pid} JSON here once serving")
    log_level: str = opt("INFO", "logging level")
    metrics_port: int = opt(0, "Prometheus /metrics HTTP port on --host (0 = any free port, -1 = off)")
    # thread budget (pdserve.server.stream_gate): worker threads = max_streams + control_threads
    max_streams: int = opt(
        0,
        "long RPCs (generation / KV streams) in progress at once, each holding a thread; beyond: RESOURCE_EXHAUSTED "
        "at once (0 = the service's default, tied to its admission limits)",
    )
    control_threads: int = opt(16, "threads reserved for health checks, Stats and Registry calls (never streams)")
    max_receive_mb: float = opt(64.0, "largest message this service's port accepts, MiB (larger: RESOURCE_EXHAUSTED)")
    drain_grace_s: float = opt(
        15.0, "on SIGTERM: how long in-flight streams may run on; then they end with UNAVAILABLE (shutting down)"
    )
    gc_freeze: bool = opt(
        True,
        "once ready, freeze the start-up heap out of the garbage collector (full collections then walk only what "
        "was made since: short pauses; pdserve.server.gc_pauses)",
    )
    gc_warn_ms: float = opt(50.0, "log a garbage-collection pause longer than this, ms (0: never)")
    # security (docs/security.md)
    tls_cert: str = opt("", "PEM certificate (chain) this service presents; TLS on when set ($PDSERVE_TLS_CERT)")
    tls_key: str = opt("", "PEM private key of --tls-cert ($PDSERVE_TLS_KEY)")
    tls_ca: str = opt(
        "",
        "PEM internal CA: internal callers need a client certificate from it, peers are verified with it "
        "($PDSERVE_TLS_CA)",
    )
    tls_server_name: str = opt(
        "",
        "name internal peers' certificates are verified against instead of the host dialed, e.g. one SAN for "
        "pods dialed by IP ($PDSERVE_TLS_SERVER_NAME)",
    )
    internal_token_file: str = opt(
        "",
        "file with the internal token internal RPCs must carry ($PDSERVE_INTERNAL_TOKEN_FILE or the token in "
        "$PDSERVE_INTERNAL_TOKEN)",
    )
    insecure: bool = opt(
        False, "allow plaintext on a non-loopback address and internal ports without any internal identity"
    )

    def default_max_streams(self) -> int:
        """`max_streams` when 0 (services override: the limit follows their admission)."""
        return 64

    def stream_limit(self) -> int:
        return self.max_streams if self.max_streams > 0 else self.default_max_streams()

    def server_problems(self) -> list[str]:
        problems = []
        if self.max_streams < 0 or self.control_threads < 1:
            problems.append("--max-streams must be >= 0 and --control-threads >= 1")
        if not self.max_receive_mb > 0 or self.drain_grace_s < 0:
            problems.append("--max-receive-mb must be > 0 and --drain-grace-s >= 0")
        if self.gc_warn_ms < 0:
            problems.append("--gc-warn-ms must be >= 0")
        return problems


def engine_settings(helps: dict[str, str] | None = None, **defaults: Any) -> Any:
    """The `engine` field of an engine service's config: EngineConfig's fields as this service's settings of the
    same names (`--model` fills model_dir; no model until one is given). Every other default is EngineConfig's own
    (`--kv-dtype` int8 among them); `defaults` and `helps` add a service's own."""
    return nested(
        EngineConfig,
        names={"model_dir": "model"},
        defaults={"model_dir": "", **defaults},
        helps=helps,
    )


@dataclass
class EngineServiceConfig(ServerOptions):
    """What prefill, decode and colocated instances share: the server options, the engine they run (`engine`, read
    by the engine as it is) and how the process runs it."""

    engine: EngineConfig = engine_settings()
    request_timeout_s: float = opt(600.0, "upper bound on any request without a client deadline")
    torch_threads: int = opt(0, "CPU threads for torch (0 = torch's default); 1 suits several instances per host")
    gil_switch_interval_us: float = opt(
        0.0,
        "the longest the engine thread waits for the GIL while another thread of the process runs Python, "
        "microseconds (pdserve.server.gil; 0 = CPython's 5000: 200 measured no better on an H200, "
        "docs/benchmarks.md)",
    )
    gpu_share_file: str = opt(
        "",
        "a file the prefill and decode engines sharing one GPU both map (`pdserve up` sets it on a shared GPU): "
        "prefill marks its steps there, decode holds its steps back meanwhile within --yield-tpot-ms "
        "(pdserve.engine.gpu_share)",
    )
    warmup: bool = opt(
        True,
        "run throwaway requests through the engine before reporting ready, so that no request pays first-use "
        "costs (kernel compiles, library handles)",
    )
    router: str = opt("", "router host:port to register with and heartbeat to (empty: the router's static list)")
    served_model_name: str = opt(
        "", "the model name announced to the router, which requests use (default: the --model hub id or directory name)"
    )

    @property
    def model(self) -> str:
        """The model directory (`--model`), as the router's config names it."""
        return self.engine.model_dir

    @model.setter
    def model(self, value: str) -> None:
        self.engine.model_dir = value

    def default_max_streams(self) -> int:
        """Decode (and colocated): a running batch plus as many waiting (the router admits by KV pages)."""
        return 2 * self.engine.max_num_seqs

    def validate(self) -> None:
        """Server options, then the engine's own check (EngineConfig.validate: its ValueError names the setting;
        `pdserve.config` reports it in flag terms)."""
        problems = self.server_problems()
        if problems:
            raise SystemExit("; ".join(problems))
        if not 0 <= self.gil_switch_interval_us <= 1e6:
            raise SystemExit(f"--gil-switch-interval-us must be in [0, 1000000], got {self.gil_switch_interval_us:g}")
        if not self.engine.model_dir:
            raise SystemExit("--model is required (a local HF model directory)")
        self.engine.validate()


def kv_link_problems(
    kv_transport: str, kv_copy_threads: int, kv_shipper: str, kv_shipper_arena_mb: float, kv_shippers: int
) -> list[str]:
    """What is wrong with the KV link settings prefill and decode both have (`--kv-transport`, `--kv-copy-threads`,
    `--kv-shipper`, `--kv-shipper-arena-mb`, `--kv-shippers`)."""
    from pdserve.kv.transfer.modes import MAX_SHIPPERS, MODES, SHIPPER_MODES

    problems = []
    if kv_copy_threads < 0:
        problems.append(f"--kv-copy-threads must be >= 0, got {kv_copy_threads}")
    if kv_transport not in MODES:
        problems.append(f"--kv-transport must be one of {', '.join(MODES)}, got {kv_transport!r}")
    if kv_shipper not in SHIPPER_MODES:
        problems.append(f"--kv-shipper must be one of {', '.join(SHIPPER_MODES)}, got {kv_shipper!r}")
    if not kv_shipper_arena_mb > 0:
        problems.append(f"--kv-shipper-arena-mb must be > 0, got {kv_shipper_arena_mb}")
    if not 1 <= kv_shippers <= MAX_SHIPPERS:
        problems.append(f"--kv-shippers must be in 1..{MAX_SHIPPERS}, got {kv_shippers}")
    return problems
