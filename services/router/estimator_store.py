"""Where the output-length estimator persists: a JSON file (the embedded default), Redis, or nowhere.

    ""                      → <PDSERVE_CACHE_DIR or ~/.cache/pdserve>/router-estimator-<model>.json
    "/path/state.json"      → that file (written atomically: tmp file + rename)
    "redis://host:port/db"  → one Redis string key pdserve:router:estimator:<model>
    "memory"                → not persisted

A store that fails (disk full, Redis down) logs and keeps the router serving: the estimator is an
optimisation, never a reason to fail a request.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from pdserve.router.estimator import OutputLengthEstimator

log = logging.getLogger("pdserve.router.estimator")


class MemoryStore:
    def load(self) -> str | None:
        return None

    def save(self, text: str) -> None:
        pass

    def __repr__(self) -> str:
        return "memory"


class FileStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def load(self) -> str | None:
        try:
            return self.path.read_text()
        except FileNotFoundError:
            return None

    def save(self, text: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(self.path)

    def __repr__(self) -> str:
        return f"file {self.path}"


class RedisStore:
    def __init__(self, url: str, key: str, timeout_s: float = 2.0):
        import redis

        self.key = key
        self._r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._url = url

    def load(self) -> str | None:
        raw = self._r.get(self.key)
        if raw is None:
            return None
        return raw.decode() if isinstance(raw, bytes) else raw

    def save(self, text: str) -> None:
        self._r.set(self.key, text)

    def __repr__(self) -> str:
        return f"redis {self._url} key {self.key}"


def open_store(spec: str, model: str) -> MemoryStore | FileStore | RedisStore:
    if spec == "memory":
        return MemoryStore()
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(spec, f"pdserve:router:estimator:{model}")
    if spec:
        return FileStore(spec)
    base = os.environ.get("PDSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pdserve")
    return FileStore(Path(base) / f"router-estimator-{model}.json")


class Persistence:
    """Loads the estimator at start; a daemon thread saves it every `interval_s` when it changed; `close` saves."""

    def __init__(self, estimator: OutputLengthEstimator, store, interval_s: float):
        self.estimator = estimator
        self.store = store
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def load(self) -> bool:
        try:
            text = self.store.load()
        except Exception as e:
            log.warning("could not load estimator from %r: %s", self.store, e)
            return False
        ok = text is not None and self.estimator.load_json(text)
        log.info(
            "estimator %s from %r (%d samples, error %.2f)",
            "restored" if ok else "starts cold",
            self.store,
            self.estimator.samples,
            self.estimator.error,
        )
        return ok

    def save(self) -> None:
        try:
            self.store.save(self.estimator.to_json())
        except Exception as e:
            self.estimator.dirty = True
            log.warning("could not save estimator to %r: %s", self.store, e)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="estimator-save", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.estimator.dirty:
                self.save()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.estimator.dirty:
            self.save()
