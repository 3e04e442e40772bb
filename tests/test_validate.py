"""Sample validation, skip counting and the non-finite-loss guard."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dflash_lib.data import validation as v
from dflash_lib.data.validation import SkipCounter, validate_sample
from dflash_lib.train.state import BadStepGuard, NonFiniteLossError

VOCAB = 100


@pytest.mark.parametrize("tokens, mask, reason", [
    ([1, 2, 3], [0, 1, 1], None),
    (np.array([0, 99], dtype=np.int32), np.array([True, False]), None),
    (torch.tensor([5, 6]), torch.tensor([1, 1]), None),
    ([], [], v.EMPTY),
    (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool), v.EMPTY),
    ([1, 100], [1, 1], v.TOKEN_OUT_OF_VOCAB),
    ([-1, 3], [1, 1], v.TOKEN_OUT_OF_VOCAB),
    ([2**70, 3], [1, 1], v.TOKEN_OUT_OF_VOCAB),
    ([1, 2, 3], [0, 0, 0], v.NO_ASSISTANT_TOKEN),
    ([1, 2, 3], [0, 1], v.MASK_LENGTH_MISMATCH),
    ([1, 2], [0, 2], v.BAD_MASK),
    ([1, 2], [0.5, 1.0], v.BAD_MASK),
    ([1, 2], ["a", "b"], v.BAD_MASK),
    ([1.0, 2.0], [1, 1], v.NOT_INTEGER),
    ([True, False], [1, 1], v.NOT_INTEGER),
    (["1", "2"], [1, 1], v.NOT_INTEGER),
    ([1, None], [1, 1], v.NOT_INTEGER),
    ([[1, 2], [3, 4]], [1, 1], v.NOT_1D),
    ([1, [2, 3]], [1, 1], v.NOT_1D),
    (7, 1, v.NOT_1D),
])
def test_reasons(tokens, mask, reason) -> None:
    assert validate_sample(tokens, mask, VOCAB) == reason


@pytest.mark.parametrize("vocab", [0, -3, 2.5, "100", True, None])
def test_bad_vocab_size_is_a_clear_error(vocab) -> None:
    with pytest.raises(ValueError, match="vocab_size must be an int >= 1"):
        validate_sample([1], [1], vocab)


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40), data=st.data())
def test_valid_samples_pass_and_one_bad_token_fails(tokens: list[int], data: st.DataObject) -> None:
    mask = data.draw(st.lists(st.booleans(), min_size=len(tokens), max_size=len(tokens)).filter(any))
    assert validate_sample(np.array(tokens), np.array(mask), VOCAB) is None
    i = data.draw(st.integers(0, len(tokens) - 1))
    bad = data.draw(st.one_of(st.integers(VOCAB, 2**62), st.integers(-2**62, -1)))
    assert validate_sample(tokens[:i] + [bad] + tokens[i + 1:], mask, VOCAB) == v.TOKEN_OUT_OF_VOCAB


ANYTHING = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5)
                        | st.binary(max_size=5), lambda c: st.lists(c, max_size=4), max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(tokens=ANYTHING, mask=ANYTHING)
def test_any_input_gives_a_reason_never_an_exception(tokens, mask) -> None:
    assert validate_sample(tokens, mask, VOCAB) in (None, *v.REASONS)


def test_skip_counter_counts_summarises_and_round_trips() -> None:
    c = SkipCounter(max_examples=2)
    samples = [([1, 2], [0, 1]), ([], []), ([500], [1]), ([700], [1]), ([800], [1]), ([1], [0])]
    kept = [i for i, (t, m) in enumerate(samples) if c.check(t, m, VOCAB, record=f"rec{i}")]
    assert kept == [0]
    assert c.counts == {v.EMPTY: 1, v.TOKEN_OUT_OF_VOCAB: 3, v.NO_ASSISTANT_TOKEN: 1} and c.total == 5
    assert c.examples[v.TOKEN_OUT_OF_VOCAB] == ["rec2", "rec3"]  # capped at max_examples
    assert c.summary() == ("skipped 5 samples: token_out_of_vocab 3 (e.g. rec2, rec3), empty 1 (e.g. rec1), "
                           "no_assistant_token 1 (e.g. rec5)")
    other = SkipCounter()
    other.load_state_dict(c.state_dict())
    other.merge(c)
    assert other.counts[v.TOKEN_OUT_OF_VOCAB] == 6 and other.total == 10
    assert other.examples[v.TOKEN_OUT_OF_VOCAB] == ["rec2", "rec3", "rec2"]  # default cap 3
    assert SkipCounter().summary() == "skipped 0 samples"
    with pytest.raises(ValueError, match="reason must be"):
        c.add("")


def test_bad_step_guard_skips_and_aborts_after_k_in_a_row() -> None:
    g = BadStepGuard(max_in_a_row=3)
    losses = [1.0, math.nan, 2.0, math.inf, torch.tensor(float("nan")), 0.5]
    assert [g.ok(x, step) for step, x in enumerate(losses)] == [True, False, True, False, False, True]
    assert (g.total, g.in_a_row, g.last_bad_step) == (3, 0, 4)
    g.ok(math.nan, 6), g.ok(-math.inf, 7)
    with pytest.raises(NonFiniteLossError, match=r"for 3 steps in a row \(up to step 8\).*max_bad_steps=3"):
        g.ok(math.nan, 8)
    restored = BadStepGuard(3)
    restored.load_state_dict(g.state_dict())
    assert (restored.total, restored.in_a_row) == (6, 3)
    with pytest.raises(ValueError, match="max_bad_steps"):
        BadStepGuard(0)
