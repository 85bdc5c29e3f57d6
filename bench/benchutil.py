"""What the bench scripts share (a plain module: a script's own folder is on sys.path): timestamped log lines, the
table of figures a run prints at its end (`row`, `print_rows`), and the TTFT of one short greedy stream."""

from __future__ import annotations

import time

import pdserve

ROWS: list[tuple[str, str, str]] = []  # (figure, value, note) for the final table


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def row(name: str, value: str, note: str = "") -> None:
    """One figure of the final table (logged now)."""
    ROWS.append((name, value, note))
    log(f"{name}: {value} {note}")


def print_rows() -> None:
    """The figures so far as a Markdown table."""
    print("\n| figure | value | note |\n|---|---|---|")
    for name, value, note in ROWS:
        print(f"| {name} | {value} | {note} |")


def token_times_ms(client: pdserve.Client, ids: list[int], max_tokens: int = 2) -> list[float]:
    """Milliseconds from sending a greedy stream of `ids` to each of its tokens; the stream is read to its end (a
    caller that leaves after the first token would cancel the request's KV transfer)."""
    t0, times = time.perf_counter(), []
    for ch in client.stream(token_ids=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True):
        times += [(time.perf_counter() - t0) * 1e3] * len(ch.token_ids)
    if not times:
        raise RuntimeError("stream ended without a token")
    return times


def ttft_ms(client: pdserve.Client, ids: list[int]) -> float:
    """Milliseconds from sending a greedy two-token stream of `ids` to its first token (read to its end)."""
    return token_times_ms(client, ids)[0]
