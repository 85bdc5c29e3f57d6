"""ModelRunner: every tensor of the engine. It resolves the device and dtype, chooses the kernels, loads the
model, sizes and owns the paged KV pool, picks the attention backend, captures the decode CUDA graphs, and per
step builds the model inputs, runs the graph or the eager model, and samples on the device with per-request
generators. It also moves pages in and out of the pool.

The engine (`pdserve.engine.engine`) hands it sequences and integers (page ids, token counts) and never touches
a tensor, except the logits rows it returns on request (`return_logits`).

Tensor parallel (`EngineConfig.tensor_parallel_size` N > 1, `pdserve.engine.tp`): the instance's runner is rank 0;
it starts ranks 1..N-1 (`tp.supervisor`), loads its shard, sizes its pool with its own KV heads, and broadcasts
every forward (`_forward`), every logits block (`_logits`), every page copy and every imported page batch (of all
KV heads: each rank keeps its own) so that the followers (`tp.follower`, the same runner on their shard) run the
same steps; page exports gather every rank's heads back into pages of every KV head (`tp.page_export`). On CUDA
every rank captures the decode graphs with the NCCL collectives inside, and each replay is broadcast so that the
followers replay theirs with it (`tp.graph_step`).
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from pdserve.engine.attention import AttentionMetadata, select_backend
from pdserve.engine.config import (
    CPU_KV_CACHE_BYTES,
    CUDA_CONTEXT_BYTES,
    EngineConfig,
    dtype_name,
    gpu_kv_pool_bytes,
    resolve_device,
    resolve_dtype,
)
from pdserve.engine.cuda_graphs import GRAPH_BACKENDS, graph_context, make_decode_graph_runner
from pdserve.engine.host_to_device import to_device
from pdserve.engine.kernel_choice import KernelChoice
from pdserve.engine.kv_cache import KVCache, QuantizedKVCache
from pdserve.engine.loader import ModelConfig
from pdserve.engine.logits_processors import LogitsPlan, masked_logits
from pdserve.engine.model import load_model
from pdserve.engine.prefill_graphs import PrefillGraphRunner, make_prefill_graph_runner
from pdserve.engine.sampling import (
    SamplingParams,
    TokenLogprob,
    make_generator,
    sample,
    skip_draws,
    token_logprobs,
)
from pdserve.engine.sequence import Sequence
from pdserve.engine.structured import MaskedDraw, MaskFiller
from pdserve.engine.tp.layout import local_config, make_layout
from pdserve.errors import InvalidRequest
from pdserve.kv.dtypes import DTYPES
from pdserve.kv.payload import CachedUpload, PagePayload

if TYPE_CHECKING:
    from pdserve.engine.tp.layers import RankShard
    from pdserve.engine.tp.page_export import LayerExport
    from pdserve.engine.tp.supervisor import RankSupervisor
    from pdserve.engine.tp.worker import PlanLeader

log = logging.getLogger("pdserve.engine")

PROMPT_LOGPROB_BLOCK = 256  # prompt rows per logits block (a [256, vocab] float32 at a time)


def synchronize(event: torch.cuda.Event) -> None:
    """Block until `event` (recorded on the runner's stream) has completed; releases the GIL meanwhile."""
    event.synchronize()


class DecodeLaunch:
    """A queued greedy decode step's tokens: `tokens()` waits for them (through `wait`, the runner's `gpu_wait`).
    With structured-output rows (`masked`) the forward is queued first and the draw among the grammar's tokens once
    the masks are filled (`sample`)."""

    def __init__(
        self,
        greedy: torch.Tensor | None,
        done: torch.cuda.Event | None,
        masked: MaskedDraw | None = None,
        wait: Callable[[torch.cuda.Event], None] = synchronize,
    ):
        self._greedy = greedy  # [B] int64 (pinned host memory on CUDA)
        self._done = done
        self._masked = masked
        self._wait = wait

    def start_masks(self) -> None:
        """Start filling the grammar masks (once the host has fed the sequences' previous tokens to them)."""
        if self._masked is not None:
            self._masked.start()

    def sample(self) -> None:
        """Queue the masked draw (waits for the masks); a no-op without grammar rows or when done already."""
        if self._masked is not None:
            self._greedy, self._done = self._masked.finish()
            self._masked = None

    def tokens(self) -> list[int]:
        self.sample()
        if self._done is not None:
            self._wait(self._done)
        assert self._greedy is not None
        return self._greedy.tolist()


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_config: ModelConfig, tp: RankShard | None = None):
        """`tp`: this process is a follower rank of a tensor-parallel instance (`tp.follower`); None with
        `cfg.tensor_parallel_size` > 1: this process is the instance, rank 0, and starts the followers."""
        self.cfg = cfg
        self.model_config = mc = model_config
        self.device = resolve_device(cfg.device)
        self.bind_thread()
        self.dtype = resolve_dtype(cfg.dtype, self.device, mc.torch_dtype)
        self.page_size = cfg.page_size
        # fp8: one scale per (token, KV head) (group = head_dim): e4m3's error is relative, so finer groups buy
        # little, and the fp8 decode kernel folds that one scale into the scores / probabilities
        self.kv_group_size = mc.head_dim if cfg.kv_dtype == "fp8" else min(cfg.kv_group_size, mc.head_dim)
        if mc.head_dim % self.kv_group_size:
            raise ValueError(f"kv_group_size {cfg.kv_group_size} does not divide head_dim {mc.head_dim}")
        self.kv_asymmetric = cfg.kv_asymmetric and cfg.kv_dtype == "int8"
        self.tp_size = cfg.tensor_parallel_size if tp is None else tp.layout.tp_size
        layout = make_layout(mc, self.tp_size) if self.tp_size > 1 else None  # the model splits: ValueError if not
        self._supervisor: RankSupervisor | None = None
        if layout is not None and tp is None:  # rank 0: start ranks 1..N-1 before loading anything
            from pdserve.engine.tp.layers import RankShard
            from pdserve.engine.tp.supervisor import RankSupervisor

            self._supervisor = RankSupervisor.start(cfg, self.device)
            assert self._supervisor.group is not None
            tp = RankShard(self._supervisor.group, layout)
        self.tp = tp
        self._leader: PlanLeader | None = None
        self.layer_exports: list[LayerExport] = []  # TP: the layer groups the next forward exports (`kv_handoff`)
        self.kv_sizing: dict[str, float] = {}  # GPU auto sizing: the numbers the pool was sized from (bytes)
        self.prefill_graphs: PrefillGraphRunner | None = None  # captured after the pool (`_load`)
        # recorded after each step's forward is queued: `device_busy` (None on CPU, where a launch computes)
        self._launched = torch.cuda.Event() if self.device.type == "cuda" else None
        try:
            self._load(cfg, mc, tp)
        except BaseException:
            if self._supervisor is not None:  # no follower outlives a failed start
                self._supervisor.stop(timeout_s=0.0)
            raise
        if self._supervisor is not None:
            self._lead(self._supervisor)
        self._seed_rng = torch.Generator().manual_seed(cfg.seed)  # seeds of requests without one
        self._generators: dict[str, torch.Generator] = {}  # sampled (non-greedy) live requests
        self._eos_token_ids = list(mc.eos_token_ids)  # banned before a request's min_tokens
        self._mask_filler: MaskFiller | None = None  # structured output in overlapped decode: masks' worker thread
        # how the engine thread waits for a decode step's tokens on the GPU: an EngineLoop replaces it with a wait
        # that serves its host-only commands meanwhile (loop.py); called on the engine thread only
        self.gpu_wait: Callable[[torch.cuda.Event], None] = synchronize
        self.launched_ns = 0  # epoch ns when the last `run` had queued its forward (on CPU: computed it)
        # the last `run`'s forward launch: wall ns from its start to `launched_ns`, and this thread's CPU ns in it (the
        # rest it spent blocked: on the GIL, or on a host-device sync)
        self.launch_wall_ns = 0
        self.launch_cpu_ns = 0
        self.layer_export_ns = 0  # the last forward's layer-group exports (kv_handoff's hook), wall ns
        self.launch_graph_tokens = 0  # the prefill graph bucket the last `run` replayed (0: eager or decode graphs)
        # steps by how their forward was launched (the engine thread writes, a metrics scrape reads)
        self.steps_launched = {"decode_graph": 0, "prefill_graph": 0, "eager": 0}

    def _load(self, cfg: EngineConfig, mc: ModelConfig, tp: RankShard | None) -> None:
        """Kernels, backend, the model (this rank's shard at TP > 1), the KV pool and the decode graphs."""
        local = mc if tp is None else local_config(mc, tp.rank)  # the shapes this rank's kernels see
        self.num_local_kv_heads = local.num_kv_heads  # KV heads of this rank's pool
        self.kernels = KernelChoice.select(cfg, self.device, local)
        self.backend, reason = select_backend(cfg.attention_backend, self.device, self.dtype, self.kernels)
        log.info(
            "attention backend: %s (%s); fused kernels %s, PDL %s",
            self.backend.name,
            reason,
            self.kernels.fused,
            self.kernels.pdl,
        )
        self.model = load_model(
            cfg.model_dir, mc, self.device, self.dtype, self.kernels, cfg.quantization, cfg.load_format, tp=tp
        )

        self.num_pages = cfg.num_pages or self._auto_num_pages()
        if tp is not None:  # one pool size on every rank (each sized its own from its device's memory)
            self.num_pages = tp.group.min_int(self.num_pages)
        self.kv_cache: KVCache = self._make_pool(self.num_pages)
        self.graph_runner = make_decode_graph_runner(
            self.model,
            self.kv_cache,
            self.backend,
            cfg.page_size,
            cfg.max_num_seqs,
            graph_context(mc.max_position_embeddings, cfg.cuda_graph_max_context, cfg.page_size),
            self.device,
            cfg.cuda_graphs,
            tp=None if tp is None else tp.group,  # TP: every rank captures here, its collectives inside the graphs
        )
        self.prefill_graphs = make_prefill_graph_runner(
            self.model,
            self.kv_cache,
            self.backend,
            self.device,
            cfg.graph_step_tokens(),
            self.graph_runner is not None,
            tp=tp,
        )

    # ---- tensor parallel (rank 0) ------------------------------------------------------------------------
    def _lead(self, supervisor: RankSupervisor) -> None:
        """Rank 0: every forward, logits block, page copy and page import (`scatter_pages`: pages of every KV head,
        each rank keeps its own) from now on is broadcast to the followers too (under the supervisor's guard: a
        failure ends the instance); page exports gather every rank's heads onto rank 0 (`gather_pages`: the pages of
        every KV head, as a TP=1 pool exports them). Single-page import (mixed-format cache pages) is refused."""
        from pdserve.engine.tp.page_export import leader_gather
        from pdserve.engine.tp.page_import import local_heads, payload_checker, send_scatter
        from pdserve.engine.tp.worker import PlanLeader, copy_message

        group = supervisor.group
        assert group is not None
        self._leader = leader = PlanLeader(self.model, self.kv_cache, self.backend, group, self.page_size)
        cache = self.kv_cache
        local_copy = cache.copy_pages

        def copy_pages(src: list[int], dst: list[int]) -> None:
            with supervisor.guard():
                group.broadcast_ints(copy_message(src, dst))
                local_copy(src, dst)

        local_scatter = cache.scatter_pages
        assert self.tp is not None
        heads = torch.tensor(self.tp.rank.kv_heads, dtype=torch.long)
        full, tp_layout = self.model_config.num_kv_heads, self.tp.layout

        def scatter_pages(
            page_ids: list[int],
            data: torch.Tensor,
            scales: torch.Tensor | None,
            zeros: torch.Tensor | None,
            group_size: int,
            layers: tuple[int, int] | None = None,
        ) -> None:
            """Pages of every KV head (a TP=1 prefill's): rank 0 writes its heads (the pool's checks refuse a bad
            batch before anything is broadcast), then every follower its own."""
            if any(t is not None and (t.dim() != 6 or t.shape[4] != full) for t in (data, scales, zeros)):
                raise InvalidRequest(
                    f"KV batch of shape {tuple(data.shape)}: a tensor-parallel pool imports pages of all {full} KV "
                    "heads ([pages, 2, layers, page_size, kv_heads, head_dim])"
                )
            mine = [local_heads(t, heads) for t in (data, scales, zeros)]
            assert mine[0] is not None
            local_scatter(page_ids, mine[0], mine[1], mine[2], group_size, layers)
            with supervisor.guard():
                send_scatter(group, tp_layout, page_ids, data, scales, zeros, group_size, layers)

        def refused(*args, **kwargs):
            raise RuntimeError(
                f"single-page KV import is not supported with tensor_parallel_size {self.tp_size} (each rank's pool "
                "holds its own heads; batches of whole pages are)"
            )

        # the engine, handoff and prompt cache call the pool directly: page copies and imports go through the group
        cache.copy_pages = copy_pages  # type: ignore[method-assign]
        cache.scatter_pages = scatter_pages  # type: ignore[method-assign]
        # exports: every rank gathers its heads, rank 0 assembles the pages of every KV head (`tp.page_export`)
        exporter = leader_gather(group, tp_layout, cache.gather_pages, supervisor.guard)
        cache.gather_pages = exporter  # type: ignore[method-assign]
        cache.import_page = refused  # type: ignore[method-assign]
        cache.check_payload = payload_checker(cache.check_payload, self.tp.rank.kv_heads, full)  # type: ignore[method-assign]
        if self.graph_runner is not None:  # each replay is a collective: the followers replay theirs with it
            from pdserve.engine.tp.graph_step import LeaderGraphs

            self.graph_runner = LeaderGraphs(self.graph_runner, group, supervisor.guard)  # type: ignore[assignment]
        supervisor.lead(leader)

    def _forward(
        self, ids: list[int], starts: list[int], q_lens: list[int], tables: list[list[int]], num_decode: int
    ) -> torch.Tensor:
        """One forward of the model over the pool -> hidden [T, hidden] (T = sum(q_lens)); at TP > 1 the
        followers run the same step."""
        if self._leader is not None:
            from pdserve.engine.tp.worker import StepPlan

            plan = StepPlan(ids, starts, q_lens, [list(t) for t in tables], num_decode, [], self.layer_exports)
            assert self._supervisor is not None
            with self._supervisor.guard():
                return self._leader.forward(plan)
        meta = AttentionMetadata(starts, q_lens, tables, self.page_size, self.device, num_decode)
        graphs = self.prefill_graphs
        if graphs is not None and graphs.can_run(len(ids)):
            self.launch_graph_tokens = graphs.bucket(len(ids))
            return graphs.forward(ids, meta)
        # the ids through pinned memory: a plain device copy would wait for the previous chunk's kernels
        return self.model(to_device(ids, torch.long, self.device), meta, self.kv_cache, self.backend)

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Logits [len(rows), V] float32 of `rows` of the last forward's hidden states."""
        if self._leader is not None:
            assert self._supervisor is not None
            with self._supervisor.guard():
                return self._leader.logits(hidden, rows)
        return self.model.compute_logits(hidden[rows])

    # ---- sizing ------------------------------------------------------------------------------------------
    def _make_pool(self, num_pages: int) -> KVCache:
        """A KV pool of `num_pages` pages in the configured format, this rank's KV heads."""
        cfg, mc = self.cfg, self.model_config
        shape = (mc.num_layers, num_pages, cfg.page_size, self.num_local_kv_heads, mc.head_dim, self.dtype, self.device)
        if self.kv_quantized:
            storage = DTYPES[cfg.kv_dtype].torch_dtype
            return QuantizedKVCache(*shape, self.kv_group_size, self.kv_asymmetric, quant=self.kernels, storage=storage)
        return KVCache(*shape, quant=self.kernels)

    def _activation_peak(self, context: int) -> int:
        """Bytes one step's activations, attention scratch and logits take at their peak on this GPU, measured on
        a temporary pool (memory_profile.py) for a sequence of `context` tokens. Tensor-parallel ranks are not
        profiled (their forwards are collectives of every rank): 0, the share's headroom covers them."""
        if self.tp is not None:
            return 0
        from pdserve.engine.memory_profile import measure_step_peak, profile_pages, step_tokens_bound

        cfg, mc = self.cfg, self.model_config
        step = step_tokens_bound(cfg)
        pages = profile_pages(min(step, context), cfg.page_size)
        self.kv_cache = self._make_pool(pages)
        try:
            return measure_step_peak(
                lambda ids, starts, q_lens, tables: self._forward(ids, starts, q_lens, tables, 0),
                self.model.compute_logits,
                self.device,
                step,
                context,
                max(cfg.max_num_seqs, PROMPT_LOGPROB_BLOCK),  # a decode batch's rows, or a prompt-logprobs block
                mc.vocab_size,
                cfg.page_size,
                pages,
            )
        finally:
            del self.kv_cache

    def _release_cached(self) -> tuple[int, int, int]:
        """Give the caching allocator's unused blocks back to the device, then (free, total, held) bytes: held is
        what this process keeps reserved plus its CUDA context (estimate). Loading frees what it no longer needs (a
        checkpoint's q/k/v and gate/up once concatenated, online quantization's and the dummy generator's
        temporaries), and so does the profile; kept reserved, those blocks would count as held and as not free."""
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return free, total, torch.cuda.memory_reserved(self.device) + CUDA_CONTEXT_BYTES

    @property
    def kv_quantized(self) -> bool:
        """Whether the pool stores quantized KV (kv_dtype int8 or fp8)."""
        return self.cfg.kv_dtype in ("int8", "fp8")

    def page_bytes(self) -> int:
        """Bytes of one KV page of this rank's pool (all layers, K and V, scales included)."""
        mc, cfg, kvh = self.model_config, self.cfg, self.num_local_kv_heads
        if self.kv_quantized:  # int8 and fp8 both hold one byte per value
            return QuantizedKVCache.int8_bytes_per_page(
                mc.num_layers, cfg.page_size, kvh, mc.head_dim, self.kv_group_size, self.kv_asymmetric
            )
        return KVCache.bytes_per_page(mc.num_layers, cfg.page_size, kvh, mc.head_dim, self.dtype)

    def _auto_num_pages(self) -> int:
        """Pages of `kv_cache_memory` when it names a size (either device); auto: on a GPU what
        `gpu_memory_utilization` leaves after this process's holdings, on CPU `CPU_KV_CACHE_BYTES` capped at
        max_num_seqs full-length sequences (the pool is reserved up front)."""
        budget, page = self.cfg.kv_cache_bytes(), self.page_bytes()
        if budget is None and self.device.type == "cuda":
            util, loaded_reserved = self.cfg.gpu_memory_utilization, torch.cuda.memory_reserved(self.device)
            free, total, held = self._release_cached()
            # the profiled sequence is as long as the model allows, but no longer than a pool could hold without
            # the peak (a longer one could never be scheduled)
            room = max(1, gpu_kv_pool_bytes(total, free, held, util) // page * self.cfg.page_size)
            peak = self._activation_peak(min(self.model_config.max_position_embeddings, room))
            free, total, held = self._release_cached()
            pages = gpu_kv_pool_bytes(total, free, held, util, peak) // page
            self.kv_sizing = dict(total=total, free=free, held=held, step_peak=peak, utilization=util,
                                  allocated=torch.cuda.memory_allocated(self.device),
                                  reserved_before_release=loaded_reserved)  # fmt: skip
            log.info(
                "KV pool: %d pages (%.1f GiB) = %.0f%% of %.1f GiB less %.1f GiB held (%.1f GiB tensors) and a "
                "%.2f GiB step peak, %.1f GiB free",
                max(0, pages),
                max(0, pages) * page / 2**30,
                util * 100,
                total / 2**30,
                held / 2**30,
                torch.cuda.memory_allocated(self.device) / 2**30,
                peak / 2**30,
                free / 2**30,
            )
            if pages <= 0:
                raise RuntimeError(
                    f"no GPU memory left for the KV pool on {self.device} ({free / 2**30:.1f} GiB free, this "
                    f"instance holds {held / 2**30:.1f} GiB and a step needs {peak / 2**30:.2f} GiB more of its "
                    f"{util:.0%} share of {total / 2**30:.1f} GiB)"
                )
            return pages
        if budget is None:
            per_seq = -(-self.model_config.max_position_embeddings // self.cfg.page_size)
            pages = min(self.cfg.max_num_seqs * per_seq, CPU_KV_CACHE_BYTES // page)
            why = f"auto on CPU: {CPU_KV_CACHE_BYTES >> 20} MiB, --kv-cache-memory to change"
        else:
            pages, why = budget // page, f"--kv-cache-memory {self.cfg.kv_cache_memory}"
        if pages < 1:
            raise ValueError(f"kv_cache_memory {self.cfg.kv_cache_memory} is less than one KV page ({page} bytes)")
        log.info(
            "KV pool: %d pages of %d tokens = %d tokens, %.0f MiB (%s)",
            pages,
            self.cfg.page_size,
            pages * self.cfg.page_size,
            pages * page / 2**20,
            why,
        )
        return pages

    def bind_thread(self) -> None:
        """Make this runner's GPU the calling thread's current CUDA device (Triton launches and graph capture
        use the current device); call it on every thread that runs the model. No-op on CPU."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def kv_description(self) -> str:
        if self.cfg.kv_dtype == "int8":
            return f"int8(g={self.kv_group_size},{'asym' if self.kv_asymmetric else 'sym'})"
        if self.cfg.kv_dtype == "fp8":
            return f"fp8_e4m3(g={self.kv_group_size})"
        return dtype_name(self.dtype)

    # ---- kernels -----------------------------------------------------------------------------------------
    def set_kernels(self, cfg: EngineConfig) -> None:
        """Re-choose the kernels from `cfg`'s GPU knobs on the loaded model (the bench compares kernels this way)
        and re-capture the decode graphs. Model, pool and sizes stay as loaded."""
        cfg.validate()
        kernels = KernelChoice.select(cfg, self.device, self.model_config)
        if self.graph_runner is not None and not kernels.fused:
            raise ValueError("decode CUDA graphs were captured on the fused path; it cannot be turned off now")
        self.cfg, self.kernels = cfg, kernels
        self.model.use_kernels(kernels)
        self.kv_cache.quant = kernels
        if self.backend.name in GRAPH_BACKENDS:  # the Triton/FA3 backends hold their kernel choices
            self.backend.kernels = kernels
        if self.graph_runner is not None:
            self.graph_runner.capture()
        if self.prefill_graphs is not None:
            self.prefill_graphs.capture()

    # ---- per-request generators --------------------------------------------------------------------------
    def add_request(self, request_id: str, sampling: SamplingParams, draws_to_skip: int = 0) -> None:
        """Seed the request's generator (its own seed, else one drawn from the engine seed) and advance it past
        `draws_to_skip` tokens sampled elsewhere. Greedy requests draw a seed too (so the seeds of later requests
        do not depend on which requests were greedy) but keep no generator."""
        seed = (
            sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        )
        if sampling.greedy:
            return
        g = make_generator(seed, self.device)
        skip_draws(g, self.model_config.vocab_size, draws_to_skip)
        self._generators[request_id] = g

    def skip_draws(self, request_id: str, n: int) -> None:
        """Advance a sampled request's generator past `n` tokens (no-op for greedy requests)."""
        g = self._generators.get(request_id)
        if g is not None:
            skip_draws(g, self.model_config.vocab_size, n)

    def drop_request(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    # ---- pages -------------------------------------------------------------------------------------------
    def check_payload(self, payload: PagePayload) -> None:
        """Raise InvalidRequest unless `payload` can be imported into this pool."""
        self.kv_cache.check_payload(payload)

    def import_page(self, physical_page: int, payload: PagePayload) -> None:
        self.kv_cache.import_page(physical_page, payload)

    def import_full_pages(self, physical_pages: list[int], payloads: list[PagePayload]) -> CachedUpload | None:
        """Write whole pages (all layers, `page_size` tokens, one format) in one host -> device copy per tensor and
        one scatter, instead of a handful of copies and kernels per page (a cached prefix of hundreds of pages).
        Returns that device copy, in the payloads' own format (None for mixed formats, imported page by page)."""
        if not payloads:
            return None
        first = payloads[0]
        if any(p.group_size != first.group_size or (p.zeros is None) != (first.zeros is None) for p in payloads):
            for page, p in zip(physical_pages, payloads):
                self.import_page(page, p)
            return None

        def stacked(ts: list[torch.Tensor]) -> torch.Tensor:  # [N, 2, L, page_size, kv_heads, d or d/g]
            if self.device.type != "cuda":
                return torch.stack(ts)
            host = torch.empty((len(ts), *ts[0].shape), dtype=ts[0].dtype, pin_memory=True)
            torch.stack(ts, out=host)  # one host copy, straight into pinned memory
            return host.to(self.device, non_blocking=True)

        data = stacked([p.data for p in payloads])
        scales = stacked([p.scales for p in payloads]) if first.scales is not None else None  # type: ignore[misc]
        zeros = stacked([p.zeros for p in payloads]) if first.zeros is not None else None  # type: ignore[misc]
        self.kv_cache.scatter_pages(physical_pages, data, scales, zeros, first.group_size)
        return CachedUpload(data, scales, zeros)

    def record_event(self):
        """A CUDA event marking the work queued so far on this runner's stream (None on CPU: done already)."""
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _wait_gpu(self, event: torch.cuda.Event) -> None:
        self.gpu_wait(event)  # read at each wait: the loop sets it after the runner is built

    def device_busy(self) -> bool:
        """Whether the device still computes the last step this runner launched: until then the next step's forward
        could not start on it anyway (a host wait meanwhile costs nothing)."""
        return self._launched is not None and not self._launched.query()

    # ---- chained greedy decode (EngineConfig.overlap_decode) ------------------------------------------------
    def can_chain(self, batch_size: int, max_position: int) -> bool:
        """Whether a greedy decode step of `batch_size` rows up to position `max_position` can be launched before
        the previous step's tokens reach the host: through the decode graphs on CUDA, eagerly elsewhere (CPU
        computes the step at launch, so there is nothing to overlap there, only the same bookkeeping)."""
        if self.device.type != "cuda":
            return True
        return self.graph_runner is not None and self.graph_runner.can_run(batch_size, max_position + 1)

    def launch_decode(self, seqs: list[Sequence], positions: list[int], prev: DecodeLaunch | None) -> DecodeLaunch:
        """Queue one greedy decode step: row i computes position positions[i] of seqs[i] (its pages allocated).
        prev None: the inputs are the sequences' tokens at those positions; else the rows of `prev` (the same
        sequences, in order) feed their sampled tokens, which the host has not read yet."""
        if prev is not None:
            prev.sample()  # its masked draw is this step's input: queued first
        if self.device.type == "cuda":
            graphs = self.graph_runner
            assert graphs is not None
            ids = None if prev is not None else [s.tokens(p, p + 1)[0] for s, p in zip(seqs, positions)]
            graphs.run(ids, positions, [s.page_table for s in seqs])
            if any(s.grammar is not None for s in seqs):  # structured output: the graph's masked argmax
                return self._masked_launch(seqs, prev, graphs.sample_masked)
            host, done = graphs.take_greedy(len(seqs))
            return DecodeLaunch(host, done, wait=self._wait_gpu)
        ids = prev.tokens() if prev is not None else [s.tokens(p, p + 1)[0] for s, p in zip(seqs, positions)]
        tables = [s.page_table for s in seqs]
        hidden = self._forward(ids, positions, [1] * len(seqs), tables, len(seqs))  # [B, hidden]
        logits = self._logits(hidden, list(range(len(seqs))))  # [B, V] float32
        if any(s.grammar is not None for s in seqs):
            return self._masked_launch(seqs, prev, lambda m: (masked_logits(logits, m).argmax(dim=-1), None))
        return DecodeLaunch(logits.argmax(dim=-1), None, wait=self._wait_gpu)

    def _masked_launch(
        self, seqs: list[Sequence], prev: DecodeLaunch | None, draw: Callable[[torch.Tensor], tuple[torch.Tensor, Any]]
    ) -> DecodeLaunch:
        """A launch whose draw waits for the grammar masks (MaskedDraw); filled from now on for a first step (the
        sequences' tokens are all fed), after the engine fed `prev`'s tokens for a chained one (`start_masks`)."""
        if self._mask_filler is None:
            pin = self.device.type == "cuda"
            self._mask_filler = MaskFiller(self.cfg.max_num_seqs, self.model_config.vocab_size, pin)
        masked = MaskedDraw(self._mask_filler, [s.grammar for s in seqs], draw)
        launch = DecodeLaunch(None, None, masked, self._wait_gpu)
        if prev is None:
            launch.start_masks()
        return launch

    # ---- one forward -------------------------------------------------------------------------------------
    def run(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        sample_rows: list[int],
        num_decode: int,
        return_logits: bool,
    ) -> tuple[dict[int, int], dict[int, torch.Tensor], dict[int, TokenLogprob], dict[int, list[TokenLogprob]]]:
        """Compute `num_new_tokens[i]` tokens of each sequence from its `num_computed_tokens` on (its pages are
        allocated), in one forward: the first `num_decode` sequences are decode rows (one token each; attention
        through the decode path), the rest prefill chunks (the prefill path); linear layers run once over all rows.
        A pure decode step runs through the decode CUDA graphs when captured; a step with prefill rows runs eagerly.
        Sample one token for each row in `sample_rows` (a forced token, `Sequence.forced_token`,
        replaces the draw; the generator still advances). Returns (row -> token, row -> float32 logits [V] when
        `return_logits`, row -> the token's logprob when its sampling asks, row -> log P(prompt[p + 1]) (with
        `top_logprobs` alternatives) for the prompt positions p this step computed, when its sampling asks for
        prompt_logprobs)."""
        wall0, cpu0 = time.time_ns(), time.thread_time_ns()
        self.launch_graph_tokens = 0
        ids: list[int] = []
        for seq, n in zip(seqs, num_new_tokens):
            ids.extend(seq.tokens(seq.num_computed_tokens, seq.num_computed_tokens + n))
        graph_logits = None  # decode through a captured CUDA graph: logits [B, V] of every sequence
        graphs = self.graph_runner
        if (
            graphs is not None
            and num_decode == len(seqs)
            and graphs.can_run(len(seqs), max(s.num_computed_tokens for s in seqs) + 1)
        ):
            graph_logits = graphs.run(ids, [s.num_computed_tokens for s in seqs], [s.page_table for s in seqs])
        else:
            starts = [s.num_computed_tokens for s in seqs]
            hidden = self._forward(ids, starts, list(num_new_tokens), [s.page_table for s in seqs], num_decode)
        self.launched_ns = time.time_ns()  # the step's forward is queued (its host time ends; the device's goes on)
        how = "decode_graph" if graph_logits is not None else "prefill_graph" if self.launch_graph_tokens else "eager"
        self.steps_launched[how] += 1
        if self._launched is not None:
            self._launched.record()
        self.launch_wall_ns, self.launch_cpu_ns = self.launched_ns - wall0, time.thread_time_ns() - cpu0
        # penalties / bias / grammar masks of the sampled rows, built on the host while the device runs the step
        plan = LogitsPlan.build([seqs[i] for i in sample_rows], self.model_config.vocab_size, self._eos_token_ids)
        prompt_lps = {} if graph_logits is not None else self._prompt_logprobs(seqs, num_new_tokens, hidden)
        if not sample_rows:
            return {}, {}, {}, prompt_lps
        if graph_logits is not None:  # the graph took the argmax and copied it to the host already
            logits = graph_logits
            assert graphs is not None
            greedy = graphs.greedy_tokens(len(seqs), self._wait_gpu)
            greedy = [greedy[i] for i in sample_rows]
        else:
            last = list(itertools.accumulate(num_new_tokens))
            logits = self._logits(hidden, [last[i] - 1 for i in sample_rows])  # [S, V] float32
            greedy = logits.argmax(dim=-1).tolist()
        draw_logits = logits  # what the draws see; `logits` stays the model's (logprobs, return_logits)
        if plan is not None:
            if graph_logits is not None and len(sample_rows) != len(seqs):
                logits = logits[sample_rows]
            draw_logits = plan.apply(logits)  # [S, V]
            greedy = draw_logits.argmax(dim=-1).tolist()
        tokens: dict[int, int] = {}
        rows: dict[int, torch.Tensor] = {}
        lps: dict[int, TokenLogprob] = {}
        for r, i in enumerate(sample_rows):
            seq = seqs[i]
            sp = seq.sampling
            tokens[i] = greedy[r] if sp.greedy else sample(draw_logits[r], sp, self._generators[seq.request_id])
            forced = seq.forced_token()
            if forced is not None:
                tokens[i] = forced
            if sp.wants_logprobs:  # from this same row: graph logits or eager, never dropped
                lps[i] = token_logprobs(logits[r : r + 1], [tokens[i]], sp.top_logprobs)[0]
            if return_logits:
                rows[i] = logits[r].clone()
        return tokens, rows, lps, prompt_lps

    def _prompt_logprobs(
        self, seqs: list[Sequence], num_new_tokens: list[int], hidden: torch.Tensor
    ) -> dict[int, list[TokenLogprob]]:
        """Per row asking for prompt_logprobs: log P(prompt[p + 1]) for each prompt position p of this chunk, with
        the sampling's `top_logprobs` alternatives (hidden [T, hidden]: the chunk rows of every sequence, in order).
        Logits are built block by block."""
        out: dict[int, list[TokenLogprob]] = {}
        offset = 0
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            start = seq.num_computed_tokens
            end = min(start + n, seq.num_prompt_tokens - 1)  # positions with a next prompt token
            if seq.sampling.prompt_logprobs and end > start:
                targets = seq.prompt_token_ids[start + 1 : end + 1]
                k = seq.sampling.top_logprobs
                vals: list[TokenLogprob] = []
                for b in range(0, len(targets), PROMPT_LOGPROB_BLOCK):
                    rows = list(range(offset + b, offset + min(b + PROMPT_LOGPROB_BLOCK, len(targets))))  # <= B
                    vals.extend(token_logprobs(self._logits(hidden, rows), targets[b : b + len(rows)], k))
                out[i] = vals
            offset += n
        return out
