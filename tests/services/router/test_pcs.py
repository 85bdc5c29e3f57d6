"""PCS formula, special-token counting with a real tokenizer, and the process-stable leading-page hash."""

import pytest

from pdserve.router.pcs import (
    PCSWeights,
    count_special,
    fallback_output_len,
    leading_page_hash,
    score,
    special_token_ids,
)
from pdserve.testing.hash_seed import outputs_under_hash_seeds


def test_pcs_formula_default_and_custom_weights():
    p = score(input_len=5, num_special=2, est_output_len=16, w=PCSWeights())
    assert abs(p.score - (0.3 * 5 + 0.5 * 16 + 1.2 * 2)) < 1e-9
    p = score(100, 0, 10, PCSWeights(w_in=1.0, w_out=2.0, w_special=3.0))
    assert p.score == 120.0 and (p.input_len, p.est_output_len, p.num_special) == (100, 10, 0)


def test_fallback_modes():
    assert fallback_output_len(max_tokens=1000, input_len=40, mode="length_only") == 40
    assert fallback_output_len(1000, 3, "length_only") == 16  # floor
    assert fallback_output_len(1000, 4000, "length_only") == 512  # cap
    assert fallback_output_len(8, 4000, "length_only") == 8  # never above the budget
    assert fallback_output_len(1000, 40, "max_tokens") == 1000


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from pdserve.models.checkpoints import build_tokenizer

    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d)
    return AutoTokenizer.from_pretrained(str(d))


def test_chat_template_markers_count_as_special(tokenizer):
    special = special_token_ids(tokenizer)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What does assert do?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(text).input_ids  # what the router does with a templated prompt
    markers = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")}
    assert markers <= special and tokenizer.eos_token_id in special
    # <|im_start|>user ... <|im_end|> <|im_start|>assistant: three markers
    assert count_special(ids, special) == 3
    assert count_special(tokenizer("plain text only").input_ids, special) == 0


def test_leading_page_hash_is_stable_across_processes():
    ids = list(range(100, 140))
    h = leading_page_hash(ids, 16)
    assert h == leading_page_hash(ids[:16] + [1, 2, 3], 16)  # only the first page counts
    assert h != leading_page_hash([101] + ids[1:], 16)
    assert leading_page_hash(ids[:15], 16) is None  # no full page: no affinity key
    code = "from pdserve.router.pcs import leading_page_hash; print(leading_page_hash(list(range(100, 140)), 16).hex())"
    assert outputs_under_hash_seeds(code) == [h.hex(), h.hex()]
