"""Real service processes for the tests under tests/services: one engine service, and the tiny test stack
(router + prefill + decode) with the settings these tests share. Both stop when their `with` block ends."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from pdserve.cli.launch import Stack, start_service, start_stack, wait_ready


@contextmanager
def running_service(name: str, args: list[str], work: Path) -> Iterator[str]:
    """`pdserve serve NAME ARGS` on a free port (log and ready file in `work`); yields its host:port."""
    proc, ready, log = start_service(name, args, work)
    try:
        yield wait_ready(proc, ready, log)
    finally:
        proc.terminate()
        proc.wait(20)


@contextmanager
def tiny_stack(
    model_dir: Path,
    work: Path,
    *,
    kv_dtype: str,
    page_size: int = 4,
    chunk_size: int = 8,
    num_pages: int = 256,
    extra: Sequence[str] = (),
    **kw,
) -> Iterator[Stack]:
    """`start_stack` with small pages and chunks, `num_pages` KV pages and one torch thread per engine;
    `extra` engine flags and `kw` (start_stack's keywords) on top."""
    stack = start_stack(
        model_dir,
        work,
        kv_dtype=kv_dtype,
        page_size=page_size,
        chunk_size=chunk_size,
        extra=["--num-pages", str(num_pages), "--torch-threads", "1", *extra],
        **kw,
    )
    try:
        yield stack
    finally:
        stack.stop()
