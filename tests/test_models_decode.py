"""Speculative decoding: exact target-greedy output, and an overfit drafter that reaches high acceptance."""

from __future__ import annotations

import pytest
import torch

from dflash_lib.evaluate.acceptance import acceptance_length, greedy_decode
from dflash_lib.target.local import TargetModel
from dflash_lib.models.export import export_drafter, read_drafter
from tiny_models import decode_drafter, decode_target, overfit_on_greedy, random_prompts

VOCAB, B, NEW = 256, 4, 20


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return decode_target(VOCAB)


@pytest.fixture(scope="module")
def trained(target):
    """A drafter overfit on the target's own greedy continuations of a few prompts (labels = what the
    target would say, as in the paper). Continuations run B tokens past NEW so every decoding cycle lands on
    trained ground."""
    prompts = random_prompts(6, seed=1)
    drafter = decode_drafter(target, B)
    batch, feats, conts, gen = overfit_on_greedy(target, drafter, prompts, NEW + B, steps=150)
    with torch.no_grad():
        final = drafter.loss(batch, feats, drafter.sample_anchors(batch, gen))
    return drafter, prompts, conts, final


@pytest.mark.slow
def test_untrained_drafter_still_outputs_target_greedy(target):
    prompts = random_prompts(3, seed=2)
    res = acceptance_length(target, decode_drafter(target, B, seed=3), prompts, NEW)
    assert res.outputs == [target.greedy(p, NEW) for p in prompts]
    with torch.no_grad():
        ids = torch.tensor(prompts[0])[None]
        hf = target.model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
    assert res.outputs[0] == hf.tolist()
    assert 1.0 <= res.tau < 1.5  # a random drafter rarely guesses
    assert sum(res.histogram.values()) == res.cycles
    assert sum(k * v for k, v in res.histogram.items()) >= len(prompts) * (NEW - 1)


@pytest.mark.slow
def test_overfit_drafter_accepts_most_of_each_block(target, trained):
    drafter, prompts, conts, final = trained
    assert final.acc >= 0.95 and min(final.acc_per_pos) >= 0.9 and final.eal >= 0.8 * B
    res = acceptance_length(target, drafter, prompts, NEW)
    assert res.outputs == [c[:NEW] for c in conts]
    assert res.tau >= 0.8 * B
    assert max(res.histogram) == B


class _OracleDrafter:
    """Drafts the target's true greedy tokens but corrupts draft slot j = cycle % B (j = B-1: no corruption),
    so cycle c must accept exactly min(c % B, B-1) + 1 tokens."""

    def __init__(self, reference: list[int]):
        self.reference, self.cycle = reference, 0

    def draft(self, features: torch.Tensor, anchor_pos: int, anchor_token: int) -> list[int]:
        assert features.shape[0] >= anchor_pos and anchor_token == self.reference[anchor_pos]
        true = self.reference[anchor_pos + 1: anchor_pos + B]
        j, self.cycle = self.cycle % B, self.cycle + 1
        return [(t + 1) % VOCAB if i == j else t for i, t in enumerate(true)]


def test_acceptance_counts_the_matching_prefix_plus_bonus(target):
    prompt = random_prompts(1, seed=5)[0]
    reference = prompt + target.greedy(prompt, NEW + B)  # the last cycle's block ends within B tokens past NEW
    oracle = _OracleDrafter(reference)
    res = acceptance_length(target, oracle, [prompt], NEW)
    want = [min(c % B, B - 1) + 1 for c in range(res.cycles)]
    assert res.outputs == [reference[len(prompt): len(prompt) + NEW]]
    assert res.histogram == {k: want.count(k) for k in sorted(set(want))}
    assert res.tau == pytest.approx(sum(want) / len(want))
    # the cycle log: each cycle's context length (prompt + output so far, the first token from the prefill) and
    # what it produced, in order
    (log,) = res.cycle_log
    assert [n for _, n in log] == want
    lengths = [len(prompt) + 1]
    for n in want[:-1]:
        lengths.append(lengths[-1] + n)
    assert [c for c, _ in log] == lengths


def test_cycles_along_given_answers_count_the_drafts_matching_them(target):
    """`answers`: another decoding's answer (here random tokens, not the target's greedy) is taken as the target's
    choice: the outputs are that answer and every cycle accepts exactly the drafts matching it (the oracle drafts
    the answer with slot c % B corrupted), the target's greedy beyond it never consulted while it reaches."""
    prompt = random_prompts(1, seed=5)[0]
    answer = torch.randint(0, VOCAB, (NEW + B,), generator=torch.Generator().manual_seed(11)).tolist()
    assert answer[:NEW] != target.greedy(prompt, NEW)
    res = acceptance_length(target, _OracleDrafter(prompt + answer), [prompt], NEW, answers=[answer])
    want = [min(c % B, B - 1) + 1 for c in range(res.cycles)]
    assert res.outputs == [answer[:NEW]] and [n for _, n in res.cycle_log[0]] == want
    assert res.tau == pytest.approx(sum(want) / len(want))
    with pytest.raises(ValueError, match="greedy only"):
        acceptance_length(target, _OracleDrafter(prompt + answer), [prompt], NEW, answers=[answer], temperature=1.0)
    with pytest.raises(ValueError, match="one per prompt"):
        acceptance_length(target, _OracleDrafter(prompt + answer), [prompt], NEW, answers=[])


@pytest.mark.slow
def test_cycles_along_the_targets_own_answers_are_its_decoding(target, trained):
    """A real drafter along the target's own greedy answers: the same cycles as decoding without them; along an
    answer that leaves greedy after 5 tokens, the same cycles up to there."""
    drafter, prompts, _, _ = trained
    mixed = prompts[:2] + random_prompts(1, seed=9)
    own = acceptance_length(target, drafter, mixed, NEW)
    forced = acceptance_length(target, drafter, mixed, NEW, answers=own.outputs)
    assert (forced.outputs, forced.cycle_log) == (own.outputs, own.cycle_log)
    bent = [o[:5] + [(o[5] + 1) % VOCAB] + o[6:] for o in own.outputs]
    other = acceptance_length(target, drafter, mixed, NEW, answers=bent)
    assert other.outputs == [b[:NEW] for b in bent]
    for prompt, mine, theirs in zip(mixed, own.cycle_log, other.cycle_log):
        # a cycle at m output tokens producing n reads the answer's tokens m .. m + n - 1: before token 5, the same
        before = [(c, n) for c, n in mine if c - len(prompt) + n <= 5]
        assert before and theirs[:len(before)] == before
    assert other.cycle_log[:2] != own.cycle_log[:2]  # the trained prompts' drafts part from the bent answers


@pytest.mark.slow
def test_mixed_acceptance_and_reload_still_give_target_greedy(target, trained, tmp_path):
    drafter, prompts, conts, _ = trained
    export_drafter(drafter, tmp_path, torch.float32)
    loaded = read_drafter(tmp_path, target)
    # Past the trained continuation (and on unseen prompts) drafts start failing: accepted and rejected mix.
    mixed = prompts[:2] + random_prompts(1, seed=9)
    res = acceptance_length(target, loaded, mixed, NEW + 2 * B)
    assert res.outputs == [target.greedy(p, NEW + 2 * B) for p in mixed]
    assert 1 in res.histogram and B in res.histogram
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        acceptance_length(target, drafter, [[1], []], 4)


class _ReferenceDrafter:
    """Drafts what follows the anchor in `reference` (prompt + the decoding to reproduce): while the decoding
    follows the reference, every cycle accepts its whole block (up to the reference's end)."""

    def __init__(self, reference: list[int]):
        self.reference = reference

    def draft(self, features: torch.Tensor, anchor_pos: int, anchor_token: int) -> list[int]:
        return (self.reference[anchor_pos + 1: anchor_pos + B] + [0] * B)[:B - 1]


def test_min_new_tokens_boundary_inside_accepted_blocks_is_plain_greedys(target, one_thread):
    """The stop id the target prefers at output token p (its first occurrence) ends the output there when
    min_new_tokens <= p and is masked when min_new_tokens >= p + 1: speculative decoding with blocks accepted
    whole (the stop's row inside a verified block) gives plain greedy's output for every min_new_tokens 1 .. N."""
    n = 10
    prompt = random_prompts(1, seed=5)[0]
    free = target.greedy(prompt, n)
    p = next(i for i in range(3, n) if free[i] not in free[:i])  # the stop id's first occurrence, past the prefill
    stop = free[p]
    for min_new in range(1, n + 1):
        want = greedy_decode(target, [prompt], n, stop_ids=[stop], min_new_tokens=min_new).outputs[0]
        if min_new <= p:
            assert want == free[:p + 1]  # ends on the stop id at output token p
        else:
            assert stop not in want[:min_new] and want[:p] == free[:p]
        res = acceptance_length(target, _ReferenceDrafter(prompt + want), [prompt], n, stop_ids=[stop],
                                min_new_tokens=min_new)
        assert res.outputs == [want], min_new
        assert max(res.histogram) >= 3  # cycles accept several drafts
