"""The router's per-model state: tokenizer and chat template, context length, vocabulary, sampling defaults and
output-length estimator of every served model (`ModelContext`), and which model a request names (`resolve`).

The router's own `--model` is loaded at start and kept. Another model's context is loaded from the directory its
instances announced when a request first names it (`pdserve.router.tokenizer`, no torch), and kept in a bounded
least-recently-used cache (`max_models`); an evicted model saves its estimator and is loaded again when named.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.engine.reasoning_budget import ThinkTags
from pdserve.models.generation_config import GenerationDefaults
from pdserve.router.estimator import OutputLengthEstimator
from pdserve.router.estimator_store import Persistence, open_store
from pdserve.router.pcs import special_token_ids
from pdserve.router.reasoning import reasoning_tags

log = logging.getLogger("pdserve.router.catalog")


class UnknownModel(LookupError):
    """The request names a model no instance serves (NOT_FOUND)."""


class AmbiguousModel(ValueError):
    """The request names no model while several are served (INVALID_ARGUMENT)."""


class ModelUnavailable(RuntimeError):
    """A served model's tokenizer cannot be loaded here (UNAVAILABLE): its announced directory is not readable."""


def model_id(model_dir: str | Path) -> str:
    """Identity of the tokenizer + config (what the estimator's signatures depend on), stable across restarts."""
    h = hashlib.sha256()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        p = Path(model_dir) / name
        if p.exists():
            h.update(name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


@dataclass(eq=False)
class ModelContext:
    """Everything the router needs to tokenize, validate and score a request for one served model."""

    name: str
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    generation_defaults: GenerationDefaults
    estimator: OutputLengthEstimator
    persistence: Persistence | None = None  # None: the estimator is not saved (tests)
    path: str = ""
    special_ids: frozenset[int] = field(init=False)
    think_tags: ThinkTags | None = field(init=False)  # max_reasoning_tokens needs them
    split_tags: Any = field(init=False)  # the reasoning split's default: on when the tags show in text

    def __post_init__(self) -> None:
        self.special_ids = special_token_ids(self.tokenizer)
        self.think_tags = ThinkTags.from_tokenizer(self.tokenizer)
        self.split_tags = reasoning_tags(self.tokenizer)

    def start(self) -> None:
        if self.persistence is not None:
            self.persistence.load()
            self.persistence.start()

    def close(self) -> None:
        if self.persistence is not None:
            self.persistence.close()


def load_model_context(
    name: str, path: str, estimator_store: str, min_samples: int, max_error: float, save_interval_s: float
) -> ModelContext:
    """Load model `name` from directory `path` (tokenizer, config.json, generation_config.json) with its estimator
    restored from `estimator_store` (a file store gets one file per model: PATH.<model id>)."""
    model_dir = Path(path)
    if not path or not (model_dir / "config.json").is_file():
        raise ModelUnavailable(
            f"model {name!r}: its instances announced the directory {path!r}, which holds no config.json on the "
            f"router's host (the router loads each model's tokenizer from the directory its instances name)"
        )
    from pdserve.router.tokenizer import load_tokenizer

    cfg = json.loads((model_dir / "config.json").read_text())
    mid = model_id(model_dir)
    store = estimator_store
    if store and store != "memory" and not store.startswith(("redis://", "rediss://", "unix://")):
        store = f"{store}.{mid}"  # a file: one per model (a Redis key already names the model)
    estimator = OutputLengthEstimator(min_samples, max_error, model=mid)
    ctx = ModelContext(
        name,
        load_tokenizer(model_dir),
        max_model_len=int(cfg["max_position_embeddings"]),
        vocab_size=int(cfg["vocab_size"]),
        generation_defaults=GenerationDefaults.from_model_dir(model_dir),
        estimator=estimator,
        persistence=Persistence(estimator, open_store(store, mid), save_interval_s),
        path=str(model_dir),
    )
    log.info("model %r loaded from %s", name, model_dir)
    return ctx


Loader = Callable[[str, str], ModelContext]  # (name, directory) -> a started context


class ModelCatalog:
    """The default model (always loaded) plus up to `max_models` - 1 others, least recently used evicted."""

    def __init__(self, default: ModelContext, loader: Loader, max_models: int):
        self.default = default
        self._loader = loader
        self._max_others = max(0, max_models - 1)
        self._lock = threading.Lock()
        self._others: OrderedDict[str, ModelContext] = OrderedDict()

    def get(self, name: str, path: str) -> ModelContext:
        """The context of served model `name` (loading it from `path` on first use; ModelUnavailable when that
        fails). A model whose instances now announce another directory is loaded again from it."""
        if name == self.default.name:
            return self.default
        if not self._max_others:
            raise ModelUnavailable(f"model {name!r}: this router loads only its own --model (--max-models 1)")
        with self._lock:
            ctx = self._others.get(name)
            if ctx is not None and (not path or ctx.path == str(Path(path))):
                self._others.move_to_end(name)
                return ctx
        ctx = self._loader(name, path)  # outside the lock: requests for loaded models keep going meanwhile
        evicted: list[ModelContext] = []
        with self._lock:
            old = self._others.pop(name, None)
            if old is not None:
                evicted.append(old)
            self._others[name] = ctx
            while len(self._others) > self._max_others:
                evicted.append(self._others.popitem(last=False)[1])
        for e in evicted:
            log.info("model %r unloaded (cache of %d models)", e.name, self._max_others + 1)
            e.close()
        return ctx

    def loaded(self) -> list[ModelContext]:
        with self._lock:
            return [self.default, *self._others.values()]

    def close(self) -> None:
        for ctx in self.loaded():
            ctx.close()


def resolve(requested: str, served: dict[str, str]) -> str:
    """The served model a request runs on: `requested`, or the only one served when it names none. Raises
    UnknownModel (not served) or AmbiguousModel (none named, several served)."""
    names = ", ".join(repr(n) for n in sorted(served))
    if not requested:
        if len(served) == 1:
            return next(iter(served))
        raise AmbiguousModel(f"this router serves several models ({names}): name one in `model`")
    if requested not in served:
        raise UnknownModel(f"the model {requested!r} is not served here; served: {names or 'none'}")
    return requested
