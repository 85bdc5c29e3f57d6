"""Fields every engine-backed service (prefill, decode) shares; each service subclasses into its own config."""

from __future__ import annotations

from dataclasses import dataclass, field


def opt(default, help: str):
    """A dataclass field with CLI help text."""
    return field(default=default, metadata={"help": help})


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
        return problems


@dataclass
class EngineOptions(ServerOptions):
    model: str = opt("", "HF model directory (config.json, *.safetensors, tokenizer files)")
    dtype: str = opt("auto", "auto|float32|bfloat16|float16 (auto: float32 on CPU, checkpoint dtype on GPU)")
    device: str = opt("auto", "auto|cpu|cuda|cuda:N (auto: cuda if available)")
    page_size: int = opt(16, "tokens per KV page")
    chunk_size: int = opt(2048, "prefill chunk size in tokens")
    num_pages: int = opt(0, "KV pool pages (0 = auto)")
    max_num_seqs: int = opt(64, "largest decode batch")
    kv_dtype: str = opt(
        "int8", "int8|fp8|auto: KV page format shipped prefill→decode and stored by decode (fp8: e4m3, scale per head)"
    )
    kv_group_size: int = opt(64, "int8 KV quantization group size along head_dim")
    attention_backend: str = opt("auto", "auto|fa3|sdpa")
    # GPU engine knobs (EngineConfig fields of the same names; CPU ignores them)
    triton: bool = opt(True, "CUDA: Triton kernels (fused model path, int8 KV); false: plain torch ops as on CPU")
    pdl: bool = opt(True, "launch Triton kernels as programmatic dependent launches where supported (sm90+)")
    gemv_plan: str = opt("default", "decode GEMVs: default|cublas|triton or JSON {projection: config|null}")
    int8_decode_kernel: str = opt("triton", "FA3 + int8 pool, decode: triton|dequant")
    dense_decode_kernel: str = opt("triton", "FA3 + dense pool, decode: triton|fa3")
    dense_prefill_kernel: str = opt("paged", "FA3 + dense pool, prefill: paged|gather")
    fa3_num_splits: int = opt(4, "FA3 decode split count (0: FA3's heuristic)")
    decode_kernel_config: str = opt("", "JSON overrides of the Triton decode-attention kernel config")
    cuda_graphs: bool = opt(True, "decode through CUDA graphs (CUDA + FA3 + fused path)")
    cuda_graph_max_context: int = opt(0, "context the decode CUDA graphs cover (0: the model's whole context)")
    gpu_memory_utilization: float = opt(
        0.85, "GPU: fraction of the device's total memory this instance may fill (weights + KV pool)"
    )
    request_timeout_s: float = opt(600.0, "upper bound on any request without a client deadline")
    batch_invariant: bool = opt(
        False,
        "a request's tokens independent of batch mates, chunking and prompt-cache hits with quantized KV (CPU: "
        "fixed-size GEMM row blocks; CUDA: a row-independent Triton GEMM; both: row-wise prefill attention, prefill "
        "pool in the shipped KV format); slower (H200, int8, 8B: decode b64 1.19x, 2k prefill 3.6x)",
    )
    overlap_decode: str = opt(
        "auto",
        "auto|on|off: greedy decode launches the next step of an unchanged batch before processing this step's "
        "tokens, so the host's per-token work runs beside the GPU's next step (auto: with the decode CUDA graphs; "
        "H200, 8B shape, b128 ctx2k: 7.9 -> 6.1 ms per step at 16 layers)",
    )
    torch_threads: int = opt(0, "CPU threads for torch (0 = torch's default); 1 suits several instances per host")
    warmup: bool = opt(
        True,
        "run throwaway requests through the engine before reporting ready, so that no request pays first-use "
        "costs (kernel compiles, library handles)",
    )
    router: str = opt("", "router host:port to register with and heartbeat to (empty: the router's static list)")

    def engine_config(self, pool_kv_dtype: str):
        """The EngineConfig of this instance; `pool_kv_dtype` is what its KV pool stores."""
        from pdserve.engine.config import EngineConfig

        return EngineConfig(
            model_dir=self.model,
            dtype=self.dtype,
            device=self.device,
            page_size=self.page_size,
            chunk_size=self.chunk_size,
            num_pages=self.num_pages,
            max_num_seqs=self.max_num_seqs,
            kv_dtype=pool_kv_dtype,
            kv_group_size=self.kv_group_size,
            kv_asymmetric=getattr(self, "kv_asymmetric", False),
            attention_backend=self.attention_backend,
            triton=self.triton,
            pdl=self.pdl,
            gemv_plan=self.gemv_plan,
            int8_decode_kernel=self.int8_decode_kernel,
            dense_decode_kernel=self.dense_decode_kernel,
            dense_prefill_kernel=self.dense_prefill_kernel,
            fa3_num_splits=self.fa3_num_splits,
            decode_kernel_config=self.decode_kernel_config,
            cuda_graphs=self.cuda_graphs,
            cuda_graph_max_context=self.cuda_graph_max_context,
            gpu_memory_utilization=self.gpu_memory_utilization,
            batch_invariant=self.batch_invariant,
            overlap_decode=self.overlap_decode,
        )

    def default_max_streams(self) -> int:
        """Decode (and colocated): a running batch plus as many waiting (the router admits by KV pages)."""
        return 2 * self.max_num_seqs

    def validate(self) -> None:
        problems = self.server_problems()
        if problems:
            raise SystemExit("; ".join(problems))
        if not self.model:
            raise SystemExit("--model is required (a local HF model directory)")
        if self.kv_dtype not in ("int8", "fp8", "auto"):
            raise SystemExit(f"--kv-dtype must be int8, fp8 or auto, not {self.kv_dtype!r}")
