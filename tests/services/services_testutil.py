"""Real service processes for the tests under tests/services: one engine service, a tiny decode service, and the
tiny test stack (router + prefill + decode) with the settings these tests share. They stop when their `with`
block ends. Also what these tests ask of a running stack: KV pools empty, streams collected."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

import pdserve
from pdserve.cli.launch import Address, Stack, start_service, start_stack, wait_ready
from pdserve.models.checkpoints import build_checkpoint
from pdserve.server.grpc_util import channel
from pdserve.v1 import internal_pb2, internal_pb2_grpc


class Services:
    """Service processes a test starts (`pdserve serve ROLE common... args...`, logs and ready files in `work`),
    stopped together; `procs` maps each ready engine's address to its process (a kill test picks from it)."""

    def __init__(self, work: Path, common: Sequence[str] = ()):
        self.work = work
        self.common = list(common)
        self.stack = Stack("", [], [])
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, specs: Sequence[tuple[str, list[str]]], timeout: float = 180) -> list[Address]:
        """Start every (role, args) at once (on a free port unless args say `--port`), then wait until each is
        ready; their addresses, in order."""
        started = [start_service(role, [*self.common, *args], self.work) for role, args in specs]
        for proc, _, log in started:
            self.stack.procs.append(proc)
            self.stack.logs.append(log)
        addrs = [wait_ready(*s, timeout=timeout) for s in started]
        self.procs.update((str(a), s[0]) for a, s in zip(addrs, started))
        return addrs

    def restart(self, role: str, addr: str, args: list[str]) -> None:
        """Start `role` again on the port of `addr` (its process was killed) and wait until it is ready."""
        self.start([(role, ["--port", addr.rsplit(":", 1)[1], *args])])


@contextmanager
def services(work: Path, common: Sequence[str] = ()) -> Iterator[Services]:
    """`Services` that stop when the block ends; if the block raises (a start that failed), their logs are
    printed first."""
    group = Services(work, common)
    try:
        yield group
    except BaseException:
        print(group.stack.log_text())
        raise
    finally:
        group.stack.stop()


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
def tiny_decode(
    work: Path, *, page_size: int, kv_dtype: str, extra: Sequence[str] = ()
) -> Iterator[internal_pb2_grpc.DecodeStub]:
    """A decode service over a tiny llama checkpoint (built in `work`): `page_size`, a pool of 64 pages of
    `kv_dtype`, one torch thread, `extra` flags; yields its stub (its log: work/decode0.log)."""
    model = build_checkpoint(work / "ckpt", arch="llama", seed=3)
    args = ["--model", str(model), "--page-size", str(page_size), "--num-pages", "64", "--kv-dtype", kv_dtype]
    with running_service("decode", [*args, "--torch-threads", "1", *extra], work) as addr, channel(addr) as ch:
        yield internal_pb2_grpc.DecodeStub(ch)


def pool_empty(stub: internal_pb2_grpc.DecodeStub | internal_pb2_grpc.PrefillStub) -> bool:
    """Whether the instance behind `stub` holds no KV page (its Stats)."""
    s = stub.Stats(internal_pb2.StatsRequest(), timeout=5)
    return s.kv_pages_free == s.kv_pages_total


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


def prompts(n_tokens: int, seed: int = 0, vocab: int = 512) -> list[int]:
    """A random prompt of `n_tokens` token ids in [5, vocab), the same for the same (n_tokens, seed)."""
    g = torch.Generator().manual_seed(seed * 1000 + n_tokens)
    return torch.randint(5, vocab, (n_tokens,), generator=g).tolist()


def stack_pools_empty(stack: Stack) -> bool:
    """Whether no prefill, decode or colocated instance of `stack` holds a KV page."""
    engines = [(a, internal_pb2_grpc.PrefillStub) for a in stack.prefill]
    engines += [(a, internal_pb2_grpc.DecodeStub) for a in [*stack.decode, *stack.colocated]]
    for addr, stub in engines:
        with channel(addr) as ch:
            if not pool_empty(stub(ch)):
                return False
    return True


def greedy_agreement(
    ref: pdserve.Client, other: pdserve.Client, token_ids: Sequence[list[int]], max_tokens: int = 16
) -> tuple[int, int, list[int]]:
    """Greedy outputs of `other` against `ref`'s for each prompt: (tokens that agree, tokens compared, index of
    the first divergence per prompt)."""
    agree = total = 0
    first_diff = []
    for ids in token_ids:
        want = ref.generate(token_ids=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True).token_ids
        got = other.generate(token_ids=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True).token_ids
        same = [x == y for x, y in zip(want, got)]
        first_diff.append(same.index(False) if False in same else len(same))
        agree += sum(same)
        total += len(same)
    return agree, total, first_diff
