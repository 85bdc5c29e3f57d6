"""A service started by a launcher (`pdserve up`, `start_stack`) ends when that launcher is gone.

The launcher starts each service in a session of its own (so a terminal's Ctrl-C reaches the launcher only, which
stops the services one signal each); a launcher killed outright (SIGKILL, the OOM killer) would leave them serving,
holding their GPU memory and ports, and the next `pdserve up` would fail on both. `start_service` puts the
launcher's pid in the service's environment (`LAUNCHER_PID_ENV`); `watch_launcher` polls the process's parent and,
once it is no longer that pid (the service was reparented), sends the process SIGTERM: the same drain as
`Stack.stop`'s signal (pdserve.server.shutdown), and a second signal still ends it at once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping

log = logging.getLogger("pdserve.server.launcher_watch")

LAUNCHER_PID_ENV = "PDSERVE_LAUNCHER_PID"
POLL_S = 1.0


def launcher_pid(environ: Mapping[str, str]) -> int | None:
    """The launcher's pid from the environment (None: started by hand, by Compose, by Kubernetes…)."""
    text = environ.get(LAUNCHER_PID_ENV, "").strip()
    if not text:
        return None
    try:
        pid = int(text)
    except ValueError:
        raise SystemExit(f"${LAUNCHER_PID_ENV} must be a process id, got {text!r}") from None
    return pid if pid > 1 else None


def watch_launcher(
    environ: Mapping[str, str],
    on_gone: Callable[[], None] | None = None,
    poll_s: float = POLL_S,
    stop: threading.Event | None = None,
) -> threading.Thread | None:
    """Start a daemon thread that calls `on_gone` (default: SIGTERM to this process) once this process's parent is
    no longer the launcher named in `environ`; None where none is named. `stop` ends the watch (tests)."""
    pid = launcher_pid(environ)
    if pid is None:
        return None
    gone = on_gone or (lambda: os.kill(os.getpid(), signal.SIGTERM))
    done = stop or threading.Event()

    def watch() -> None:
        while os.getppid() == pid:
            if done.wait(poll_s):
                return
        log.warning("the launcher (pid %d) is gone: shutting down", pid)
        gone()

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread
