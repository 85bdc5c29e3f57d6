"""Tool calls parsed back out of a model's output, incrementally: feed the text deltas in order and get back the
text outside calls (content) and call deltas (OpenAI's streaming shape: a call's id and name first, then pieces of
its arguments). One parser serves the three formats of `formats.py`; a whole response is the same parser fed once
(`parse_calls`), so a stream and a whole response always agree.

Text before a call streams as content; a possible marker split over deltas is held back until decided. A region
that turns out not to be a call (no `name` by the time its JSON closes, or no JSON after the marker) is given
back as content. Whitespace between and after calls is dropped. Known limit: a call whose arguments already
streamed stays a call when the output is cut off inside it (finish_reason `length` says so)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pdserve.router.tools import json_scan
from pdserve.router.tools.formats import ToolFormat
from pdserve.router.tools.json_scan import CallScanner

TEXT, REGION, AFTER = "text", "region", "after"


@dataclass
class CallDelta:
    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str


@dataclass
class _Call:
    """The call being read: confirmed (given an index) once its name is known."""

    index: int | None = None
    args: list[str] = field(default_factory=list)  # arguments text not sent yet
    args_seen: bool = False
    streamed: bool = True  # arguments stream as they come (an object value), else sent whole when complete


class ToolCallParser:
    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.mode = TEXT
        self.pending = ""  # text not decided yet
        self.at_start = True  # nothing but whitespace seen so far
        self.calls = 0  # calls confirmed so far
        self.region: list[str] = []  # the current region's raw text (given back when it is not a call)
        self.region_calls = 0  # calls confirmed in the current region
        self.scanner: CallScanner | None = None
        self.call: _Call | None = None
        self.gap = ""  # whitespace content after a call, sent only when more content follows
        self._content: list[str] = []
        self._deltas: list[CallDelta] = []

    # ---- public --------------------------------------------------------------------------------------------
    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """(content, call deltas) of the next text delta."""
        self.pending += text
        self._run(final=False)
        return self._take()

    def finish(self) -> tuple[str, list[CallDelta]]:
        """What was held back, at the end of the output."""
        self._run(final=True)
        if self.mode == REGION and self.region_calls == 0:  # an unfinished region that named no call: text
            self._text("".join(self.region))
        elif self.call is not None and self.call.index is not None and self.call.args:
            self._send_args(self.call)
        self.mode, self.region, self.call, self.scanner = TEXT, [], None, None
        self.gap = ""
        return self._take()

    # ---- states --------------------------------------------------------------------------------------------
    def _take(self) -> tuple[str, list[CallDelta]]:
        content, deltas = "".join(self._content), _merged(self._deltas)
        self._content, self._deltas = [], []
        return content, deltas

    def _text(self, s: str) -> None:
        if not s:
            return
        if self.calls and not s.strip():
            self.gap += s
            return
        self._content.append(self.gap + s)
        self.gap = ""

    def _run(self, final: bool) -> None:
        while self.pending:
            before = (self.mode, len(self.pending))
            if self.mode == TEXT:
                self._in_text(final)
            elif self.mode == REGION:
                self._in_region()
            else:
                self._after_call(final)
            if (self.mode, len(self.pending)) == before:  # held back: needs more text
                if final and self.mode == TEXT:
                    self._text(self.pending)
                    self.pending = ""
                return

    def _in_text(self, final: bool) -> None:
        buf = self.pending
        if self.at_start:
            stripped = buf.lstrip()
            if not stripped:
                if final:
                    self.pending = ""
                    self._text(buf)
                return
            markers = self.fmt.markers
            if not final and any(m.startswith(stripped) and m != stripped for m in markers):
                return  # maybe a marker, split
            self.at_start = False
            starts_marker = any(stripped.startswith(m) for m in markers)
            if self.fmt.opener and stripped[0] == self.fmt.opener and not starts_marker:
                self._enter_region(buf[: len(buf) - len(stripped)], stripped)
                return
        hits = [(i, m) for m in self.fmt.markers if (i := buf.find(m)) >= 0]
        if hits:
            i, marker = min(hits)
            self._text(buf[:i])
            self._enter_region(marker, buf[i + len(marker) :])
            return
        hold = 0 if final else _partial_suffix(buf, self.fmt.markers)
        self._text(buf[: len(buf) - hold])
        self.pending = buf[len(buf) - hold :]

    def _enter_region(self, raw_head: str, rest: str) -> None:
        self.mode = REGION
        self.region = [raw_head]
        self.region_calls = 0
        self.scanner = CallScanner(array=self.fmt.array)
        self.call = None
        self.pending = rest

    def _in_region(self) -> None:
        assert self.scanner is not None
        buf, self.pending = self.pending, ""
        for k, c in enumerate(buf):
            self.region.append(c)
            for kind, value in self.scanner.feed(c):
                if kind == json_scan.INVALID:
                    self._give_back(buf[k + 1 :])
                    return
                self._event(kind, value)
            if self.scanner.done:
                self.mode = AFTER if self.region_calls else TEXT
                if not self.region_calls:
                    self._text("".join(self.region))
                self.region, self.scanner = [], None
                self.pending = buf[k + 1 :]
                return

    def _give_back(self, rest: str) -> None:
        """Not a call region after all: its text is content (calls it already named stay)."""
        if not self.region_calls:
            self._text("".join(self.region))
        self.mode, self.region, self.scanner, self.call = TEXT, [], None, None
        self.pending = rest

    def _after_call(self, final: bool) -> None:
        """After a call's JSON: its closing marker (Hermes), a separator and the next call (Llama), or text."""
        buf = self.pending
        stripped = buf.lstrip()
        if not stripped:
            if final:
                self.pending = ""
            return
        end = self.fmt.end
        if end and stripped.startswith(end):
            self.mode, self.pending = TEXT, stripped[len(end) :]
        elif end and end.startswith(stripped) and not final:
            return  # maybe the closing marker, split
        elif self.fmt.opener and not self.fmt.array and stripped[0] == ";":
            self._enter_region(";", stripped[1:])
        else:
            self.mode, self.pending = TEXT, buf

    # ---- calls ---------------------------------------------------------------------------------------------
    def _event(self, kind: str, value: str) -> None:
        if kind == json_scan.CALL_START:
            self.call = _Call()
            return
        call = self.call
        if call is None:
            return
        if kind == json_scan.NAME and call.index is None and value:
            call.index = self.calls
            self.calls += 1
            self.region_calls += 1
            self._deltas.append(CallDelta(call.index, self.fmt.new_id(), value))
            if call.streamed and call.args:
                self._send_args(call)
        elif kind == json_scan.ARGS:
            if not call.args_seen:
                call.args_seen = True
                call.streamed = value == "{"
            call.args.append(value)
            if call.index is not None and call.streamed:
                self._send_args(call)
        elif kind == json_scan.ARGS_DONE and not call.streamed:
            raw = "".join(call.args)
            call.args = [_arguments_text(raw)]
            if call.index is not None:
                self._send_args(call)
        elif kind == json_scan.CALL_END:
            if call.index is not None:
                if not call.args_seen:
                    call.args.append("{}")
                self._send_args(call)
            self.call = None

    def _send_args(self, call: _Call) -> None:
        if call.index is not None and call.args:
            self._deltas.append(CallDelta(call.index, arguments="".join(call.args)))
            call.args = []


