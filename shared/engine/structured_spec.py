"""What a request's output must match (structured output), as plain data: torch- and grammar-engine-free, so that
the router and the gateway can check it. `pdserve.engine.structured` compiles it into a token mask."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pdserve.engine.request_limits import MAX_CHOICES, MAX_STRUCTURED_CHARS
from pdserve.errors import InvalidRequest

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredSpec:
    """`kind` one of KINDS; `value`: the JSON schema text, the regex, the EBNF grammar or the xgrammar structural
    tag (JSON text) ("" for json_object);
    `choices`: the allowed outputs (kind "choice")."""

    kind: str
    value: str = ""
    choices: tuple[str, ...] = field(default_factory=tuple)

    def validate(self) -> None:
        """Raise InvalidRequest for a spec that cannot be compiled (the grammar engine reports syntax errors in
        regexes and grammars when the engine compiles it)."""
        if self.kind not in KINDS:
            raise InvalidRequest(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        size = len(self.value) + sum(len(c) for c in self.choices)
        if size > MAX_STRUCTURED_CHARS:
            raise InvalidRequest(f"structured output of {size} characters: at most {MAX_STRUCTURED_CHARS}")
        if self.kind in ("json_schema", "regex", "grammar", "structural_tag") and not self.value:
            raise InvalidRequest(f"structured output {self.kind} is empty")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except ValueError as e:
                raise InvalidRequest(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequest("json_schema must be a JSON object (a JSON Schema)")
        if self.kind == "structural_tag":
            try:
                tag = json.loads(self.value)
            except ValueError as e:
                raise InvalidRequest(f"structural_tag is not valid JSON: {e}") from None
            if not isinstance(tag, dict) or tag.get("type") != "structural_tag":
                raise InvalidRequest('structural_tag must be a JSON object with "type": "structural_tag"')
        if self.kind == "choice":
            if not self.choices or len(self.choices) > MAX_CHOICES:
                raise InvalidRequest(f"choice needs 1 to {MAX_CHOICES} strings, got {len(self.choices)}")
            if not all(isinstance(c, str) and c for c in self.choices):
                raise InvalidRequest("choice strings must be non-empty")
