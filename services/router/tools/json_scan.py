"""An incremental JSON scanner for tool calls: fed the text of a call region character by character, it reports
where each call object starts and ends, its `name` once the string is complete, and the characters of its
arguments value as they arrive (so they can be streamed). It checks structure only (brackets, strings, escapes);
the parser decides what an incomplete or nameless call becomes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

CALL_START, NAME, ARGS, ARGS_DONE, CALL_END, VALUE_END, INVALID = (
    "call_start",
    "name",
    "args",
    "args_done",
    "call_end",
    "value_end",
    "invalid",
)
ARGS_KEYS = ("arguments", "parameters")
WHITESPACE = " \t\r\n"


@dataclass
class CallScanner:
    """`array`: the region is one JSON array of call objects (Mistral), else one call object (Hermes, Llama).
    `feed(c)` returns the events of one character: (kind, text) pairs of the kinds above."""

    array: bool
    stack: list[str] = field(default_factory=list)  # open '{' / '['
    started: bool = False
    done: bool = False
    in_string: bool = False
    escaped: bool = False
    expect_key: bool = False  # in a call object, before a key
    expect_value: bool = False  # in a call object, after a key's ':'
    key: str = ""
    key_chars: list[str] | None = None  # the key string being read (raw, quotes included)
    capture: str = ""  # "name" | "args": the call-level value being read
    scalar: bool = False  # that value is a number / literal (ends at , } or whitespace)
    name_chars: list[str] = field(default_factory=list)

    @property
    def call_level(self) -> int:
        """len(stack) inside a call object."""
        return 2 if self.array else 1

    def feed(self, c: str) -> list[tuple[str, str]]:
        if self.done:
            return [(INVALID, c)]
        if not self.started:
            if c in WHITESPACE:
                return []
            if c != ("[" if self.array else "{"):
                return [(INVALID, c)]
            self.started = True
            self.stack.append(c)
            if self.array:
                return []
            self.expect_key = True
            return [(CALL_START, "")]
        if self.in_string:
            return self._string_char(c)
        return self._structure_char(c)

    def _string_char(self, c: str) -> list[tuple[str, str]]:
        events = [(ARGS, c)] if self.capture == "args" else []
        if self.key_chars is not None:
            self.key_chars.append(c)
        elif self.capture == "name":
            self.name_chars.append(c)
        if self.escaped:
            self.escaped = False
            return events
        if c == "\\":
            self.escaped = True
            return events
        if c != '"':
            return events
        self.in_string = False
        at_call_level = len(self.stack) == self.call_level
        if self.key_chars is not None:
            self.key = _decoded("".join(self.key_chars))
            self.key_chars = None
        elif at_call_level and self.capture == "name":
            events.append((NAME, _decoded("".join(self.name_chars))))
            self.capture = ""
        elif at_call_level and self.capture == "args":
            events.append((ARGS_DONE, ""))
            self.capture = ""
        return events

    def _start_value(self, c: str) -> None:
        self.expect_value = False
        self.capture = "name" if self.key == "name" else "args" if self.key in ARGS_KEYS else ""
        self.name_chars = ['"'] if self.capture == "name" and c == '"' else []
        if self.capture == "name" and c != '"':
            self.capture = ""  # a name that is not a string: no name
        self.scalar = c not in '"{['

    def _end_scalar(self) -> list[tuple[str, str]]:
        was_args = self.capture == "args"
        self.capture, self.scalar = "", False
        return [(ARGS_DONE, "")] if was_args else []

    def _structure_char(self, c: str) -> list[tuple[str, str]]:
        level = len(self.stack)
        at_call_level = level == self.call_level
        events: list[tuple[str, str]] = []
        if at_call_level and self.expect_value and c not in WHITESPACE:
            self._start_value(c)
        if at_call_level and self.scalar and (c in WHITESPACE or c in ",}"):
            events += self._end_scalar()
        if self.capture == "args":
            events.append((ARGS, c))
        if c == '"':
            self.in_string = True
            if at_call_level and self.expect_key:
                self.expect_key = False
                self.key_chars = ['"']
        elif c in "{[":
            self.stack.append(c)
            if self.array and level == 1 and c == "{":
                self.expect_key = True
                events.append((CALL_START, ""))
        elif c in "}]":
            if not self.stack or {"}": "{", "]": "["}[c] != self.stack[-1]:
                return [*events, (INVALID, c)]
            self.stack.pop()
            level = len(self.stack)
            if level == self.call_level and self.capture == "args":  # a container value closed
                self.capture = ""
                events.append((ARGS_DONE, ""))
            if level == self.call_level - 1:
                self.key, self.expect_key, self.expect_value = "", False, False
                events.append((CALL_END, ""))
            if level == 0:
                self.done = True
                events.append((VALUE_END, ""))
        elif at_call_level and c == ",":
            self.expect_key = True
        elif at_call_level and c == ":":
            self.expect_value = True
        return events


def _decoded(raw: str) -> str:
    """A JSON string literal's value ("" when it is not one, e.g. a raw control character in it)."""
    try:
        value = json.loads(raw, strict=False)
    except ValueError:
        return ""
    return value if isinstance(value, str) else ""
