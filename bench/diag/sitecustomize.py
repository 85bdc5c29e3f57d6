"""Where a served prefill's time goes, for a device run (not part of the services): put this directory first on
PYTHONPATH and set PDSERVE_DIAG=1 before starting a stack (`bench/one_gpu.py`, `pdserve up`); every process whose
arguments include `prefill` then writes `DIAG <unix time> ...` lines to its log:

- `engine.step`, `runner.run` (>= 5 ms), `load_landed`, `import_full_pages`, `*.scatter_pages`, `lookup_racing`:
  wall ms with the device synchronized before and after (so steps no longer overlap the host's next launch: use it
  to find a phase, not for the figures), the ms until the call returned, the thread's CPU ms (a synchronizing CUDA
  call spins and counts) and the GPU span of the current stream (CUDA events);
- `triton compile start|done`: a Triton kernel specialised in this process (compiled, or loaded from the on-disk
  cache), with its launch options.

    PYTHONPATH=$PWD/bench/diag:$PYTHONPATH PDSERVE_DIAG=1 python bench/one_gpu.py --part cache ...
    grep DIAG WORKDIR/served-*/prefill0.log
"""

from __future__ import annotations

import os
import sys
import time

if os.environ.get("PDSERVE_DIAG") == "1" and "prefill" in sys.argv:
    import importlib.abc
    import importlib.util

    def say(msg: str) -> None:
        sys.stderr.write(f"DIAG {time.time():.3f} {msg}\n")
        sys.stderr.flush()

    def timed(owner, name: str, label: str, min_ms: float = 0.0, extra=None) -> None:
        """Replace owner.name with a wrapper that logs its synchronized timing."""
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            import torch

            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.synchronize()
            t, cpu = time.perf_counter(), time.thread_time()
            start = end = None
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            try:
                return fn(*args, **kwargs)
            finally:
                returned = (time.perf_counter() - t) * 1e3
                if cuda:
                    end.record()
                    torch.cuda.synchronize()
                ms = (time.perf_counter() - t) * 1e3
                gpu = start.elapsed_time(end) if cuda else -1.0
                if ms >= min_ms:
                    more = extra(*args) if extra else ""
                    say(f"{label} {ms:.1f} ms (returned {returned:.1f}, thread cpu "
                        f"{(time.thread_time() - cpu) * 1e3:.1f}, gpu span {gpu:.1f}) {more}")  # fmt: skip

        setattr(owner, name, wrapper)

    def step_info(engine, *_args) -> str:
        return f"prefill_tokens={engine.last_step_prefill_tokens} running={len(engine.scheduler.running)}"

    def patch(name: str, module) -> None:
        if name == "pdserve.engine.engine":
            timed(module.LLMEngine, "step", "engine.step", 5.0, step_info)
            timed(module, "load_landed", "load_landed", 1.0)
        elif name == "pdserve.engine.model_runner":
            timed(module.ModelRunner, "run", "runner.run", 5.0)
            timed(module.ModelRunner, "import_full_pages", "import_full_pages")
        elif name == "pdserve.engine.kv_cache":
            for cls in ("KVCache", "QuantizedKVCache"):
                timed(getattr(module, cls), "scatter_pages", f"{cls}.scatter_pages")
        elif name == "pdserve.cache.prompt_cache":
            timed(module.PromptCache, "lookup_racing", "lookup_racing")
        elif name == "triton":
            from triton import knobs

            started: dict[int, float] = {}

            def before(*_args, **kw):
                started[id(kw.get("fn"))] = time.perf_counter()
                say(f"triton compile start {kw.get('repr', '')}")
                return False  # compile it

            def after(*_args, **kw):
                t = started.pop(id(kw.get("fn")), None)
                ms = (time.perf_counter() - t) * 1e3 if t is not None else -1.0
                say(f"triton compile done {ms:.1f} ms {kw.get('repr', '')[:60]}")

            knobs.runtime.jit_cache_hook = before
            knobs.runtime.jit_post_compile_hook = after

    WATCHED = {"pdserve.engine.engine", "pdserve.engine.model_runner", "pdserve.engine.kv_cache",
               "pdserve.cache.prompt_cache", "triton"}  # fmt: skip

    class PatchOnImport(importlib.abc.MetaPathFinder):
        """Patches each watched module right after it executed (its classes exist, nothing used them yet)."""

        def find_spec(self, name, path, target=None):
            if name not in WATCHED:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module, _run=run, _name=name):
                _run(module)
                try:
                    patch(_name, module)
                except Exception as e:  # a diagnostic must not stop the service
                    say(f"patch {_name} failed: {e!r}")

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, PatchOnImport())
    say(f"diagnostics on in {sys.argv[:3]}")
