"""The held-out split (content hash, stable under corpus order) and the trainer's held-out evaluation: exact
in-batch acceptance from each block's own flags, eval rows every N steps, a training trajectory evaluation
never changes, and no held-out sample in a training batch."""

from __future__ import annotations

import hashlib
import json
import math
import struct

import numpy as np
import pytest
import torch

from dflash_lib.config import ConfigError, from_params, preset
from dflash_lib.data.split import SubsetStore, sample_hash, split_store
from dflash_lib.models import DFlashDrafter, DrafterConfig, expected_acceptance
from dflash_lib.target.local import TargetModel
from dflash_lib.models.layout import DraftLayout
from dflash_lib.models.loss import leading_run_stats, weighted_loss
from dflash_lib.plan.sampler import FixedBatchSampler
from dflash_lib.train.build import TrainingParts, build_sampler
from dflash_lib.train.feed import epoch_batches
from dflash_lib.train.loop import run_training
from dflash_lib.rundir.records import HELDOUT_KEYS, RunSummary
from dflash_lib.train.metrics import StepMetrics
from dflash_lib.train.resume import resume_config_hash
from run_folder import metrics_rows as rows_of


def random_store(n: int, seed: int = 0, lo: int = 12, hi: int = 60) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    store = []
    for length in rng.integers(lo, hi, size=n):
        mask = np.zeros(length, np.uint8)
        mask[length // 3:] = 1  # the last two thirds are the "assistant" part
        store.append((rng.integers(0, 2000, size=length).astype(np.uint32), mask))
    return store


def content(store, indices) -> set[bytes]:
    return {store[int(i)][0].tobytes() for i in indices}


# -- the split ----------------------------------------------------------------------------------------------------


def test_split_is_stable_under_corpus_order_and_respects_the_fraction():
    store = random_store(4000, lo=4, hi=12)
    split = split_store(store, 0.05)
    assert 150 <= len(split.heldout) <= 250  # 200 expected, sd ~14
    assert len(split.heldout) + len(split.train) == 4000
    assert not set(split.heldout.tolist()) & set(split.train.tolist())
    perm = np.random.default_rng(1).permutation(len(store))
    shuffled = [store[i] for i in perm]
    again = split_store(shuffled, 0.05)
    assert content(shuffled, again.heldout) == content(store, split.heldout)  # the same conversations
    # the held-out order (hash order) does not depend on corpus order either: the evaluation takes the same first M
    assert [shuffled[i][0].tobytes() for i in again.heldout] == [store[i][0].tobytes() for i in split.heldout]
    assert content(store, split_store(store, 0.01).heldout) < content(store, split.heldout)  # nested fractions
    assert len(split_store(store, 0.0).heldout) == 0


def test_duplicates_fall_on_the_same_side_and_the_record_lists_the_hashes():
    store = random_store(500)
    store = store + store[:100]  # exact duplicates of the first 100
    split = split_store(store, 0.2)
    held = set(split.heldout.tolist())
    assert all((i in held) == (i + 500 in held) for i in range(100))
    record = split.record(len(store))
    assert record["heldout"] == len(held) and record["train"] == len(store) - len(held)
    assert record["hashes"] == [f"{sample_hash(store[i][0]):016x}" for i in record["indices"]]
    assert all(int(h, 16) < 0.2 * 2 ** 64 for h in record["hashes"])


def test_sample_hash_is_the_documented_rule_pinned():
    """HASH_RULE decides which samples every run holds out: a change (byte order, prefix, digest bytes) would move
    the split of every existing run folder, so its value on fixed ids is pinned, and recomputed from the rule."""
    tokens = [0, 1, 255, 256, 65536, 151669, 2 ** 32 - 1]
    rule = hashlib.sha256(b"dflash-heldout-v1:" + b"".join(struct.pack("<I", t) for t in tokens)).digest()
    assert sample_hash(np.array(tokens, dtype=np.int64)) == int.from_bytes(rule[:8], "little") == 0xE4EE563353BC47EE
    assert sample_hash(np.array(tokens, dtype=np.uint32)) == sample_hash(np.array(tokens, dtype=">u4"))  # the ids


def test_fraction_is_a_validated_config_field_in_the_resume_hash():
    base = preset("smoke")
    assert base.data.heldout_fraction == 0.01
    assert resume_config_hash(from_params({"heldout_fraction": 0.02}, base)) != resume_config_hash(base)
    assert resume_config_hash(from_params({"eval_every": 3, "eval_samples": 8}, base)) == resume_config_hash(base)
    with pytest.raises(ConfigError, match="heldout_fraction"):
        from_params({"heldout_fraction": 1.0})


# -- exact in-batch acceptance ---------------------------------------------------------------------------------------


def test_leading_run_counts_each_blocks_own_flags():
    B = 5
    # block flags at positions 1..4 (None = unscored): expected 1 + leading run
    blocks = [([1, 1, 0, 1], 3), ([0, 1, 1, 1], 1), ([1, 1, 1, 1], 5), ([1, None, 1, 1], 2), ([None] * 4, 1)]
    scored, correct = [], []
    for i, (flags, _) in enumerate(blocks):
        for k, f in enumerate(flags, start=1):
            if f is not None:
                scored.append(i * B + k)
                correct.append(float(f))
    total, n = leading_run_stats(torch.tensor(correct), torch.tensor(scored), len(blocks), B)
    assert n.item() == 5 and total.item() == sum(t for _, t in blocks) == 12


def hand_layout(labels: np.ndarray, scored_mask: np.ndarray) -> DraftLayout:
    """A layout of n blocks of B whose scored positions k >= 1 are `scored_mask` (n, B), labels (n, B)."""
    n, B = labels.shape
    scored = np.flatnonzero(scored_mask.reshape(-1))
    w = torch.ones(len(scored))
    z = torch.zeros(n, dtype=torch.long)
    return DraftLayout(block_ids=torch.zeros(n, B, dtype=torch.long), block_pos=torch.zeros(n, B, dtype=torch.long),
                       block_doc=z, anchor_pos=z, ctx_index=None, ctx_doc=z, ctx_pos=z,
                       scored=torch.from_numpy(scored),
                       labels=torch.from_numpy(labels.reshape(-1)[scored]), weights=w,
                       scored_k=torch.from_numpy(scored % B),
                       previous=torch.from_numpy(labels.reshape(-1)[scored - 1]), groups=None, block_size=B, noise=1.0,
                       weight_sum=float(len(scored)))


def test_loss_path_reports_exact_tau_and_keeps_the_marginal_estimate():
    """An identity head predicts the token whose one-hot is the hidden state: the correct flags are forced."""
    B, V = 4, 8
    rng = np.random.default_rng(0)
    labels = rng.integers(0, V, size=(4, B))
    flags = np.array([[0, 1, 1, 0], [0, 0, 1, 1], [0, 1, 1, 1], [0, 1, 0, 1]], bool)  # position 0 (anchor) unscored
    scored_mask = np.ones((4, B), bool)
    scored_mask[:, 0] = False
    pred = np.where(flags, labels, (labels + 1) % V)  # (n, B) wrong where the flag is 0
    hidden = torch.nn.functional.one_hot(torch.from_numpy(pred.reshape(-1)), V).float()  # (n*B, V)
    head = torch.nn.Linear(V, V, bias=False)
    head.weight.data = torch.eye(V)
    head.weight.requires_grad_(False)
    out = weighted_loss(hidden, head, hand_layout(labels, scored_mask), 0, None)
    assert out.tau == pytest.approx((3 + 1 + 4 + 2) / 4)  # runs 2, 0, 3, 1
    assert out.acc_per_pos == pytest.approx([0.75, 0.75, 0.75])
    assert out.eal == pytest.approx(expected_acceptance([0.75, 0.75, 0.75]))
    assert out.eal != pytest.approx(out.tau)  # errors correlate within blocks: the estimate differs
    stats = out.stats()
    assert stats[-2:].tolist() == [10.0, 4.0]  # tau_sum, blocks appended last


# -- the trainer ------------------------------------------------------------------------------------------------------


class RecordingStore:
    """The training view, recording every sample the training pipeline reads (source store indices)."""

    def __init__(self, view: SubsetStore) -> None:
        self.view, self.read = view, set()

    def __len__(self) -> int:
        return len(self.view)

    def __getitem__(self, i):
        self.read.add(self.view.source_index(i))
        return self.view[i]


def held_out_parts(config, store):
    split = split_store(store, config.data.heldout_fraction)
    view = SubsetStore(store, split.train)
    lengths = np.array([len(store[i][0]) for i in split.train], dtype=np.int64)
    target = TargetModel.from_model_config(config.model, seed=0)
    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterConfig.from_model_config(config.model, target), target)
    sampler = build_sampler(config, lengths, 0, 1, edges=[])
    recorder = RecordingStore(view)
    parts = TrainingParts(recorder, lengths, sampler, [target], drafter, pad_id=0, packed=False, row_len=0, edges=[],
                          heldout=split, full_store=store)
    return parts, split, recorder


