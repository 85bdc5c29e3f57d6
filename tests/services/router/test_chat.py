"""Rendering chat messages with the tokenizer's template (pdserve.router.chat): limits, roles, no template.
(Through the real router and gateway: tests/services/router/gateway/test_gateway_stack.py.)"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pdserve.errors import InvalidRequest
from pdserve.models.checkpoints import build_tokenizer
from pdserve.router.chat import ChatLimits, chat_prompt_ids, render_chat
from pdserve.v1 import generate_pb2


def msgs(*pairs):
    return [generate_pb2.ChatMessage(role=r, content=c) for r, c in pairs]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    with_t, without = tmp_path_factory.mktemp("tok-chat"), tmp_path_factory.mktemp("tok-plain")
    build_tokenizer(with_t)
    build_tokenizer(without, chat_template=None)
    return AutoTokenizer.from_pretrained(str(with_t)), AutoTokenizer.from_pretrained(str(without))


def test_renders_like_transformers(tokenizers):
    tok, _ = tokenizers
    conv = msgs(("system", "Be brief."), ("user", "hi"), ("assistant", "hello"), ("tool", "42"), ("user", "and?"))
    text = render_chat(tok, conv)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>tool\n42<|im_end|>" in text
    as_dicts = [{"role": m.role, "content": m.content} for m in conv]
    expected = tok.apply_chat_template(as_dicts, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat_prompt_ids(tok, conv) == list(expected)


def test_bad_input_is_invalid_request(tokenizers):
    tok, plain = tokenizers
    with pytest.raises(InvalidRequest, match="role"):
        chat_prompt_ids(tok, msgs(("user", "hi"), ("robot", "beep")))
    with pytest.raises(InvalidRequest, match="empty"):
        chat_prompt_ids(tok, [])
    with pytest.raises(InvalidRequest, match="too many messages"):
        chat_prompt_ids(tok, msgs(*[("user", "x")] * 3), ChatLimits(max_messages=2))
    with pytest.raises(InvalidRequest, match="too large"):
        chat_prompt_ids(tok, msgs(("user", "é" * 6)), ChatLimits(max_bytes=10))  # 12 UTF-8 bytes
    with pytest.raises(InvalidRequest, match="no chat template"):
        chat_prompt_ids(plain, msgs(("user", "hi")))
