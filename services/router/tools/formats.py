"""The tool-call formats models write, and which one a model uses: `--tool-call-parser` when set, else the chat
template's own markers, else the model type (config.json's `model_type`).

- hermes (Hermes, Qwen2.5 / Qwen3): `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block a call.
- llama3_json (Llama 3.1 / 3.2 / 3.3): the output is `{"name": "f", "parameters": {...}}` (optionally after
  `<|python_tag|>`), several separated by `; `.
- mistral (Mistral / Mixtral instruct): `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes its calls: what opens a call region, what closes a call, the arguments' key."""

    name: str
    markers: tuple[str, ...]  # text that opens a call region anywhere in the output
    end: str  # text after each call's JSON object ("" none)
    opener: str  # a JSON opener that starts the call region when it begins the output ("" none)
    array: bool  # the calls are the objects of one JSON array (after the marker)
    args_key: str  # the key the model writes the arguments under ("arguments" is read as well)
    separator: str  # between two calls, as the grammar writes them
    short_ids: bool = False  # Mistral's templates require 9-character alphanumeric call ids

    def call_prefix(self, name: str) -> str:
        """What the grammar writes before a call's arguments (the marker for per-call formats, the name)."""
        head = f"{self.markers[0]}\n" if not self.array and self.end else ""
        return f'{head}{{"name": {json.dumps(name)}, "{self.args_key}": '

    def call_suffix(self) -> str:
        return "}" + (f"\n{self.end}" if self.end else "")

    def new_id(self) -> str:
        """A fresh call id in the form the model's template accepts back in the history."""
        if self.short_ids:
            alphabet = string.ascii_letters + string.digits
            return "".join(secrets.choice(alphabet) for _ in range(9))
        return "call_" + uuid.uuid4().hex[:24]


HERMES = ToolFormat(
    "hermes", ("<tool_call>",), end="</tool_call>", opener="", array=False, args_key="arguments", separator="\n"
)
LLAMA3_JSON = ToolFormat(
    "llama3_json", ("<|python_tag|>",), end="", opener="{", array=False, args_key="parameters", separator="; "
)
MISTRAL = ToolFormat(
    "mistral", ("[TOOL_CALLS]",), end="", opener="[", array=True, args_key="arguments", separator=", ", short_ids=True
)
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}
# model_type (config.json) -> format, when the chat template shows no markers
BY_MODEL_TYPE = {"qwen2": HERMES, "qwen3": HERMES, "qwen2_moe": HERMES, "llama": LLAMA3_JSON, "mistral": MISTRAL}


def format_named(name: str) -> ToolFormat:
    """The format of a `--tool-call-parser` value (ValueError naming the choices for an unknown one)."""
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call parser {name!r}: one of {', '.join(FORMATS)}")
    return FORMATS[name]


def model_type(tokenizer) -> str:
    """config.json's `model_type` next to the tokenizer's files ("" when there is none)."""
    path = Path(str(getattr(tokenizer, "name_or_path", "") or "")) / "config.json"
    try:
        value = json.loads(path.read_text()).get("model_type", "")
    except (OSError, ValueError, AttributeError):
        return ""
    return value if isinstance(value, str) else ""


def template_text(tokenizer) -> str:
    """The tokenizer's chat template source ("" none); a dict of named templates is joined."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, dict) else str(template)


def choose_format(tokenizer, override: str = "") -> ToolFormat:
    """The model's tool-call format: `override` (the router's --tool-call-parser), else the markers its chat template
    writes, else its model type, else hermes."""
    if override:
        return format_named(override)
    template = template_text(tokenizer)
    for fmt in (HERMES, MISTRAL, LLAMA3_JSON):
        if any(m in template for m in fmt.markers):
            return fmt
    return BY_MODEL_TYPE.get(model_type(tokenizer), HERMES)
