"""CUDA graphs for pure decode steps: one graph per batch size in a fixed set, each capturing the whole model
forward plus the LM head, replayed over static input buffers. A step that also prefills (a mixed step,
scheduler.py) cannot replay these (its row count and chunk shapes vary from step to step): it replays the
piecewise prefill graphs (prefill_graphs.py: everything but attention, per token bucket) or runs eagerly. The
graph also takes the argmax of the logits and copies it into pinned host memory, so a greedy step costs the host
one event wait (no argmax launch, no separate device-to-host copy).

Static inputs live in one int32 device buffer: input ids, positions, KV slots, cache_seqlens [max_bs] each, then
the page table [max_bs, W] with W = ceil(max_context / page_size). max_context is the model's whole context (or
`cuda_graph_max_context` when set), so no decode falls off to eager for its length: every batch size shares
this one buffer set, which costs 4·max_bs·(4 + W) bytes on the device and as much pinned (64 rows at 128k
context and 16-token pages: 2 MiB). Kernels whose decode reads a dense scratch sized by W (the int8 `dequant`
kernel) capture only the batch sizes whose scratch fits GRAPH_SCRATCH_BUDGET_BYTES; larger batches run eagerly.
A decode batch of B sequences runs the graph of the smallest captured size >= B; padded rows read page 0
(seqlen 1) and write nowhere (slot -1: the fused KV write skips it). Inputs are staged in pinned host memory
and sent with one copy per step; a page-table row is rewritten on the host only where the sequence's table
grew or changed (tables are append-only lists, replaced on preemption; a row remembers the list object it
mirrors).

Needs: CUDA, the fused model path (its KV write is graph-safe) and a backend whose decode `attend` reads only
`fa3_tensors()` (FA3Backend). Anything else (a larger batch than captured) runs eagerly.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

log = logging.getLogger("pdserve.engine")

GRAPH_BACKENDS = ("fa3", "triton-rows")  # attention backends whose decode call is graph-safe (attention.py)
GRAPH_SCRATCH_BUDGET_BYTES = 2 << 30  # largest per-layer dense K/V scratch a captured graph may allocate


def graph_context(max_model_len: int, requested: int, page_size: int) -> int:
    """Context the decode graphs cover: the model's whole context, or `requested` (> 0) when smaller; rounded up
    to whole pages."""
    ctx = min(max_model_len, requested) if requested > 0 else max_model_len
    return -(-ctx // page_size) * page_size


def static_buffer_bytes(max_batch: int, width: int) -> int:
    """Device bytes of the shared static inputs (ids, positions, slots, seqlens, page table); as much pinned."""
    return 4 * max_batch * (4 + width)


def scratch_bytes_per_row(cache, kernels, width: int, page_size: int, dtype_size: int) -> int:
    """Per batch row, bytes of the dense K/V scratch a decode layer allocates inside the graph: only the int8 pool's
    `dequant` kernel has one ([2, B, W·ps, KVH, D] of the model dtype); 0 otherwise."""
    if not (cache.quantized and kernels.int8_decode == "dequant"):
        return 0
    return 2 * width * page_size * cache.num_kv_heads * cache.head_dim * dtype_size


def capturable_sizes(sizes: list[int], per_row_scratch: int, budget: int = GRAPH_SCRATCH_BUDGET_BYTES) -> list[int]:
    """The batch sizes whose graph scratch fits `budget` (all of them without scratch)."""
    return [bs for bs in sizes if bs * per_row_scratch <= budget]


@dataclass
class StaticDecodeMeta:
    """The slice of the static buffers a captured batch size reads (duck-types AttentionMetadata for decode)."""

    positions: torch.Tensor  # [bs] int32
    slot_mapping: torch.Tensor  # [bs] int32 (-1: padded row)
    cache_seqlens: torch.Tensor  # [bs] int32: keys per sequence, this step's token included
    page_table: torch.Tensor  # [bs, W] int32
    is_decode: bool = True
    is_mixed: bool = False

    def fa3_tensors(self) -> dict:
        return {"cache_seqlens": self.cache_seqlens, "page_table": self.page_table}


def default_batch_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 384, 512]
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


class DecodeGraphRunner:
    def __init__(
        self,
        model,
        cache,
        backend,
        page_size: int,
        max_batch: int,
        max_context: int,
        device: torch.device,
        batch_sizes: list[int] | None = None,
        capture_error_mode: str = "thread_local",
        tp=None,
    ):
        self.model, self.cache, self.backend = model, cache, backend
        self.capture_error_mode = capture_error_mode  # thread_local with a TP group's NCCL collectives inside
        self.tp = tp  # this rank's TPGroup at tensor parallel: its collectives are recorded into every graph
        self.page_size = page_size
        self.width = -(-max_context // page_size)
        self.max_context = self.width * page_size
        self.all_sizes = sorted(batch_sizes or default_batch_sizes(max_batch))
        self.sizes = self.all_sizes  # captured ones (capture() drops those whose scratch would not fit)
        bs = self.max_batch = self.all_sizes[-1]
        self.device = device
        # one int32 block: [ids | positions | slots | seqlens] (bs each), then the page table [bs, W]
        n = bs * (4 + self.width)
        self._dev = torch.zeros(n, dtype=torch.int32, device=device)
        self._host = torch.zeros(n, dtype=torch.int32).pin_memory()
        self._np = self._host.numpy()
        self._nvec = self._np[: 4 * bs].reshape(4, bs)
        self._ntable = self._np[4 * bs :].reshape(bs, self.width)
        self._rows: list[tuple[list[int] | None, int]] = [(None, 0)] * bs  # per row: (mirrored list, entries)
        self._copied = torch.cuda.Event()
        self._greedy_host = torch.zeros(bs, dtype=torch.int64).pin_memory()  # [max_bs] argmax of the last step
        self._greedy_np = self._greedy_host.numpy()
        self._replayed = torch.cuda.Event()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._argmax: dict[int, torch.Tensor] = {}  # [bs] int64 on the device: each replay's argmax (graph memory)
        self._last_bs = 0  # the batch size of the last replay
        # structured output (engine overlapped decode): per size, a second graph that draws the argmax among the
        # tokens of a grammar bitmask [max_bs, ceil(V / 32)] int32 (device, copied from the host after the forward
        # was launched) into the same argmax buffer: a chained step's inputs and take_greedy read the masked draw
        self._bitmask: torch.Tensor | None = None
        self._mask_graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _meta(self, bs: int) -> StaticDecodeMeta:
        mb = self.max_batch
        vec = self._dev[: 4 * mb].view(4, mb)
        table = self._dev[4 * mb :].view(mb, self.width)
        return StaticDecodeMeta(vec[1, :bs], vec[2, :bs], vec[3, :bs], table[:bs])

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.model(self._dev[:bs], self._meta(bs), self.cache, self.backend)
        return self.model.compute_logits(hidden)  # [bs, V] float32

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size (largest first, one shared memory pool). Buffers hold padding meanwhile.
        Calling it again (after `ModelRunner.set_kernels`) replaces the graphs."""
        from pdserve.engine.kernels.argmax import argmax_rows

        self.graphs.clear()
        self.logits.clear()
        self._argmax.clear()
        self._mask_graphs.clear()
        torch.cuda.empty_cache()
        dtype_size = torch.empty((), dtype=self.cache.dtype).element_size()
        scratch = scratch_bytes_per_row(self.cache, self.model.kernels, self.width, self.page_size, dtype_size)
        self.sizes = capturable_sizes(self.all_sizes, scratch)
        if not self.sizes:
            log.warning("decode CUDA graphs: no batch size fits the dense scratch budget; decode runs eagerly")
            return
        reserved = torch.cuda.memory_reserved(self.device)
        self._nvec[:] = 0
        self._nvec[2] = -1  # slots: write nowhere
        self._nvec[3] = 1  # seqlens
        self._ntable[:] = 0
        self._rows = [(None, 0)] * self.max_batch
        self._dev.copy_(self._host)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.sizes):
                argmax_rows(self._forward(bs))  # warm-up: triton compiles, FA3 picks its kernels
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=self.capture_error_mode):
                    with self._collectives():
                        self.logits[bs] = self._forward(bs)
                    self._argmax[bs] = argmax_rows(self.logits[bs])
                    self._greedy_host[:bs].copy_(self._argmax[bs], non_blocking=True)
                self.graphs[bs] = graph
                self._mask_graphs[bs] = self._capture_masked_argmax(bs, pool, stream)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        static = static_buffer_bytes(self.max_batch, self.width)
        log.info(
            "captured decode CUDA graphs for batch sizes %s, context %d (%d pages a row): static inputs %.2f MiB "
            "device + %.2f MiB pinned, graph pool and outputs %.1f MiB%s",
            self.sizes,
            self.max_context,
            self.width,
            static / 2**20,
            static / 2**20,
            (torch.cuda.memory_reserved(self.device) - reserved) / 2**20,
            f"; dense scratch {scratch * self.sizes[-1] / 2**20:.0f} MiB" if scratch else "",
        )

    @contextlib.contextmanager
    def _collectives(self) -> Iterator[None]:
        """At tensor parallel: the forward's collectives are recorded through the TP group's capture region (it
        refuses a group that cannot be captured); a graph that recorded none bypassed the group: an error."""
        if self.tp is None:
            yield
            return
        with self.tp.capturing():
            yield
        if not self.tp.captured_collectives:
            raise RuntimeError("a tensor-parallel decode graph recorded no collective: its ranks would not agree")

    def _capture_masked_argmax(self, bs: int, pool, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
        """The graph that re-draws size `bs`'s argmax among the bitmask's tokens (`sample_masked`)."""
        from pdserve.engine.kernels.argmax import argmax_rows
        from pdserve.engine.logits_processors import masked_logits

        if self._bitmask is None:
            words = (self.logits[bs].shape[-1] + 31) // 32
            self._bitmask = torch.full((self.max_batch, words), -1, dtype=torch.int32, device=self.device)
        argmax_rows(masked_logits(self.logits[bs], self._bitmask[:bs]))  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=self.capture_error_mode):
            self._argmax[bs].copy_(argmax_rows(masked_logits(self.logits[bs], self._bitmask[:bs])))
            self._greedy_host[:bs].copy_(self._argmax[bs], non_blocking=True)
        return graph

    @torch.inference_mode()  # the bitmask buffer was made under the capture's inference mode
    def sample_masked(self, bitmask: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Redo the last run's argmax among the tokens `bitmask` [B, ceil(V / 32)] int32 (pinned host memory, B the
        last run's rows) allows: queued after that run's forward, before the next run (a chained step reads it).
        Returns `take_greedy(B)` of the masked draw."""
        bs, b = self._last_bs, bitmask.shape[0]
        assert self._bitmask is not None and b <= bs
        self._bitmask[:b].copy_(bitmask, non_blocking=True)
        if b < bs:
            self._bitmask[b:bs].fill_(-1)
        self._mask_graphs[bs].replay()
        self._replayed.record()
        return self.take_greedy(b)

    def can_run(self, batch_size: int, max_kv_len: int) -> bool:
        return bool(self.graphs) and batch_size <= self.sizes[-1] and max_kv_len <= self.max_context

    def check_chain(self, chained: bool, b: int) -> None:
        """ValueError unless a run of `b` rows can be chained to the last one (the same captured size); checked
        before anything is launched (at tensor parallel: before the run is broadcast to the other ranks)."""
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        if chained and bs != self._last_bs:
            raise ValueError(f"a chained decode step needs the previous step's batch size {self._last_bs}, got {bs}")

    def run(self, input_ids: list[int] | None, positions: list[int], page_tables: list[list[int]]) -> torch.Tensor:
        """One decode step: token ids, their positions, and each sequence's page table -> logits [B, V] float32
        (a view of the graph's output buffer, valid until the next run). `input_ids` None: row i's input is row i's
        argmax of the previous run, taken on the device (a chained step of the same sequences in the same order,
        launched before the host has read that argmax)."""
        self.check_chain(input_ids is None, len(positions))
        self._copied.synchronize()
        b = len(positions)
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        chained = input_ids is None
        ps = self.page_size
        vec, table = self._nvec, self._ntable
        if not chained:
            vec[0, :b] = input_ids
        vec[1, :b] = positions
        vec[2, :b] = [t[p // ps] * ps + p % ps for t, p in zip(page_tables, positions)]
        vec[3, :b] = vec[1, :b] + 1
        vec[0:2, b:bs] = 0
        vec[2, b:bs] = -1
        vec[3, b:bs] = 1
        rows = self._rows
        for i, t in enumerate(page_tables):
            mirrored, n = rows[i]
            if mirrored is not t:
                n = 0
            if n != len(t):
                table[i, n : len(t)] = t[n:]
                rows[i] = (t, len(t))
        # padded rows keep whatever table they had: every entry ever written is a valid page id
        n = 4 * self.max_batch + bs * self.width
        if chained:  # every input but the ids from the host; the ids from the last replay's argmax (stream order)
            self._dev[self.max_batch : n].copy_(self._host[self.max_batch : n], non_blocking=True)
            self._dev[:b].copy_(self._argmax[bs][:b])
        else:
            self._dev[:n].copy_(self._host[:n], non_blocking=True)
        self._copied.record()  # the next run refills the pinned buffers only after these copies are done
        self.graphs[bs].replay()
        self._replayed.record()
        self._last_bs = bs
        return self.logits[bs][:b]

    def take_greedy(self, b: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        """The last run's argmax of its first `b` rows copied into a pinned buffer of the caller's own (the graph's
        host buffer is overwritten by the next replay), and the event after which it is valid."""
        host = torch.empty(b, dtype=torch.int64, pin_memory=True)
        host.copy_(self._argmax[self._last_bs][:b], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    def greedy_tokens(self, b: int, wait: Callable[[torch.cuda.Event], None] | None = None) -> list[int]:
        """Argmax token of each of the last run's first `b` rows (waits for that step to finish, through `wait` when
        given: the runner's `gpu_wait`)."""
        (wait or torch.cuda.Event.synchronize)(self._replayed)
        return self._greedy_np[:b].tolist()


def graph_capture_mode(enabled: bool, device: torch.device, fused: bool, backend_name: str, tp=None) -> tuple[str, str]:
    """(`torch.cuda.graph` capture_error_mode, "") when the decode graphs are captured, ("", why not) when not.
    Tensor parallel (`tp`: the rank's `TPGroup`): the graph holds the model's collectives, the per-block
    all-reduces and the logits' all-gather, so every rank captures the same sizes in the same order (their warm-up
    forwards are collectives too) and replays them in lockstep (`tp.graph_step`); only a group whose collectives are
    NCCL kernels can be captured, in the group's capture mode."""
    if not enabled:
        return "", "disabled"
    if device.type != "cuda" or not fused or backend_name not in GRAPH_BACKENDS:
        return "", "needs CUDA, the fused model path and the FA3 (or triton-rows) backend"
    if tp is None:  # thread_local: another thread's CUDA calls (a prompt-cache fetch's copies, a KV transfer's
        return "thread_local", ""  # event queries) during a capture must not invalidate it; they use other streams
    why = tp.capture_blocker()
    return ("", why) if why else (tp.capture_error_mode, "")


def make_decode_graph_runner(
    model,
    cache,
    backend,
    page_size: int,
    max_batch: int,
    max_context: int,
    device: torch.device,
    enabled: bool,
    tp=None,
) -> DecodeGraphRunner | None:
    """A captured runner when the engine can use one (`graph_capture_mode`), else None. `tp`: this rank's TPGroup
    at tensor parallel (every rank calls this at the same point of its start)."""
    mode, why = graph_capture_mode(enabled, device, model.kernels.fused, backend.name, tp)
    if not mode:
        log.info("decode CUDA graphs off (%s)", why)
        return None
    runner = DecodeGraphRunner(
        model, cache, backend, page_size, max_batch, max_context, device, capture_error_mode=mode, tp=tp
    )
    runner.capture()
    return runner
