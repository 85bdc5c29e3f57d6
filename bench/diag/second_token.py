"""The served first and second token of one prompt at a time, side by side for variants of the code: the stack of
`pdserve up` on one host (router, prefill, decode; `start_stack`, with `pdserve up`'s MPS default: --mps), one variant
after another, each on a stack of its own.

    python bench/diag/second_token.py [--model DIR --gpus 0] [--prompt 2048] [--probes 15] VARIANT [VARIANT ...]

VARIANT: NAME (this tree) or NAME=DIR, DIR a tree of another commit (its shared/ and services/, e.g. `git archive REV
shared services | tar -x -C DIR`), made the package `pdserve` as pyproject maps it (a directory of links) and put first
on the PYTHONPATH of that variant's stack; or NAME@KEY=VALUE[,KEY=VALUE...]: this tree, with those environment variables
set for that variant's stack (a service setting: `PDSERVE_PREFILL_KV_LAYER_GROUP=2`; `PDSERVE_MPS=off`, as `pdserve up`
reads it). Order them alternated (new base new base): hosts drift. Per variant: three warm-up requests, then --probes
requests of --prompt fresh random tokens, one at a time, 3 tokens each, greedy; prints the medians of the first token,
the second, the gap between them and the next gap (the decode step's pace, against which the first gap's excess shows
what the hand-over from prefill to decode costs). Without --model a tiny random Llama on this host's CPU. Figures:
docs/benchmarks.md, "One GPU"."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchutil import model_or_tiny

PROBE = """
import os, random, statistics, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, {bench!r})
from benchutil import token_times_ms
import pdserve
from pdserve.cli.launch import start_stack
gpus = {gpus!r}
extra = ["--kv-transport", {transport!r}] + ([] if gpus else ["--torch-threads", "1"])
mps = os.environ.get("PDSERVE_MPS", {mps!r})  # a variant's own (NAME@PDSERVE_MPS=off), else --mps
stack = start_stack(Path({model!r}), Path(tempfile.mkdtemp(prefix="second-token-")), kv_dtype="int8", extra=extra,
                    gpus=gpus, timeout=600, mps=mps)
rng = random.Random(0)
try:
    with pdserve.Client(stack.router, timeout=120) as c:
        fresh = lambda: [rng.randrange(5, {vocab}) for _ in range({prompt})]
        for _ in range(3):
            token_times_ms(c, fresh(), max_tokens=3)
        res = []
        for _ in range({probes}):
            time.sleep(0.2)
            res.append(token_times_ms(c, fresh(), max_tokens=3)[0])
    m = statistics.median
    figures = [m(r[0] for r in res), m(r[1] for r in res), m(r[1] - r[0] for r in res), m(r[2] - r[1] for r in res)]
    print("RESULT", *figures, Path(pdserve.__file__).parent)
finally:
    stack.stop()
"""


def package_links(tree: Path, into: Path) -> Path:
    """`into`/pdserve: links to `tree`'s shared/* and services/* (the package as pyproject maps it); returns `into`."""
    pkg = into / "pdserve"
    pkg.mkdir(parents=True)
    for f in [*(tree / "shared").iterdir(), *(tree / "services").iterdir()]:
        (pkg / f.name).symlink_to(f.resolve())
    return into


def variant_env(settings: str) -> dict[str, str]:
    """KEY=VALUE[,KEY=VALUE...] -> {KEY: VALUE}."""
    pairs = [p.partition("=") for p in settings.split(",") if p]
    if not pairs or any(not k or not eq for k, eq, _ in pairs):
        raise SystemExit(f"variant settings {settings!r}: want KEY=VALUE[,KEY=VALUE...]")
    return {k: v for k, _, v in pairs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "variants", nargs="+", help="NAME (this tree), NAME=DIR (another commit's tree) or NAME@KEY=VALUE[,...]"
    )
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens of each request")
    ap.add_argument("--probes", type=int, default=15, help="requests per variant, after three warm-up ones")
    stack = ap.add_argument_group("each variant's stack")
    stack.add_argument("--model", default="", help="a model directory (default: a tiny random Llama, written here)")
    stack.add_argument("--gpus", default="", help="comma-separated GPU indices for the engines (`pdserve up --gpus`)")
    stack.add_argument("--transport", default="auto", help="the KV transport (`pdserve up --kv-transport`)")
    stack.add_argument(
        "--mps",
        default="auto",
        choices=("off", "auto", "on"),
        help="`pdserve up --mps` (its default: auto, MPS where prefill and decode share a GPU); a variant's "
        "PDSERVE_MPS overrides it",
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="second-token-"))
    model, vocab = model_or_tiny(args.model, tmp)
    gpus = [int(g) for g in args.gpus.split(",") if g]
    bench = str(Path(__file__).resolve().parents[1])
    code = PROBE.format(bench=bench, gpus=gpus, transport=args.transport, mps=args.mps, model=str(model),
                        vocab=min(30000, vocab - 1), prompt=args.prompt, probes=args.probes)  # fmt: skip
    print(f"{'variant':10s} {'first':>8s} {'second':>8s} {'gap':>7s} {'next':>7s}  code (ms, medians of {args.probes})")
    for i, variant in enumerate(args.variants):
        env = dict(os.environ)
        name, at, settings = variant.partition("@")
        tree = ""
        if at:
            env.update(variant_env(settings))
        else:
            name, _, tree = variant.partition("=")
        if tree:
            path = package_links(Path(tree), tmp / f"variant-{i}")
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH", "")) if p)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")), None)
        if line is None:
            print(f"{name:10s} failed:\n{out.stdout[-1500:]}\n{out.stderr[-3000:]}", flush=True)
            continue
        *figures, where = line.split()[1:]
        first, second, gap, nxt = (float(v) for v in figures)
        where = f"{where} {settings}" if at else where
        print(f"{name:10s} {first:8.2f} {second:8.2f} {gap:7.2f} {nxt:7.2f}  {where}", flush=True)


if __name__ == "__main__":
    main()
