"""Fields every engine-backed service (prefill, decode) shares; each service subclasses into its own config."""
from __future__ import annotations

from dataclasses import dataclass, field


def opt(default, help: str):  # noqa: A002 - mirrors argparse's name
    """A dataclass field with CLI help text."""
    return field(default=default, metadata={"help": help})


@dataclass
class ServerOptions:
    host: str = opt("127.0.0.1", "interface to bind")
    port: int = opt(0, "port to bind (0 = any free port)")
    ready_file: str = opt("", "write {service, address, pid} JSON here once serving")
    max_workers: int = opt(64, "RPC worker threads")
    max_concurrent_rpcs: int = opt(256, "RPCs beyond this get RESOURCE_EXHAUSTED")
    log_level: str = opt("INFO", "logging level")
    metrics_port: int = opt(0, "Prometheus /metrics HTTP port on --host (0 = any free port, -1 = off)")


@dataclass
class EngineOptions(ServerOptions):
    model: str = opt("", "HF model directory (config.json, *.safetensors, tokenizer files)")
    dtype: str = opt("auto", "auto|float32|bfloat16|float16 (auto: float32 on CPU, checkpoint dtype on GPU)")
    device: str = opt("auto", "auto|cpu|cuda")
    page_size: int = opt(16, "tokens per KV page")
    chunk_size: int = opt(2048, "prefill chunk size in tokens")
    num_pages: int = opt(0, "KV pool pages (0 = auto)")
    max_num_seqs: int = opt(64, "largest decode batch")
    kv_dtype: str = opt("int8", "int8|auto: KV page format shipped prefill→decode and stored by decode")
    kv_group_size: int = opt(64, "int8 KV quantization group size along head_dim")
    attention_backend: str = opt("auto", "auto|fa3|sdpa")
    request_timeout_s: float = opt(600.0, "upper bound on any request without a client deadline")
    torch_threads: int = opt(0, "CPU threads for torch (0 = torch's default); 1 suits several instances per host")
    router: str = opt("", "router host:port to register with and heartbeat to (empty: the router's static list)")

    def validate(self) -> None:
        if not self.model:
            raise SystemExit("--model is required (a local HF model directory)")
        if self.kv_dtype not in ("int8", "auto"):
            raise SystemExit(f"--kv-dtype must be int8 or auto, not {self.kv_dtype!r}")
