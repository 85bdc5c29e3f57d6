"""A private `redis-server` process on a free loopback port (tests, benchmarks): no persistence, optional
maxmemory / eviction policy, killable and restartable on the same port.

redis-server cannot bind port 0 and report the port it got, so a free port is probed and redis-server started on
it; should another process take the port in between (the server then exits with "Address already in use"), it
is started again on a new one, a bounded number of times. Arguments equal to `RedisServer.FREE_PORT` (e.g. after
`--tls-port`) get a probed port the same way; `extra_ports` holds them."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from redis.exceptions import AuthenticationError, ResponseError


def _unused_port() -> int:
    """A loopback port free a moment ago: only for a retry loop that survives losing it (see the module doc)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    FREE_PORT = "{free port}"  # placeholder argument: replaced by a probed port at start
    BIND_ATTEMPTS = 5

    def __init__(self, workdir: Path | str, port: int = 0, args: Sequence[str] = ()):
        """`port` 0: a free one (kept across restarts); `args`: extra redis-server arguments."""
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not on PATH")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port
        self.args = list(args)
        self.extra_ports: list[int] = []  # the ports given to FREE_PORT arguments, in order
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kw):
        """A plain client (no retries: a dead server fails at once)."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, retry=Retry(NoBackoff(), 0), **kw)

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start and wait until it answers; free ports not fixed yet are probed, again on a bind conflict."""
        pick_port = self.port == 0
        pick_extra = self.FREE_PORT in self.args and not self.extra_ports
        attempts = 0
        while True:
            attempts += 1
            if pick_port:
                self.port = _unused_port()
            if pick_extra:
                self.extra_ports = [_unused_port() for a in self.args if a == self.FREE_PORT]
            try:
                return self._start_once(timeout)
            except _BindConflict:
                if not (pick_port or pick_extra) or attempts == self.BIND_ATTEMPTS:
                    raise

    def _start_once(self, timeout: float) -> RedisServer:
        extra = iter(self.extra_ports)
        args = [str(next(extra)) if a == self.FREE_PORT else a for a in self.args]
        log_path = self.workdir / f"redis-{self.port}.log"
        log = log_path.open("ab")
        log_start = log.tell()
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                *args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()  # the child holds its own descriptor
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.client().ping():
                    return self
            except (AuthenticationError, ResponseError):  # e.g. NOAUTH with --requirepass: it is up and answering
                return self
            except Exception:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                with log_path.open("rb") as f:
                    f.seek(log_start)
                    if b"Address already in use" in f.read():
                        raise _BindConflict(f"redis-server: port {self.port} or an extra port is taken")
                raise RuntimeError(f"redis-server on port {self.port} did not start (see {log_path})")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-whatever, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def restart(self, timeout: float = 10.0) -> RedisServer:
        """Start again on the same port (empty: no persistence)."""
        self.kill()
        return self.start(timeout)


class _BindConflict(RuntimeError):
    """redis-server exited because a port it was to bind is taken."""
