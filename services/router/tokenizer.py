"""The router's tokenizer, loaded without torch: the class `tokenizer_config.json` names, taken from transformers'
lazy top-level namespace, so the router process does not hold torch (~200 MB) for nothing. `AutoTokenizer` loads
the model config first, and with it torch; for a generic `TokenizersBackend` it may pick a model-specific subclass,
which reads the same tokenizer.json (tests/services/router/test_tokenizer.py checks both agree). `AutoTokenizer`
itself only when the config names no class transformers has."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def tokenizer_class_name(model_dir: str | Path) -> str | None:
    """The `tokenizer_class` of the model's tokenizer_config.json, None when it has none."""
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.exists():
        return None
    name = json.loads(path.read_text()).get("tokenizer_class")
    return name if isinstance(name, str) and name else None


def load_tokenizer(model_dir: str | Path) -> Any:
    """The model's Hugging Face tokenizer (chat template, special tokens and all), as `AutoTokenizer` loads it."""
    import transformers

    name = tokenizer_class_name(model_dir)
    cls = getattr(transformers, name, None) if name else None
    if cls is None or not hasattr(cls, "from_pretrained"):
        return transformers.AutoTokenizer.from_pretrained(str(model_dir))
    return cls.from_pretrained(str(model_dir))
