"""Hypothesis strategies over the OpenAI request schemas (chat completions, completions) for the gateway fuzz:
bodies valid but for up to three fields (of the schema or unknown) holding a random JSON value (wrong types, huge
and boundary numbers, odd strings with lone surrogates and control characters), odd forwarded headers, and now and
then bytes that are not JSON. `requests(model)`: (path, body bytes); HEADERS: header name -> value."""

from __future__ import annotations

import json

from hypothesis import strategies as st

BOUNDARY_NUMBERS = [
    0, 1, -1, 20, 21, 2**31 - 1, 2**31, -(2**31), 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 2**70, 10**30,
    0.5, -0.0, 1e12, 1e308, -1e308, 2.0000001, 5e-324,
]  # fmt: skip
ODD_STRINGS = ["", " ", "\ud800", "a\udfffb", "\x00", "\x7f", "é", "😀", "<|im_end|>", "a" * 300, "null", "1e400"]

odd_text = st.text(st.characters(exclude_categories=[]), max_size=12)  # surrogates and control characters too
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(BOUNDARY_NUMBERS),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(ODD_STRINGS),
    odd_text,
)
wild = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(odd_text, inner, max_size=3), max_leaves=6
)


SAMPLING = {  # valid values of the optional fields both endpoints take
    "max_tokens": st.integers(1, 8),
    "max_completion_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=4)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "n": st.just(1),
    "presence_penalty": st.just(0),
    "frequency_penalty": st.floats(0, 0),
    "user": st.text(max_size=8),
}
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer"]), "content": st.text(max_size=40)}
)
CHAT_FIELDS = {"messages": st.lists(MESSAGE, min_size=1, max_size=3)}
TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"enum": [1]}}}},
}
TOOLS = {  # tool calling: a valid tool, each choice (a named one enforced by the grammar engine)
    "tools": st.just([TOOL]),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "f"}}]),
    "parallel_tool_calls": st.booleans(),
}
CHAT_OPTIONAL = {**SAMPLING, **TOOLS, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5)}
COMPLETION_FIELDS = {
    "prompt": st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 511), min_size=1, max_size=8)),
}
COMPLETION_OPTIONAL = {**SAMPLING, "logprobs": st.integers(0, 5), "echo": st.booleans()}
EXTRA_FIELDS = ("logit_bias", "best_of", "max_reasoning_tokens")  # fields only a wild value gets


@st.composite
def bodies(draw, required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy]) -> bytes:
    """A valid body (the required fields, some optional ones), then up to 3 fields (of the schema, or unknown)
    replaced by a random JSON value; as JSON text."""
    body = {name: draw(s) for name, s in required.items()}
    for name in draw(st.lists(st.sampled_from(sorted(optional)), max_size=4, unique=True)):
        body[name] = draw(optional[name])
    names = sorted({*required, *optional, *EXTRA_FIELDS})
    for name in draw(st.lists(st.one_of(st.sampled_from(names), odd_text), max_size=3, unique=True)):
        body[name] = draw(wild)
    return json.dumps(body).encode()


# what a client can put in a header value on the wire (h11 refuses control characters itself: a 400)
latin1_text = st.text(st.characters(max_codepoint=255, exclude_characters="\r\n"), max_size=20)
HEADERS = st.fixed_dictionaries(
    {},
    optional={
        "x-priority": st.one_of(st.sampled_from(["high", "normal", "low"]), latin1_text),
        "authorization": st.one_of(st.just("Bearer x"), latin1_text),
        "traceparent": st.one_of(st.just("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), latin1_text),
    },
)


def requests(model: str) -> st.SearchStrategy[tuple[str, bytes]]:
    """(path, body) of a request to the gateway serving `model`."""
    named = {"model": st.just(model)}
    return st.one_of(
        st.tuples(st.just("/v1/chat/completions"), bodies({**named, **CHAT_FIELDS}, CHAT_OPTIONAL)),
        st.tuples(st.just("/v1/completions"), bodies({**named, **COMPLETION_FIELDS}, COMPLETION_OPTIONAL)),
        st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions"]), st.binary(max_size=40)),
    )
