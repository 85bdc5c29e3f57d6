"""Router configuration (CLI flags or PDSERVE_ROUTER_* environment variables)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.service_config import ServerOptions, opt


@dataclass
class RouterConfig(ServerOptions):
    model: str = opt("", "HF model directory (the router loads its tokenizer and config only)")
    prefill: list[str] = field(default_factory=list, metadata={"help": "prefill instances host:port (repeat)"})
    decode: list[str] = field(default_factory=list, metadata={"help": "decode instances host:port (repeat)"})
    pcs_w_in: float = opt(0.3, "PCS weight of input length")
    pcs_w_out: float = opt(0.5, "PCS weight of estimated output length")
    pcs_w_special: float = opt(1.2, "PCS weight of special tokens")
    default_timeout_s: float = opt(600.0, "deadline applied when the client sets none")

    def validate(self) -> None:
        if not self.model:
            raise SystemExit("--model is required (the router needs the tokenizer)")
        if not self.prefill or not self.decode:
            raise SystemExit("at least one --prefill and one --decode instance are required")


ENV_PREFIX = "PDSERVE_ROUTER_"
