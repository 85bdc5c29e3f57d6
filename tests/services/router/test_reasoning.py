"""The reasoning split (text side, router) and the reasoning budget (token side, engine), without processes."""

from __future__ import annotations

import pytest

from pdserve.engine.reasoning_budget import ReasoningBudget, ThinkTags
from pdserve.router.reasoning import ReasoningSplitter


def split(deltas: list[str], inside: bool) -> tuple[str, str]:
    s = ReasoningSplitter(inside=inside)
    reasoning, answer = [], []
    for d in deltas:
        r, a = s.feed(d)
        reasoning.append(r)
        answer.append(a)
    r, a = s.flush()
    return "".join(reasoning) + r, "".join(answer) + a


@pytest.mark.parametrize("cut", range(1, 30))
def test_tags_split_anywhere_across_deltas(cut):
    text = "pre<think>plan it</think>the answer<"
    assert split([text[:cut], text[cut:]], inside=False) == ("plan it", "pre" + "the answer<")


def test_one_character_deltas_and_a_stream_starting_inside():
    text = "still thinking</think>done"
    assert split(list(text), inside=True) == ("still thinking", "done")
    assert split(list(text), inside=False) == ("", text)  # no open tag: a close tag alone is just text


def test_held_back_text_is_flushed_to_its_side():
    s = ReasoningSplitter(inside=True)
    assert s.feed("abc</th") == ("abc", "")
    assert s.flush() == ("</th", "")


def test_budget_forces_the_close_tag_after_n_reasoning_tokens():
    tags = ThinkTags(open_ids=(10,), close_ids=(11, 12))  # a two-token close tag
    b = ReasoningBudget.for_prompt(tags, 3, prompt_ids=[1, 10, 5])  # the prompt opened the block
    done: list[int] = []
    for _ in range(6):
        forced = b.forced_token(done)
        done.append(forced if forced is not None else 7)
    assert done == [7, 7, 7, 11, 12, 7]
    b = ReasoningBudget.for_prompt(tags, 2, prompt_ids=[1, 5])  # outside: counting starts at the open tag
    done = []
    for t in [7, 10, 7, 7, 99, 7]:
        forced = b.forced_token(done)
        done.append(forced if forced is not None else t)
    assert done == [7, 10, 7, 7, 11, 12]
    assert ReasoningBudget.for_prompt(tags, 0, [10]).forced_token([]) == 11  # budget 0: close at once


def test_budget_catches_up_on_a_resumed_completion():
    tags = ThinkTags((10,), (11,))
    fresh = ReasoningBudget.for_prompt(tags, 4, [10])
    assert fresh.forced_token([7, 7, 7]) is None and fresh.forced_token([7, 7, 7, 7]) == 11
    assert ReasoningBudget.for_prompt(tags, 4, [10]).forced_token([7, 7, 7, 7]) == 11  # no history needed
