"""The bench scripts' shared harness (a plain module: a script's own folder is on sys.path): log lines, the table of
figures a run prints at its end, provenance (date, commit, device, command), the JSON merge every script writes
through, percentiles, the TTFT of one greedy stream, and the one way a script queues a request on an engine.

Load generation and goodput are `pdserve bench` (package `pdserve.bench`); the scripts drive it, never restate it."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pdserve
from pdserve.testing.provenance import git_commit

ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Table:
    """The figures of one run, (figure, value, note), logged as they come and printed as Markdown at the end."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []

    def row(self, name: str, value: str, note: str = "") -> None:
        self.rows.append((name, value, note))
        log(f"{name}: {value} {note}")

    def print(self) -> None:
        print("\n| figure | value | note |\n|---|---|---|")
        for name, value, note in self.rows:
            print(f"| {name} | {value} | {note} |")


def machine() -> str:
    """This host in one line: cores, CPU model, memory."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if "model name" in ln), platform.processor())
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()}-core {platform.machine()} {cpu}, {mem:.0f} GiB"


def provenance(commit: str = "", device: str = "") -> dict[str, str]:
    """What every JSON records beside its figures: UTC date, the commit measured (`commit`, else $PDSERVE_COMMIT,
    else the checkout's HEAD), the device (`device`, else this host) and the command line."""
    return dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        commit=git_commit(commit),
        device=device or machine(),
        command=shlex.join(["python", *sys.argv]),
    )


def merge_json(path: str | Path, keys: dict[str, Any]) -> dict[str, Any]:
    """Write `keys` into the JSON object at `path` (created if missing), keeping the keys this run did not measure,
    so that parts of a benchmark may run in separate calls. Returns the merged object."""
    p = Path(path)
    doc = json.loads(p.read_text()) if p.exists() else {}
    doc.update(keys)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    log(f"wrote {p}")
    return doc


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100) of xs, linear between ranks; nan for no values."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def token_times_ms(client: pdserve.Client, ids: list[int], max_tokens: int = 2) -> tuple[list[float], int]:
    """Milliseconds from sending a greedy stream of `ids` to each of its tokens, and the prompt tokens the server
    took from its cache. The stream is read to its end (a caller that leaves after the first token would cancel the
    request's KV transfer)."""
    t0, times, cached = time.perf_counter(), [], -1
    for ch in client.stream(token_ids=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True):
        times += [(time.perf_counter() - t0) * 1e3] * len(ch.token_ids)
        if ch.usage is not None:
            cached = ch.usage.cached_tokens
    if not times:
        raise RuntimeError("stream ended without a token")
    return times, cached


def ttft_ms(client: pdserve.Client, ids: list[int]) -> float:
    """Milliseconds from sending a greedy two-token stream of `ids` to its first token (read to its end)."""
    return token_times_ms(client, ids)[0][0]


def pdserve_bench(target: str, out: str | Path, *flags: str) -> dict[str, Any]:
    """Run `pdserve bench --target target --json out FLAGS...` (the load generator, in its own processes) and return
    its JSON (schema pdserve.bench/1: `runs`, each with `summary` and the `requests` table; `sweep`)."""
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "--target", target, "--json", str(out), "--no-progress"]
    cmd += flags
    log(shlex.join(cmd))
    subprocess.run(cmd, check=True)
    return json.loads(Path(out).read_text())


def submit(engine, request_id: str, prompt: list[int], sampling, **fields) -> None:
    """Queue one request on an in-process engine (`pdserve.engine.request.EngineRequest`)."""
    from pdserve.engine.request import EngineRequest

    engine.add_request(EngineRequest(request_id, prompt, sampling, **fields))


# a tiny random Llama for CPU runs of the served-stack diagnostics (bench/diag/)
TINY_LLAMA = dict(vocab_size=8192, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32)  # fmt: skip


def model_or_tiny(model: str, workdir: Path) -> tuple[Path, int]:
    """The model directory `model`, or (`model` empty) a two-layer `TINY_LLAMA` written under `workdir`; with its
    vocabulary size."""
    from pdserve.models.random_llama import write_random_llama

    path = Path(model) if model else workdir / "model"
    if not model:
        write_random_llama(path, layers=2, device="cpu", shape=TINY_LLAMA)
    return path, json.loads((path / "config.json").read_text())["vocab_size"]
