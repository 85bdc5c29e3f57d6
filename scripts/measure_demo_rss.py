"""Memory of the default CPU demo stack: start `pdserve up` as a user does, send two requests, print RSS and PSS of
every process of the stack (from /proc/PID/smaps_rollup), then stop it.

Usage: python scripts/measure_demo_rss.py [--requests 2] [--json OUT] [-- more `pdserve up` flags]
The answers' token ids are printed too, so two versions of the engine can be checked for identical outputs.
Linux only (smaps_rollup). The demo model is fetched once into the cache dir, as `pdserve up` does.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

KEYS = ("rss", "pss", "private", "anon", "peak")  # the columns, in MiB
QUESTIONS = ["What is the capital of France?", "Write one sentence about the sea."]
MIB = 1024 * 1024


def children(pid: int) -> list[int]:
    """Direct children of `pid` (the services are the launcher's children, in their own sessions)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


def memory(pid: int) -> dict[str, int]:
    """Rss, Pss, Private_* and Shared_* in bytes, from smaps_rollup."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        m = re.match(r"(\w+):\s+(\d+) kB", line)
        if m:
            fields[m.group(1)] = int(m.group(2)) * 1024
    return fields


def peak_rss(pid: int) -> int:
    """The process's high-water RSS in bytes (VmHWM: its start-up peak, while the weights load)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def role(pid: int) -> str:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    args = [a.decode() for a in args if a]
    return args[args.index("serve") + 1] if "serve" in args else "launcher"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", default="", help="also write the figures here")
    p.add_argument("up_args", nargs="*", help="more `pdserve up` flags (after --)")
    args = p.parse_args()

    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--port", "0", "--gateway-port", "0", *args.up_args]
    t0 = time.monotonic()
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    router = ready_s = None
    for line in launcher.stdout:
        print("  up> " + line.rstrip(), flush=True)
        m = re.match(r"pdserve is up: router at (\S+)", line)
        router = m.group(1) if m else router
        m = re.match(r"ready in ([\d.]+) s", line)
        if m:
            ready_s = float(m.group(1))
            break
    if router is None or ready_s is None:
        print("error: the stack did not come up", file=sys.stderr)
        return 1
    try:
        import pdserve

        answers = []
        with pdserve.Client(router, timeout=300) as c:
            for q in [QUESTIONS[i % len(QUESTIONS)] for i in range(args.requests)]:
                out = c.generate(messages=[{"role": "user", "content": q}], max_tokens=args.max_tokens, temperature=0)
                answers.append(out.token_ids)
                print(f"  {q!r} -> {out.text!r}\n    token_ids {list(out.token_ids)}", flush=True)
        time.sleep(1.0)  # let the services settle (freed buffers, the router's bookkeeping)
        rows = []
        for pid in [launcher.pid, *children(launcher.pid)]:
            mem = memory(pid)
            rows.append({"process": role(pid), "pid": pid, "rss": mem["Rss"], "pss": mem["Pss"],
                         "private": mem.get("Private_Clean", 0) + mem.get("Private_Dirty", 0),
                         "anon": mem.get("Anonymous", 0), "peak": peak_rss(pid)})  # fmt: skip
    finally:
        launcher.send_signal(signal.SIGINT)  # drains and stops every service
        launcher.wait(timeout=60)
    print(f"\nready in {ready_s:.1f} s (launcher up to 'ready': {time.monotonic() - t0:.0f} s incl. the requests)")
    print(f"{'process':<10} {'pid':>7} {'RSS MiB':>8} {'PSS MiB':>8} {'private':>8} {'anon':>8} {'peak RSS':>8}")
    for r in rows:
        print(f"{r['process']:<10} {r['pid']:>7} " + " ".join(f"{r[k] / MIB:>8.0f}" for k in KEYS))
    total = {k: sum(r[k] for r in rows) for k in KEYS}
    print(f"{'total':<10} {'':>7} " + " ".join(f"{total[k] / MIB:>8.0f}" for k in KEYS))
    print(
        f"total RSS {total['rss'] / 1e9:.3f} GB ({total['rss'] / MIB:.0f} MiB), PSS {total['pss'] / 1e9:.3f} GB; "
        f"peak RSS at most {total['peak'] / 1e9:.3f} GB (the sum of each process's own peak)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"ready_s": ready_s, "rows": rows, "total": total,
                                               "token_ids": [list(a) for a in answers]}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