def _arguments_text(raw: str) -> str:
    """A non-object arguments value: a JSON string holding the arguments' JSON is unwrapped, others kept."""
    try:
        value = json.loads(raw, strict=False)
    except ValueError:
        return raw
    return value if isinstance(value, str) else raw


def _partial_suffix(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `buf` that begins a marker (held back: the marker may be split)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:k]):
                best = k
                break
    return best


def _merged(deltas: list[CallDelta]) -> list[CallDelta]:
    """Consecutive deltas of one call joined (one feed's worth of arguments in one piece)."""
    out: list[CallDelta] = []
    for d in deltas:
        last = out[-1] if out else None
        if last is not None and last.index == d.index and not d.id:
            last.arguments += d.arguments
        else:
            out.append(CallDelta(d.index, d.id, d.name, d.arguments))
    return out


def parse_calls(fmt: ToolFormat, text: str) -> tuple[str, list[ParsedCall]]:
    """A whole output's content and calls (the stream parser fed once)."""
    parser = ToolCallParser(fmt)
    content, deltas = parser.feed(text)
    rest, more = parser.finish()
    calls: list[ParsedCall] = []
    for d in deltas + more:
        if d.id:
            calls.append(ParsedCall(d.id, d.name, d.arguments))
        else:
            calls[d.index].arguments += d.arguments
    return content + rest, calls
