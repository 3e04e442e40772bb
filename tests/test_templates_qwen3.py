"""The `qwen3` template against a Qwen3 chat template (Jinja, tests/fixtures/qwen3, rendered the way transformers
renders it): same text, and a loss mask equal to what the target writes at serving time for each answer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from dflash_lib.data import render
from dflash_lib.data.templates import IM_END, get_template

FIXTURE = Path(__file__).parent / "fixtures" / "qwen3" / "tokenizer_config.json"
JINJA = json.loads(FIXTURE.read_text())["chat_template"]

THINK = "<think>\nLet me add.\n2 and 2 is 4.\n</think>\n\n"
CASES = {
    "single": [("user", "Hi"), ("assistant", "Hello! How can I help?")],
    "system": [("system", "You are terse."), ("user", "2+2?"), ("assistant", "4")],
    "multi_turn": [("system", "Be kind."), ("user", "Hi"), ("assistant", "Hello."), ("user", "  spaces\n"),
                   ("assistant", "\nNoted."), ("user", "Bye"), ("assistant", "Goodbye!")],
    "reasoning_in_history_and_last": [("user", "2+2?"), ("assistant", THINK + "4"), ("user", "and 3+3?"),
                                      ("assistant", "<think>\n3 and 3\n</think>\n\n6")],
    "two_answers_after_the_last_user": [("user", "Q"), ("assistant", THINK + "part 1"), ("assistant", "part 2")],
    "system_in_the_middle": [("user", "Q"), ("assistant", "A"), ("system", "Now French."), ("user", "Q2"),
                             ("assistant", "R")],
}


def jinja(turns, **kw) -> str:
    return render_jinja_template([[{"role": r, "content": c} for r, c in turns]], chat_template=JINJA, **kw)[0][0]


def served_mask(turns, thinking: str) -> np.ndarray:
    """Per character of the Jinja rendering: 1 where the target wrote the text when that answer was served.
    Each answer starts after the serving prompt (enable_thinking=False prefills the empty think block when
    thinking is off and the rendering still holds it there) and ends with its <|im_end|>."""
    full = jinja(turns)
    mask = np.zeros(len(full), np.uint8)
    for i, (role, _) in enumerate(turns):
        if role != "assistant":
            continue
        prompt_off = jinja(turns[:i], add_generation_prompt=True, enable_thinking=False)
        prompt_on = jinja(turns[:i], add_generation_prompt=True, enable_thinking=True)
        # the rendering of the turns before must be a prefix of the full one up to the assistant header
        assert full.startswith(prompt_on[: -len("<|im_start|>assistant\n")]) or i == 0
        # where this answer's header is: the i-th "<|im_start|>assistant\n" counted over the assistant turns
        k = sum(r == "assistant" for r, _ in turns[:i])
        head = [j for j in range(len(full)) if full.startswith("<|im_start|>assistant\n", j)][k]
        body = head + len("<|im_start|>assistant\n")
        start = body + len("<think>\n\n</think>\n\n") if (
            thinking == "off" and prompt_off.endswith("</think>\n\n") and full.startswith("<think>\n\n</think>\n\n", body)
        ) else body
        end = full.index(IM_END, start) + len(IM_END)
        mask[start:end] = 1
    return mask


def char_mask(segments) -> np.ndarray:
    parts = []
    for s in segments:
        m = np.zeros(len(s.text), np.uint8)
        if s.train_from is not None:
            m[s.train_from:] = 1
        parts.append(m)
    return np.concatenate(parts)


@pytest.mark.parametrize("thinking", ["off", "on"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_text_and_mask_equal_the_jinja_template(qwen_tokenizer, case, thinking):
    turns = tuple(CASES[case])
    segs = get_template("qwen3", qwen_tokenizer, thinking).segments(turns)
    assert render(segs) == jinja(turns)
    np.testing.assert_array_equal(char_mask(segs), served_mask(turns, thinking))


@pytest.mark.parametrize("thinking, enable", [("off", False), ("on", True)])
def test_generation_prompt_equals_the_jinja_one(qwen_tokenizer, thinking, enable):
    turns = tuple(CASES["multi_turn"][:-1])
    segs = get_template("qwen3", qwen_tokenizer, thinking).prompt_segments(turns)
    assert render(segs) == jinja(turns, add_generation_prompt=True, enable_thinking=enable)


def test_token_mask_of_a_non_thinking_answer(qwen_tokenizer):
    """Tokens: the empty think block is 4 prompt tokens (<think>, \\n\\n, </think>, \\n\\n), the answer and <|im_end|>
    are trained, historical answers carry no think block."""
    turns = tuple(CASES["multi_turn"])
    ids, mask = qwen_tokenizer.encode_segments(get_template("qwen3", qwen_tokenizer, "off").segments(turns))
    think, end_think = qwen_tokenizer.special_id("<think>"), qwen_tokenizer.special_id("</think>")
    assert (think, end_think) == (151667, 151668)  # Qwen3's ids
    assert list(ids).count(think) == 1 and list(ids).count(end_think) == 1
    at = list(ids).index(think)
    assert qwen_tokenizer.decode(ids[at: at + 4]) == "<think>\n\n</think>\n\n" and not mask[at: at + 4].any()
    trained = qwen_tokenizer.decode(ids[mask.astype(bool)])
    # ("\n\nNoted.": the header's newline and the answer's leading one are one BPE token, which holds answer text)
    assert trained == "Hello.<|im_end|>\n\nNoted.<|im_end|>Goodbye!<|im_end|>"
    on = qwen_tokenizer.encode_segments(get_template("qwen3", qwen_tokenizer, "on").segments(turns))[1]
    assert int(on.sum()) == int(mask.sum()) + 4  # thinking on: the model wrote the (empty) block


def test_chatml_differs_from_qwen3_only_by_the_block(qwen_tokenizer):
    turns = tuple(CASES["multi_turn"])
    chatml = render(get_template("chatml", qwen_tokenizer).segments(turns))
    assert render(get_template("qwen3", qwen_tokenizer).segments(turns)) == chatml.replace(
        "assistant\nGoodbye!", "assistant\n<think>\n\n</think>\n\nGoodbye!")
