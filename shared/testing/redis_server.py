"""A private `redis-server` process on a free loopback port (tests, benchmarks): no persistence, optional
maxmemory / eviction policy, killable and restartable on the same port."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from redis.exceptions import AuthenticationError, ResponseError

from pdserve.server.grpc_util import free_port


class RedisServer:
    def __init__(self, workdir: Path | str, port: int = 0, args: list[str] = ()):
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not on PATH")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.args = list(args)
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
        log = (self.workdir / f"redis-{self.port}.log").open("ab")
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
                *self.args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
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
                raise RuntimeError(f"redis-server on port {self.port} did not start (see {log.name})")
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
