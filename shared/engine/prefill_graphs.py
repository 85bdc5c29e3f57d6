"""Piecewise CUDA graphs for the steps the decode graphs do not take (prefill chunks, mixed steps): the model's
forward cut at attention into L + 1 segments, each captured once per token bucket and replayed over static
buffers, with attention itself run eagerly between them (its shapes: sequence count, lengths, prefix pages, vary
from step to step).

Why: an eager forward launches ~10 kernels a layer from Python, and on a GPU host that launch costs about as much
CPU time whatever the token count (tens of ms for an 8B model), so any step shorter than that on the device (a
short prompt, the uncached tail of a prompt-cache hit, a small mixed step) waits on the host. A replay launches a
segment's kernels in one call. Steps of more tokens than the largest bucket compute longer than their launch and
run eagerly.

Segments (layer i's attention sits between segment i and segment i + 1):
- 0: embed the ids into the residual, the first input norm, layer 0's q/k/v projection, RoPE and the K/V write;
- i (1..L-1): layer i-1's output projection, its residual add + norm + MLP + add + layer i's input norm, layer i's
  q/k/v, RoPE and K/V write;
- L: the last layer's output projection and MLP, the final norm into `hidden`.
A step of T tokens runs the graphs of the smallest bucket >= T: rows T.. are padding (id 0, position 0, KV slot -1:
the fused K/V write skips it; their attention input rows are zero), and since every op outside attention works
row by row, padding never changes a real row. q leaves each segment in a static buffer that attention reads
(rows :T); attention's output goes into the static buffer the next segment reads. The KV handoff's layer hook
runs after each layer's attention, as in the eager forward.

Needs: CUDA, the fused model path, the FA3 backend, no tensor parallel (`prefill_graph_mode`). Buffers and graphs
are sized by the largest bucket; every graph shares one memory pool (replays never overlap).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.attention import AttentionMetadata

log = logging.getLogger("pdserve.engine")

# token buckets: a step pads to the smallest that holds it. Multiples of 128 past 128 rows: a GEMM of an odd multiple
# of 64 rows can take longer than one padded to the next multiple of 128 (bench/diag/prefill_launch.py times them)
DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)


def buckets_up_to(max_tokens: int) -> list[int]:
    """The default buckets of at most `max_tokens` tokens, and `max_tokens` itself (rounded up to 16)."""
    if max_tokens <= 0:
        return []
    top = -(-max_tokens // 16) * 16
    return sorted({b for b in DEFAULT_BUCKETS if b < top} | {top})


@dataclass
class StaticRows:
    """A bucket's per-row inputs of the K/V write (duck-types the `positions` / `slot_mapping` of
    AttentionMetadata that `Attention.query_and_store` reads)."""

    positions: torch.Tensor  # [bucket] long
    slot_mapping: torch.Tensor  # [bucket] long (-1: padding)


class Recorder:
    """Records a segment into a CUDA graph (one memory pool, one side stream for every capture); `record(fn)`
    returns the replay."""

    def __init__(self, device: torch.device, capture_error_mode: str):
        self.device = device
        self.mode = capture_error_mode
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self.graphs: list[torch.cuda.CUDAGraph] = []

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Warm-ups and captures run on the side stream, ordered after the work already queued."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        torch.cuda.synchronize(self.device)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def record(self, fn: Callable[[], None]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode=self.mode):
            fn()
        self.graphs.append(graph)
        return graph.replay

    def clear(self) -> None:
        self.graphs.clear()
        self.pool = torch.cuda.graph_pool_handle()


class PrefillGraphRunner:
    """Token-bucketed piecewise graphs of `model`'s forward over `cache` (see the module docstring). `recorder`:
    how segments are recorded (`Recorder` on CUDA; the CPU tests pass one whose "graph" is the function)."""

    def __init__(self, model, cache, backend, device: torch.device, buckets: list[int], recorder):
        assert buckets, "at least one bucket"
        self.model, self.cache, self.backend, self.device = model, cache, backend, device
        self.buckets = sorted(buckets)
        self.recorder = recorder
        cfg = model.config
        top = self.buckets[-1]
        attn = model.decoder_layers[0].self_attn
        heads, head_dim = attn.num_heads, attn.head_dim
        dtype = model.model.norm.weight.dtype
        self.num_layers = len(model.decoder_layers)
        self._rows_dev = torch.zeros(3, top, dtype=torch.long, device=device)  # ids | positions | slots
        pin = device.type == "cuda"
        # two host buffers in turn: filling one never waits for the copy of the step just launched
        self._rows_host = [torch.zeros(3, top, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        # each buffer's last copy to the device (an event never recorded is complete); none on CPU
        self._copied = [torch.cuda.Event(), torch.cuda.Event()] if pin else []
        self._turn = 0
        self._residual = torch.zeros(top, cfg.hidden_size, dtype=dtype, device=device)  # [top, hidden]
        self._q = torch.zeros(top, heads, head_dim, dtype=dtype, device=device)  # [top, H, D] rotated q
        self._attn_out = torch.zeros(top, heads * head_dim, dtype=dtype, device=device)  # [top, H * D]
        self._hidden = torch.zeros(top, cfg.hidden_size, dtype=dtype, device=device)  # [top, hidden] final norm
        self.replays: dict[int, list[Callable[[], None]]] = {}
        self.capture_s = 0.0

    # ---- capture -----------------------------------------------------------------------------------------
    def _segment(self, bs: int, i: int) -> Callable[[], None]:
        """Segment i of bucket `bs` as a function of the static buffers."""
        model, cache, layers = self.model, self.cache, self.model.decoder_layers
        ids = self._rows_dev[0, :bs]
        rows = StaticRows(self._rows_dev[1, :bs], self._rows_dev[2, :bs])
        residual, q_out, attn_out, hidden = self._residual[:bs], self._q[:bs], self._attn_out[:bs], self._hidden[:bs]
        last = self.num_layers

        def run() -> None:
            if i == 0:
                residual.copy_(model.model.embed_tokens(ids))
                h = model.first_norm(residual)
            else:
                h = model.after_attention(i - 1, layers[i - 1].self_attn.project_out(attn_out), residual)
            if i < last:
                q_out.copy_(layers[i].self_attn.query_and_store(h, rows, model.rotary, cache))
            else:
                hidden.copy_(h)

        return run

    @torch.inference_mode()
    def capture(self) -> None:
        """Record every bucket's segments (largest first), each after one eager warm-up run of its bucket (Triton
        compiles, cuBLAS picks its kernels). The row buffers hold padding meanwhile: nothing is written to the pool.
        Calling it again (new kernels) replaces the graphs."""
        t0 = time.perf_counter()
        self.replays.clear()
        self.recorder.clear()
        self._rows_dev.zero_()
        self._rows_dev[2].fill_(-1)
        self._attn_out.zero_()
        with self.recorder.session():
            for bs in reversed(self.buckets):
                segments = [self._segment(bs, i) for i in range(self.num_layers + 1)]
                for run in segments:
                    run()
                self.recorder.sync()
                self.replays[bs] = [self.recorder.record(run) for run in segments]
        self.capture_s = time.perf_counter() - t0

    # ---- one step ----------------------------------------------------------------------------------------
    def can_run(self, num_tokens: int) -> bool:
        return bool(self.replays) and 0 < num_tokens <= self.buckets[-1]

    def bucket(self, num_tokens: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

    def _fill_rows(self, host: np.ndarray, ids: list[int], meta: AttentionMetadata, bs: int) -> None:
        """host [3, >= bs]: ids, positions and KV slots of the step's rows, then padding to `bs`."""
        t, ps = len(ids), meta.page_size
        host[0, :t] = ids
        at = 0
        for start, n, table in zip(meta.starts, meta.q_lens, meta.page_tables):
            pos = np.arange(start, start + n)
            first = start // ps
            pages = np.asarray(table[first : (start + n - 1) // ps + 1], dtype=np.int64)
            host[1, at : at + n] = pos
            host[2, at : at + n] = pages[pos // ps - first] * ps + pos % ps
            at += n
        assert at == t, (at, t)
        host[0:2, t:bs] = 0
        host[2, t:bs] = -1

    @torch.inference_mode()
    def forward(self, ids: list[int], meta: AttentionMetadata) -> torch.Tensor:
        """The model's forward over the pool for a step of len(ids) <= the largest bucket tokens -> hidden
        [T, hidden] (a view of a static buffer: valid until the next step is launched)."""
        t = len(ids)
        bs = self.bucket(t)
        turn = self._turn = 1 - self._turn
        host = self._rows_host[turn]
        if self._copied:
            self._copied[turn].synchronize()  # this buffer's last copy (two steps ago) has left it
        self._fill_rows(host.numpy(), ids, meta, bs)
        self._rows_dev[:, :bs].copy_(host[:, :bs], non_blocking=True)
        if self._copied:
            self._copied[turn].record()
        self._attn_out[t:bs].zero_()  # padding rows enter every segment as zeros
        replays, layers, hook = self.replays[bs], self.model.decoder_layers, self.model.layer_hook
        q, attn_out = self._q[:t], self._attn_out[:t]
        replays[0]()
        for i in range(self.num_layers):
            attn = layers[i].self_attn
            attn_out.copy_(self.backend.attend(i, q, meta, self.cache, attn.scale).reshape(t, -1))
            if hook is not None:  # layer i's K/V are in the pool (written by segment i)
                hook(i)
            replays[i + 1]()
        return self._hidden[:t]


def capture_or_release(runner: PrefillGraphRunner) -> bool:
    """Capture `runner`'s graphs. Should that fail (out of device memory: the graphs live outside the share the KV
    pool was sized from; or a capture error), log why, drop what was captured and return False: the engine then
    runs those steps eagerly rather than not start (the GPU tests check that capture succeeds)."""
    try:
        runner.capture()
        return True
    except (torch.OutOfMemoryError, RuntimeError) as e:
        runner.replays.clear()
        runner.recorder.clear()
        if runner.device.type == "cuda":
            torch.cuda.empty_cache()
        log.warning(
            "prefill CUDA graphs off: capturing buckets up to %d tokens failed (%s: %s); steps with prefill rows run "
            "eagerly (lower --prefill-graph-tokens or --gpu-memory-utilization to leave the graphs room)",
            runner.buckets[-1],
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        return False


def prefill_graph_mode(
    max_tokens: int, decode_graphs: bool, device: torch.device, fused: bool, backend_name: str, tp
) -> tuple[str, str]:
    """(capture_error_mode, "") when the prefill graphs are captured, ("", why not) when not."""
    if max_tokens <= 0 or not decode_graphs:
        return "", "disabled"
    if device.type != "cuda" or not fused or backend_name != "fa3":
        return "", "needs CUDA, the fused model path and the FA3 backend"
    if tp is not None:
        return "", "not at tensor parallel"
    # thread_local: another thread's CUDA calls (a prompt-cache fetch, a KV transfer) must not invalidate a capture
    return "thread_local", ""


def make_prefill_graph_runner(
    model, cache, backend, device: torch.device, max_tokens: int, decode_graphs: bool, tp=None
) -> PrefillGraphRunner | None:
    """A captured runner when the engine can use one (`prefill_graph_mode`), else None."""
    mode, why = prefill_graph_mode(max_tokens, decode_graphs, device, model.kernels.fused, backend.name, tp)
    if not mode:
        log.info("prefill CUDA graphs off (%s)", why)
        return None
    reserved = torch.cuda.memory_reserved(device)
    runner = PrefillGraphRunner(model, cache, backend, device, buckets_up_to(max_tokens), Recorder(device, mode))
    if not capture_or_release(runner):
        return None
    log.info(
        "captured piecewise prefill CUDA graphs for token buckets %s (%d segments each) in %.1f s: buffers, graph "
        "pool and outputs %.1f MiB",
        runner.buckets,
        runner.num_layers + 1,
        runner.capture_s,
        (torch.cuda.memory_reserved(device) - reserved) / 2**20,
    )
    return runner
