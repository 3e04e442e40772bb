"""Speculative decoding: exact target-greedy output, and an overfit drafter that reaches high acceptance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_lib.batch import collate_padded
from dflash_lib.models import DFlashDrafter, DrafterConfig, TargetModel, acceptance_length, tiny_qwen3_config

VOCAB, B, NEW = 256, 4, 20


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_hf_config(tiny_qwen3_config(hidden_size=32, num_layers=4, vocab_size=VOCAB), 1, seed=0)


def _drafter(target: TargetModel, seed: int = 0) -> DFlashDrafter:
    cfg = DrafterConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=96,
                        vocab_size=VOCAB, target_layer_ids=target.layer_ids, target_num_layers=target.num_layers,
                        block_size=B, mask_id=VOCAB - 1, num_anchors=64, ce_chunk_blocks=4)
    torch.manual_seed(seed)
    return DFlashDrafter(cfg, target)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB - 1, int(rng.integers(1, 8))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def trained(target):
    """A drafter overfit on the target's own greedy continuations of a few prompts (labels = what the
    target would say, as in the paper). Continuations run B tokens past NEW so every decoding cycle lands on
    trained ground."""
    prompts = _prompts(6, seed=1)
    conts = [target.greedy(p, NEW + B) for p in prompts]
    docs = [(np.array(p + c), np.arange(len(p) + len(c)) >= len(p)) for p, c in zip(prompts, conts)]
    batch = collate_padded(docs, pad_id=0)
    feats = target.features(batch)
    drafter = _drafter(target)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(150):
        out = drafter.loss(batch, feats, drafter.sample_anchors(batch, gen))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    with torch.no_grad():
        final = drafter.loss(batch, feats, drafter.sample_anchors(batch, gen))
    return drafter, prompts, conts, final


def test_untrained_drafter_still_outputs_target_greedy(target):
    prompts = _prompts(3, seed=2)
    res = acceptance_length(target, _drafter(target, seed=3), prompts, NEW)
    assert res.outputs == [target.greedy(p, NEW) for p in prompts]
    with torch.no_grad():
        ids = torch.tensor(prompts[0])[None]
        hf = target.model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
    assert res.outputs[0] == hf.tolist()
    assert 1.0 <= res.tau < 1.5  # a random drafter rarely guesses
    assert sum(res.histogram.values()) == res.cycles
    assert sum(k * v for k, v in res.histogram.items()) >= len(prompts) * (NEW - 1)


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
    prompt = _prompts(1, seed=5)[0]
    reference = prompt + target.greedy(prompt, 3 * NEW)
    oracle = _OracleDrafter(reference)
    res = acceptance_length(target, oracle, [prompt], NEW)
    want = [min(c % B, B - 1) + 1 for c in range(res.cycles)]
    assert res.outputs == [reference[len(prompt): len(prompt) + NEW]]
    assert res.histogram == {k: want.count(k) for k in sorted(set(want))}
    assert res.tau == pytest.approx(sum(want) / len(want))


def test_mixed_acceptance_and_reload_still_give_target_greedy(target, trained, tmp_path):
    drafter, prompts, conts, _ = trained
    drafter.save(tmp_path)
    loaded = DFlashDrafter.load(tmp_path, target)
    # Past the trained continuation (and on unseen prompts) drafts start failing: accepted and rejected mix.
    mixed = prompts[:2] + _prompts(1, seed=9)
    res = acceptance_length(target, loaded, mixed, NEW + 2 * B)
    assert res.outputs == [target.greedy(p, NEW + 2 * B) for p in mixed]
    assert 1 in res.histogram and B in res.histogram
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        acceptance_length(target, drafter, [[1], []], 4)
