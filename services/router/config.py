"""Router configuration: one TOML file (`--config FILE`), PDSERVE_ROUTER_* environment variables, CLI flags.

Precedence: flag > environment > file > default. See docs/router.md for what each group of settings does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.router.limits import RouterLimits  # limits: request size bounds, prompt-cache sharing
from pdserve.router.tools.formats import FORMATS as TOOL_FORMATS
from pdserve.server.service_config import ServerOptions, opt

POLICIES = ("pcs", "round_robin", "least_requests")
FALLBACK_MODES = ("length_only", "max_tokens")
DECODE_CHOICES = ("least", "p2c")


@dataclass
class RouterConfig(RouterLimits, ServerOptions):
    config: str = opt("", "TOML file with any of these settings (flags and PDSERVE_ROUTER_* override it)")
    model: str = opt("", "HF model directory (the router loads its tokenizer and config only): the default model")
    served_model_name: str = opt(
        "",
        "the name requests use for --model (default: its hub id or directory name); instances that name no model "
        "and the static lists serve it, others announce their own (docs/router.md: several models)",
    )
    max_models: int = opt(8, "served models whose tokenizer the router keeps loaded (least recently used unloaded)")
    tool_call_parser: str = opt(
        "", "tool-call format of the model's output: hermes | llama3_json | mistral ('' = from its chat template)"
    )
    prefill: list[str] = field(default_factory=list, metadata={"help": "static prefill instances host:port (repeat)"})
    decode: list[str] = field(default_factory=list, metadata={"help": "static decode instances host:port (repeat)"})
    colocated: list[str] = field(
        default_factory=list,
        metadata={"help": "static colocated instances host:port (repeat; they prefill and decode themselves)"},
    )
    default_timeout_s: float = opt(600.0, "deadline applied when the client sets none")
    prefill_head_start: bool = opt(
        True,
        "start each request's prefill beside its dispatch to decode (Prefill.Start; decode's stream takes it over): "
        "the first chunk begins one hop sooner. Off: prefill starts when decode's stream reaches it",
    )
    policy: str = opt("pcs", "assignment policy: pcs | round_robin | least_requests (baselines)")
    # PCS = w_in·input_len + w_out·estimated_output_len + w_special·num_special_tokens
    pcs_w_in: float = opt(0.3, "PCS weight of input length")
    pcs_w_out: float = opt(0.5, "PCS weight of estimated output length")
    pcs_w_special: float = opt(1.2, "PCS weight of special tokens")
    pcs_fallback_mode: str = opt(
        "length_only", "output estimate while the estimator is cold or its error is high: length_only | max_tokens"
    )
    # online output-length estimator
    estimator_store: str = opt(
        "", "where the estimator persists: '' (a file in the cache dir), PATH, redis://HOST:PORT/DB, or memory"
    )
    estimator_min_samples: int = opt(50, "completed requests before the learned estimate is used")
    estimator_max_error: float = opt(0.5, "running relative error above which the fallback is used")
    estimator_save_interval_s: float = opt(10.0, "how often a changed estimator is persisted")
    # priority: ordering value = PCS / multiplier − aging·seconds waited (lowest first)
    priority_high: float = opt(1.5, "urgency multiplier of high-priority requests (their PCS counts 1/1.5)")
    priority_normal: float = opt(1.0, "urgency multiplier of normal requests")
    priority_low: float = opt(0.5, "urgency multiplier of low-priority requests")
    priority_aging_pcs_per_s: float = opt(100.0, "ordering value (PCS) a queued request gains per second waited")
    # admission (docs/router.md): prefill work within a TTFT budget at each instance's measured rate, decode
    # requests within each instance's KV pool
    ttft_budget_ms: float = opt(
        350.0, "prefill work queued per prefill instance: at most this long at its measured tokens/s"
    )
    prefill_floor_tokens: int = opt(
        4096, "prompt tokens a prefill instance may always have queued (all it gets before it measured its rate)"
    )
    # SLO-aware admission (docs/router.md, pdserve.router.slo): per instance, the budgets above are scaled down
    # while the observed percentile of TTFT / TPOT over the window exceeds the target, and back up when below
    slo_ttft_ms: float = opt(350.0, "TTFT target (router arrival to first token), ms")
    slo_tpot_ms: float = opt(15.0, "TPOT target ((last - first token time) / (tokens - 1)), ms")
    slo_percentile: float = opt(90.0, "percentile of the window's samples held to the targets")
    slo_window_s: float = opt(30.0, "sliding window of TTFT / TPOT samples per instance, seconds")
    slo_min_samples: int = opt(10, "samples since the last change before the controller acts on them")
    slo_interval_s: float = opt(1.0, "shortest time between two controller updates, seconds")
    slo_decrease: float = opt(0.7, "budget factor multiplier when the observed percentile exceeds the target")
    slo_increase: float = opt(0.05, "budget factor step back up when it is below target × slo_relax_below")
    slo_relax_below: float = opt(0.8, "relax only when the observed percentile is below target × this (hysteresis)")
    slo_min_factor: float = opt(0.05, "lowest budget factor")
    slo_control: bool = opt(True, "adjust the admission budgets (false: observe and export the metrics only)")
    # relative load of the assignment policy (PCS units)
    prefill_capacity_pcs: float = opt(8192.0, "PCS that count as a fully loaded prefill instance (policy)")
    decode_capacity_pcs: float = opt(0.0, "PCS that count as a fully loaded decode instance (0 = from its KV pool)")
    batch_utilization_threshold: float = opt(
        0.8, "prefix affinity holds while its instance's PCS load stays within capacity × this"
    )
    max_queue: int = opt(1024, "most requests waiting in the router queue")
    max_queue_wait_s: float = opt(30.0, "longest a request waits in the queue before RESOURCE_EXHAUSTED")
    # assignment
    affinity: bool = opt(True, "send prompts with the same leading page to the same prefill instance")
    affinity_slack_pcs: float = opt(
        512.0, "affinity holds while its instance is at most this far above the least-loaded one"
    )
    prefill_max_inflight_tokens: int = opt(
        4096,
        "a prefill instance gets no new request while this many prompt "
        "tokens sent to it await their first token (0 = no limit)",
    )
    decode_choice: str = opt("least", "decode pick among all candidates (least) or two random ones (p2c)")
    decode_active_norm: float = opt(64.0, "active sequences that weigh as much as a full KV pool")
    max_attempts: int = opt(
        3,
        "tries of a request whose prefill/decode pair fails UNAVAILABLE (before its first "
        "token: retried; after: resumed where the stream is)",
    )
    seed: int = opt(0, "seed of the router's random choices (p2c)")
    # membership
    health_interval_s: float = opt(1.0, "grpc.health.v1 check period per instance")
    health_timeout_s: float = opt(1.0, "deadline of one health check")
    unhealthy_after: int = opt(2, "consecutive failed checks that mark an instance down")
    stats_interval_s: float = opt(0.5, "decode Stats (free KV pages, active sequences) poll period")
    heartbeat_interval_s: float = opt(1.0, "heartbeat period asked of registered instances")
    lease_s: float = opt(5.0, "a registered instance silent for this long is marked down")
    remove_after_s: float = opt(30.0, "a registered instance down for this long is forgotten")
    # security (docs/security.md): the public port serves Generation, the internal port the Registry
    internal_port: int = opt(0, "port of the internal Registry service (engines' --router points here; 0 = any free)")
    auth_tokens_file: str = opt(
        "",
        "bearer tokens of the public API: lines `token tenant` or JSON {token: tenant} ($PDSERVE_AUTH_TOKENS; "
        "none: auth off, every caller is tenant default)",
    )
    max_receive_mb: float = opt(4.0, "largest request message on the public port, MiB (larger: RESOURCE_EXHAUSTED)")
    internal_max_receive_mb: float = opt(4.0, "largest message on the internal port, MiB")

    def default_max_streams(self) -> int:  # security: the queue plus the running requests, so admission decides
        return self.max_queue + 512

    def validate(self) -> None:
        problems = []
        if not self.model:
            problems.append("--model is required (the router needs the tokenizer)")
        for name, value, allowed in (
            ("policy", self.policy, POLICIES),
            ("pcs_fallback_mode", self.pcs_fallback_mode, FALLBACK_MODES),
            ("decode_choice", self.decode_choice, DECODE_CHOICES),
        ):
            if value not in allowed:
                problems.append(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
        if not 0 < self.batch_utilization_threshold <= 1:
            problems.append(f"batch_utilization_threshold must be in (0, 1], got {self.batch_utilization_threshold}")
        if not self.ttft_budget_ms > 0 or not self.prefill_floor_tokens > 0:
            problems.append("ttft_budget_ms and prefill_floor_tokens must be > 0")
        for name in ("prefill_capacity_pcs", "decode_capacity_pcs", "priority_aging_pcs_per_s", "affinity_slack_pcs"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0")
        if self.prefill_capacity_pcs == 0:
            problems.append("prefill_capacity_pcs must be > 0")
        for name in (
            "priority_high",
            "priority_normal",
            "priority_low",
            "max_attempts",
            "max_queue",
            "health_interval_s",
            "health_timeout_s",
            "unhealthy_after",
            "stats_interval_s",
            "heartbeat_interval_s",
            "lease_s",
            "max_queue_wait_s",
            "decode_active_norm",
            "max_models",
        ):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0")
        for name in ("slo_ttft_ms", "slo_tpot_ms", "slo_window_s", "slo_interval_s", "slo_min_samples"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0")
        if not 0 < self.slo_percentile <= 100:
            problems.append(f"slo_percentile must be in (0, 100], got {self.slo_percentile}")
        if not (0 < self.slo_decrease < 1 and 0 < self.slo_min_factor <= 1 and self.slo_increase > 0):
            problems.append("slo_decrease must be in (0, 1), slo_min_factor in (0, 1], slo_increase > 0")
        if not 0 < self.slo_relax_below <= 1:
            problems.append(f"slo_relax_below must be in (0, 1], got {self.slo_relax_below}")
        if len(self.served_model_name) > 256 or not self.served_model_name.isprintable():
            problems.append("served_model_name must be at most 256 printable characters")
        if self.tool_call_parser and self.tool_call_parser not in TOOL_FORMATS:
            problems.append(f"tool_call_parser must be one of {', '.join(TOOL_FORMATS)} or empty")
        problems += self.limit_problems()  # limits
        problems += self.server_problems()  # security
        if not self.internal_max_receive_mb > 0:  # security
            problems.append("internal_max_receive_mb must be > 0")
        if problems:
            raise SystemExit("router config: " + "; ".join(problems))

    def slo_settings(self):
        """The SLO controller's settings (pdserve.router.slo.SloSettings)."""
        from pdserve.router.slo import SloSettings

        return SloSettings(
            ttft_s=self.slo_ttft_ms / 1e3,
            tpot_s=self.slo_tpot_ms / 1e3,
            percentile=self.slo_percentile,
            window_s=self.slo_window_s,
            min_samples=self.slo_min_samples,
            interval_s=self.slo_interval_s,
            decrease=self.slo_decrease,
            increase=self.slo_increase,
            relax_below=self.slo_relax_below,
            min_factor=self.slo_min_factor,
            control=self.slo_control,
        )


ENV_PREFIX = "PDSERVE_ROUTER_"
