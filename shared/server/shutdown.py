"""SIGTERM / SIGINT of a service process, always honoured.

`Shutdown.install()` runs first thing in `pdserve serve` (before a model or tokenizer loads). A signal that comes
before the service serves ends the process at once (there is nothing to drain); once it serves, the first signal
starts the drain (`wait()` returns) and a second one ends the process at once. The handler only writes a byte to a
pipe (no lock is taken in signal context, so it cannot deadlock with the thread it interrupts); the pipe is also
the interpreter's wakeup fd, so a signal delivered to another thread (gRPC's) still wakes the waiting main thread.
"""

from __future__ import annotations

import logging
import os
import select
import signal

log = logging.getLogger("pdserve.server.shutdown")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Shutdown:
    def __init__(self, name: str):
        self.name = name
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._serving = False
        self._requested = False

    @classmethod
    def install(cls, name: str) -> Shutdown:
        """The process's handler: the one installed already (the signal table is its registry), else a new one."""
        existing = cls.installed()
        if existing is not None:
            return existing
        shutdown = cls(name)
        for sig in SIGNALS:
            signal.signal(sig, shutdown._on_signal)
        signal.set_wakeup_fd(shutdown._write, warn_on_full_buffer=False)
        return shutdown

    @staticmethod
    def installed() -> Shutdown | None:
        owner = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
        return owner if isinstance(owner, Shutdown) else None

    def _on_signal(self, signum: int, _frame) -> None:
        if self._requested or not self._serving:
            why = "second signal" if self._requested else "not serving yet"
            os.write(2, f"{self.name}: {signal.Signals(signum).name} ({why}): exiting now\n".encode())
            os._exit(128 + signum)
        self._requested = True
        try:
            os.write(self._write, b"x")
        except BlockingIOError:
            pass

    def serving(self) -> None:
        """From now on a signal drains instead of exiting at once."""
        self._serving = True

    @property
    def requested(self) -> bool:
        return self._requested

    def wait(self) -> None:
        """Block until the first signal was handled (the bounded select covers a byte read before the Python-level
        handler ran)."""
        while not self._requested:
            ready, _, _ = select.select([self._read], [], [], 0.5)
            if ready:
                os.read(self._read, 64)