def tiny_config(**params):
    base = dict(target_layers=2, hidden_size=32, num_features=1, num_anchors=8, block_size=4, steps=6, log_every=6,
                prefetch=2, hs_queue=1, wandb_mode="disabled", strategy="random", token_budget=256,
                heldout_fraction=0.2, eval_samples=8)
    return from_params({**base, **params}, preset("smoke"))


def test_eval_rows_every_n_steps_and_the_split_in_the_run_folder(tmp_path):
    store = random_store(48)
    config = tiny_config(eval_every=2, steps=5)
    parts, split, recorder = held_out_parts(config, store)
    summary = run_training(config, parts, tmp_path)
    rows = rows_of(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    evaluated = [r["step"] for r in rows if "heldout_tau" in r]
    assert evaluated == [2, 4, 5]  # every 2 steps and the last
    for r in rows:
        assert 1.0 <= r["tau_inbatch"] <= 4 and r["eal"] == pytest.approx(expected_acceptance(r["acc_per_pos"]))
        if r["step"] in evaluated:
            assert set(HELDOUT_KEYS) <= set(r) and r["heldout_samples"] == min(8, len(split.heldout))
            assert math.isfinite(r["heldout_loss"]) and 0 <= r["heldout_acc"] <= 1
            assert 1.0 <= r["heldout_tau"] <= 4 and len(r["heldout_acc_per_pos"]) == 3
            assert r["heldout_eal"] == pytest.approx(expected_acceptance(r["heldout_acc_per_pos"]))
    assert rows[1]["heldout_loss"] != rows[3]["heldout_loss"]  # the drafter changed between evaluations
    assert summary.heldout_step == 5 and summary.heldout.tau == rows[-1]["heldout_tau"]
    assert summary.heldout_count == len(split.heldout) > 0
    # an evaluation step's row holds every field (but the block budget's: the sampler has none), the others none
    every = set(StepMetrics.json_keys()) - {"query_fill", "bound_blocks"}
    assert all(set(r) == (every if r["step"] in evaluated else every - set(HELDOUT_KEYS))
               for r in rows)
    assert all(StepMetrics.from_json(r).to_json() == r for r in rows)  # the flat keys read back
    assert set(json.loads((tmp_path / "summary.json").read_text())) == set(RunSummary.json_keys()) - {
        "target_cache"}  # no feature cache asked for
    assert RunSummary.from_json(tmp_path / "summary.json") == summary
    record = json.loads((tmp_path / "heldout.json").read_text())
    assert record["indices"] == split.heldout.tolist() and record["fraction"] == 0.2
    assert not recorder.read & set(split.heldout.tolist())  # training never read a held-out sample
    assert recorder.read <= set(split.train.tolist())


def test_the_last_step_is_evaluated_when_the_data_ends_on_a_read_with_nothing_to_score(tmp_path):
    """An epoch whose last batch has no sample fit for training: that read is no step, and the evaluation after
    the run's last step still runs (its figures in the summary: the last step's row was written before)."""
    store = random_store(48)
    config = tiny_config(steps=0, epochs=1.0)
    parts, split, _ = held_out_parts(config, store)
    n = len(parts.lengths)
    batches = [list(range(i, min(i + 4, n))) for i in range(0, n, 4)]
    view = [parts.store[i] for i in range(n)]
    parts.store = [(tok, np.zeros_like(m)) if i in batches[-1] else (tok, m) for i, (tok, m) in enumerate(view)]
    parts.sampler = FixedBatchSampler(batches)
    summary = run_training(config, parts, tmp_path)
    assert (summary.steps, summary.empty_batches) == (len(batches) - 1, 1)
    assert summary.heldout_step == summary.steps and math.isfinite(summary.heldout.loss)
    assert not any("heldout_loss" in r for r in rows_of(tmp_path))  # eval_every 0: no evaluation before


@pytest.mark.slow
def test_evaluation_leaves_the_training_trajectory_unchanged(tmp_path):
    store = random_store(48)
    runs = []
    for name, params in (("eval", dict(eval_every=1)), ("none", dict(eval_samples=0))):
        config = tiny_config(steps=5, **params)
        parts, _, _ = held_out_parts(config, store)
        run_training(config, parts, tmp_path / name)
        rows = rows_of(tmp_path / name)
        weights = torch.cat([p.detach().flatten() for p in parts.drafter.parameters() if p.requires_grad])
        runs.append(([(r["loss"], r["grad_norm"], r["tau_inbatch"]) for r in rows], weights, rows))
    (with_eval, w_eval, rows_eval), (without, w_none, rows_none) = runs
    assert all("heldout_tau" in r for r in rows_eval) and not any("heldout_tau" in r for r in rows_none)
    assert with_eval == without
    assert torch.equal(w_eval, w_none)


def test_build_parts_keeps_held_out_samples_out_of_every_training_batch():
    from dflash_lib.train.build import build_parts

    config = from_params({"heldout_fraction": 0.1, "strategy": "bucketed"}, preset("smoke"))
    parts = build_parts(config, torch.device("cpu"))
    split = parts.heldout
    assert isinstance(parts.store, SubsetStore) and len(split.heldout) > 10  # ~30 of 300
    assert len(parts.lengths) == len(split.train) == len(parts.store)
    assert parts.edges[-1] >= parts.lengths.max()  # the bucket plan is the training part's
    served = set()
    for work in epoch_batches(parts.sampler, len(parts.sampler)):  # one epoch
        served |= {parts.store.source_index(i) for i in work.indices}
    assert served == set(split.train.tolist())  # the whole training part, and nothing held out
    assert not served & set(split.heldout.tolist())


# -- the held-out tau is decoding's: cycles laid along the answers (issue 52) -----------------------------------------


def test_decoding_walk_lays_cycles_as_decoding_does_not_one_per_anchor():
    """Blocks accepting 3 drafts on answer positions 4..11, none elsewhere: decoding crosses that stretch in 2
    cycles, while the mean over every anchor counts its 8 blocks (the old figure: 2.26 here against 1.46)."""
    from dflash_lib.train.heldout import decoding_walk

    runs = {j: (3 if 4 <= j < 12 else 0) for j in range(40)}
    cycles = decoding_walk(runs, answer_tokens=41, max_new_tokens=20)
    assert cycles == [1, 1, 1, 1, 4, 4, 1, 1, 1, 1, 1, 1, 1]  # anchors 0..3, 4, 8, 12..18: 19 tokens after the first
    assert sum(cycles) / len(cycles) == pytest.approx(19 / 13)  # the prefill's token is no cycle's
    anchors = [runs[j] + 1 for j in range(19)]  # every anchor a cycle could start from, each counted once
    assert sum(anchors) / len(anchors) == pytest.approx(43 / 19)
    assert decoding_walk(runs, answer_tokens=41, max_new_tokens=6) == [1, 1, 1, 1, 4]  # the last cycle overshoots
    assert decoding_walk(runs, answer_tokens=3, max_new_tokens=20) == [1, 1]  # the answer's end of turn stops it
    assert decoding_walk(runs, answer_tokens=1, max_new_tokens=20) == []  # the prefill gave the whole answer


def test_heldout_tau_is_the_decoded_tau_along_the_same_answers():
    """A partly trained drafter on held-out samples whose answers are the target's own greedy ones (one cut short
    by an end-of-turn id): the trainer's held-out tau equals speculative decoding's on those prompts, cycle for
    cycle, in fp32; the mean over random anchors (the figure heldout_tau was before issue 52) does not."""
    from dflash_lib.evaluate.acceptance import acceptance_length
    from dflash_lib.train.heldout import build_eval_set, evaluate
    from tiny_models import decode_drafter, decode_target, overfit_on_greedy, random_prompts

    B, new, eos = 4, 16, 7
    target = decode_target(256)
    drafter = decode_drafter(target, B)
    prompts = random_prompts(6, seed=1)
    _, _, conts, _ = overfit_on_greedy(target, drafter, prompts, new + 2 * B, steps=8)
    answers = [list(c) for c in conts]
    answers[1] = answers[1][:9] + [eos]  # an answer that ends before max_new_tokens
    # stored as a chat template renders it: a newline after the end of turn, in the loss mask too
    stored = [a + [10] if a[-1] == eos else a for a in answers]
    store = [(np.array(p + a, dtype=np.uint32), (np.arange(len(p) + len(a)) >= len(p)).astype(np.uint8))
             for p, a in zip(prompts, stored)]
    eval_set = build_eval_set(store, range(len(store)), drafter, pad_id=0, token_budget=64, seed=0,
                              max_samples=len(store), max_new_tokens=new, stop_id=eos)
    assert len(eval_set.batches) > 1 and max(len(b.input_ids) for b in eval_set.batches) > 1  # rows share batches
    figures = evaluate(drafter, target, eval_set, autocast=False)
    decoded = acceptance_length(target, drafter, prompts, new, stop_ids=[eos], answers=answers)
    assert decoded.outputs[1] == answers[1] and 1.2 < decoded.tau < B - 0.5  # partly trained: some cycles accept
    assert figures.cycles == decoded.cycles and figures.tau == pytest.approx(decoded.tau, abs=1e-12)
    assert abs(figures.tau_anchors - decoded.tau) > 0.1  # the per-anchor figure does not predict decoding
