"""The model's own sampling defaults, from its `generation_config.json`.

The router fills them into every request's sampling fields the caller left unset (an explicit value, temperature 0
included, always wins), so the SDK, the CLI and the OpenAI gateway all get them. Read as Hugging Face's `generate`
reads the file: `do_sample: false` (set explicitly) means greedy; otherwise `temperature`, `top_p` and `top_k`,
each where present. Keys absent from the file keep pdserve's own defaults (temperature 1.0, top_p 1.0, top_k off).
The engine has no repetition penalty (nor min_p / typical_p / n-gram blocking): those keys are reported as ignored.
EOS ids are the engine's (`pdserve.engine.loader` adds the file's `eos_token_id` to config.json's).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FILENAME = "generation_config.json"
# keys whose non-neutral values change sampling in ways this engine does not implement: name -> neutral value
UNSUPPORTED = {"repetition_penalty": 1.0, "min_p": None, "typical_p": 1.0, "no_repeat_ngram_size": 0}


@dataclass(frozen=True)
class GenerationDefaults:
    """Per-model sampling defaults; None: not set by the model (pdserve's default applies)."""

    temperature: float | None = None  # 0: greedy
    top_p: float | None = None
    top_k: int | None = None
    ignored: tuple[str, ...] = ()  # "key=value (why)" of the file's settings not applied

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> GenerationDefaults:
        """The defaults of a parsed generation_config.json; an out-of-range value is ignored (and named)."""
        ignored = [
            f"{k}={cfg[k]!r} (the engine does not support it)"
            for k, neutral in UNSUPPORTED.items()
            if cfg.get(k) is not None and cfg[k] != neutral
        ]
        if cfg.get("do_sample") is False:  # Hugging Face: greedy, whatever temperature / top_p / top_k say
            return cls(temperature=0.0, ignored=tuple(ignored))
        temperature = _number(cfg, "temperature", float, lambda v: math.isfinite(v) and v >= 0.0, ignored)
        top_p = _number(cfg, "top_p", float, lambda v: 0.0 < v <= 1.0, ignored)
        top_k = _number(cfg, "top_k", int, lambda v: v >= 0, ignored)
        return cls(temperature, top_p, top_k, tuple(ignored))

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> GenerationDefaults:
        """The defaults of `model_dir/generation_config.json`; none when the file is missing or unreadable."""
        path = Path(model_dir) / FILENAME
        if not path.exists():
            return cls()
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            log.warning("%s unreadable (%s): pdserve's sampling defaults apply", path, e)
            return cls()
        return cls.from_dict(cfg) if isinstance(cfg, dict) else cls()

    def describe(self) -> str:
        """One line for the log: what the model sets, and what is ignored."""
        parts = [f"{k} {v}" for k, v in (("temperature", self.temperature), ("top_p", self.top_p),
                                          ("top_k", self.top_k)) if v is not None]  # fmt: skip
        text = ", ".join(parts) if parts else "none (pdserve's: temperature 1.0, top_p 1.0, top_k off)"
        if self.ignored:
            text += f"; ignored: {', '.join(self.ignored)}"
        return text


def _number(cfg: dict[str, Any], key: str, kind: type, valid: Callable[[Any], bool], ignored: list[str]) -> Any:
    """cfg[key] as `kind` when present and `valid`; else None (a bad value noted in `ignored`)."""
    v = cfg.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        ignored.append(f"{key}={v!r} (not {'an integer' if kind is int else 'a number'})")
        return None
    if not valid(kind(v)):
        ignored.append(f"{key}={v!r} (out of range)")
        return None
    return kind(v)
