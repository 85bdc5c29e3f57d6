"""How long a Python thread of an engine process may keep the GIL from a thread that waits for it.

Every torch op call releases the GIL while it dispatches and takes it back after. While another thread of the
process is running Python (a gRPC handler parsing a message, the prefix fetch building page views, a KV receiver's
bookkeeping), taking it back waits until that thread is asked to drop it, which CPython does only once the waiter
has waited `sys.getswitchinterval()` (5 ms by default). The engine thread launches a prefill chunk as hundreds of
ops: each can wait that long and the GPU runs dry between them (the convoy effect, bench/diag/gil_convoy.py). A
shorter interval bounds each wait; the cost is more frequent switches between threads that both run Python. It did
not speed up a prefill beside a prefix fetch (docs/benchmarks.md), so the default leaves CPython's.
"""

from __future__ import annotations

import sys

PYTHON_DEFAULT_US = 5000.0  # CPython's own interval


def set_switch_interval(us: float) -> float:
    """Set the interpreter's switch interval to `us` microseconds (0: leave CPython's as it is); returns the
    interval in force afterwards, in microseconds."""
    if us < 0:
        raise ValueError(f"a switch interval is >= 0 microseconds, got {us}")
    if us > 0:
        sys.setswitchinterval(us / 1e6)
    return sys.getswitchinterval() * 1e6
