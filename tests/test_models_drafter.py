"""DFlashDrafter: mask semantics, training forward == per-block inference, packed == padded, loss, save/load."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from dflash_lib.config import ConfigError, ModelConfig
from dflash_lib.data.batch import collate_packed, collate_padded
from dflash_lib.models import (DFlashDrafter, DrafterConfig, decay_weights, default_gamma, expected_acceptance,
                               head_cross_entropy, sample_anchors, tiny_qwen3_config)
from dflash_lib.target.local import TargetModel
from dflash_lib.models.export import export_drafter, read_drafter

VOCAB, MASK, H = 300, 299, 32


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_hf_config(tiny_qwen3_config(hidden_size=H, num_layers=6, vocab_size=VOCAB), 2, seed=0)


def _cfg(target, **kw) -> DrafterConfig:
    base = dict(hidden_size=H, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                vocab_size=VOCAB, target_layer_ids=target.layer_ids, target_num_layers=target.num_layers,
                block_size=4, mask_id=MASK, num_anchors=6, ce_chunk_blocks=2)
    return DrafterConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def drafter(target) -> DFlashDrafter:
    torch.manual_seed(0)
    return DFlashDrafter(_cfg(target), target)


def _docs(lengths, seed=0, prompt=2):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, VOCAB - 1, n), np.arange(n) >= prompt) for n in lengths]


def _setup(target, drafter, docs, packed, seed=1, noise=1.0):
    batch = collate_packed(docs, 0, row_len=sum(len(t) for t, _ in docs) + 3) if packed else collate_padded(docs, 0)
    anchors = drafter.sample_anchors(batch, torch.Generator().manual_seed(seed), noise)
    return batch, target.features(batch), anchors


# -- blocks --------------------------------------------------------------------------------------------------
def test_documents_shorter_than_a_block_give_no_nan(target, drafter):
    docs = _docs([12, 3, 2])  # blocks of the short documents run past their end
    batch, feats, anchors = _setup(target, drafter, docs, packed=False)
    hidden = drafter.forward_hidden(batch, feats, anchors)
    assert hidden.shape == (anchors.num_blocks * 4, H) and torch.isfinite(hidden).all()
    out = drafter.loss(batch, feats, anchors)
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(torch.isfinite(p.grad).all() for p in drafter.parameters())
    drafter.zero_grad(set_to_none=True)


@pytest.mark.parametrize("packed", [False, True])
def test_batch_without_any_anchor_gives_a_connected_zero(target, drafter, packed):
    docs = [(np.arange(6), np.zeros(6, bool)), (np.arange(4), np.zeros(4, bool))]  # no assistant tokens
    batch, feats, anchors = _setup(target, drafter, docs, packed)
    assert anchors.num_blocks == 0 and drafter.weight_sum(anchors) == 0
    out = drafter.loss(batch, feats, anchors)
    out.loss.backward()
    assert out.loss.item() == 0 and out.acc != out.acc and out.eal == 1.0
    assert all(p.grad is not None and not p.grad.any() for p in drafter.parameters())
    drafter.zero_grad(set_to_none=True)


# -- training forward == inference forward ---------------------------------------------------------------
def _max_block_gap(target, drafter, packed: bool, noise: float = 1.0) -> float:
    docs = _docs([14, 9, 17], seed=3)
    batch, feats, anchors = _setup(target, drafter, docs, packed, noise=noise)
    layout = drafter.layout(batch, anchors)
    with torch.no_grad():
        logits = drafter.block_logits(batch, feats, layout)  # (n, B, V)
    gap = 0.0
    flat_doc, flat_feats = batch.doc_ids.reshape(-1), feats.reshape(-1, feats.shape[-1])
    for i in range(layout.num_blocks):
        with torch.no_grad():
            ref = drafter.draft_logits(flat_feats[flat_doc == layout.block_doc[i]], int(layout.anchor_pos[i]),
                                       layout.block_ids[i])
        gap = max(gap, float((logits[i] - ref).abs().max()))
    return gap


@pytest.mark.parametrize("packed", [False, True])
def test_training_forward_equals_per_block_inference(target, drafter, packed):
    assert _max_block_gap(target, drafter, packed) < 1e-5
    assert _max_block_gap(target, drafter, packed, noise=0.5) < 1e-5


def test_packed_row_equals_padded_batch(target, drafter):
    docs = _docs([15, 6, 11, 8], seed=5)
    losses = []
    for packed in (False, True):
        batch, feats, anchors = _setup(target, drafter, docs, packed, seed=7)
        losses.append(drafter.loss(batch, feats, anchors))
    pad, pack = losses
    assert pad.weight_sum == pytest.approx(pack.weight_sum, abs=1e-6) and pad.weight_sum > 0
    assert abs(pad.loss.item() - pack.loss.item()) < 1e-5
    assert pad.acc_per_pos == pytest.approx(pack.acc_per_pos, abs=1e-9)


@pytest.mark.parametrize("packed", [False, True])
def test_document_weighting_is_the_mean_over_documents_of_each_ones_own_loss(target, drafter, packed):
    """loss_weighting "document": the same anchors, labels and blocks as "token", each document's weights scaled
    to sum to 1; the loss equals the plain mean over documents of the token-weighted loss with every other
    document's weights zeroed (a document weighing alike whatever its length)."""
    per_doc = DFlashDrafter(_cfg(target, loss_weighting="document"), target)
    per_doc.load_state_dict(drafter.state_dict())
    docs = _docs([15, 6, 11, 8], seed=5)
    batch, feats, tok = _setup(target, drafter, docs, packed, seed=7)
    doc = per_doc.sample_anchors(batch, torch.Generator().manual_seed(7))
    for name in ("slot", "pos", "doc", "block_ids", "labels"):
        assert torch.equal(getattr(tok, name), getattr(doc, name))
    sums = [float(doc.weights[doc.doc == d].sum()) for d in range(len(docs))]
    assert sums == pytest.approx([1.0] * len(docs), abs=1e-6)
    with torch.no_grad():
        own = []
        for d in range(len(docs)):
            only = dataclasses.replace(tok, weights=tok.weights * (tok.doc == d)[..., None])
            own.append(drafter.loss(batch, feats, only).loss.item())
        got = per_doc.loss(batch, feats, doc)
    assert got.weight_sum == pytest.approx(len(docs), abs=1e-5)
    terms = int((tok.weights > 0).sum())  # fp32 sums of this many terms, each way: the bound on their rounding
    assert got.loss.item() == pytest.approx(sum(own) / len(own), rel=2 * terms * torch.finfo(torch.float32).eps)
    assert abs(got.loss.item() - drafter.loss(batch, feats, tok).loss.item()) > 1e-3  # the weighting matters here
    with pytest.raises(ConfigError, match="loss_weighting"):
        ModelConfig(loss_weighting="row")


# -- anchors ---------------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 14), min_size=1, max_size=4), seed=st.integers(0, 10**6),
       num_anchors=st.integers(1, 8), noise=st.sampled_from([1.0, 0.7, 0.3]))
def test_anchor_invariants(lengths, seed, num_anchors, noise):
    rng = np.random.default_rng(seed)
    docs = [(rng.integers(0, 50, n), rng.random(n) < 0.7) for n in lengths]
    B, gamma = 4, 2.0
    draw = lambda batch: sample_anchors(batch, num_anchors, B, gamma, MASK,  # noqa: E731
                                        torch.Generator().manual_seed(seed), noise)
    pad = draw(collate_padded(docs, 0))
    pack = draw(collate_packed(docs, 0, row_len=sum(lengths)))
    decay = decay_weights(B, gamma)
    n_masked = max(1, round(noise * (B - 1)))
    for d, (tok, lm) in enumerate(docs):
        valid = [a for a in range(len(tok) - 1) if lm[a] and lm[a + 1]]
        rows = [(an.pos[an.doc == d], an.block_ids[an.doc == d], an.labels[an.doc == d], an.weights[an.doc == d])
                for an in (pad, pack)]
        for other in rows[1:]:  # packed and padded draw the same anchors, tokens and weights
            assert all(torch.equal(x, y) for x, y in zip(rows[0], other))
        pos, ids, labels, weights = rows[0]
        assert pos.tolist() == sorted(set(pos.tolist())) and set(pos.tolist()) <= set(valid)
        assert len(pos) == min(num_anchors, len(valid))
        for a, blk, lab, w in zip(pos.tolist(), ids, labels, weights):
            assert blk[0] == tok[a] and w[0] == 0
            masked = blk[1:] == MASK
            for k in range(1, B):
                inside = a + k < len(tok)
                scored = inside and bool(lm[a + k]) and bool(blk[k] == MASK)
                assert float(w[k]) == pytest.approx(float(decay[k]) if scored else 0.0)
                if inside:
                    assert lab[k] == tok[a + k]  # same position, no shift
                    assert blk[k] in (MASK, tok[a + k])
            if noise == 1.0:
                assert bool(masked.all())
            else:  # exactly B-1-n_masked positions are revealed; the ones past the document stay MASK
                inside = min(B - 1, len(tok) - 1 - a)
                revealed = int((blk[1:] != MASK).sum())
                assert revealed <= B - 1 - n_masked and not (blk[1 + inside:] != MASK).any()
                if inside == B - 1:
                    assert revealed == B - 1 - n_masked


def test_anchors_are_fresh_per_draw_and_reproducible(target, drafter):
    batch = collate_padded(_docs([40]), 0)
    g = torch.Generator().manual_seed(3)
    first, second = drafter.sample_anchors(batch, g), drafter.sample_anchors(batch, g)
    again = drafter.sample_anchors(batch, torch.Generator().manual_seed(3))
    assert not torch.equal(first.pos, second.pos)
    assert torch.equal(first.pos, again.pos)


def test_gamma_and_decay():
    assert [default_gamma(b) for b in (8, 10, 16)] == [4.0, 5.0, 7.0]
    assert default_gamma(4) == 2.0 and 5.0 < default_gamma(12) < 7.0 and default_gamma(19) == 8.0
    w = decay_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1 and float(w[8]) == pytest.approx(np.exp(-1.0))
    assert expected_acceptance([1.0, 1.0, 1.0]) == 4.0
    assert expected_acceptance([0.5, 0.5]) == pytest.approx(1.75)


# -- loss ------------------------------------------------------------------------------------------------
def test_no_gradient_reaches_the_target(target, drafter):
    batch, feats, anchors = _setup(target, drafter, _docs([16, 10]), packed=True)
    drafter.loss(batch, feats, anchors).loss.backward()
    assert all(p.grad is None for p in target.parameters())
    trainable = {id(p) for p in drafter.parameters() if p.requires_grad}
    assert id(target.embed_tokens.weight) not in trainable and id(target.lm_head.weight) not in trainable
    assert all(p.grad is not None for p in drafter.parameters())
    drafter.zero_grad(set_to_none=True)


def test_chunked_ce_equals_unchunked(target):
    docs = _docs([20, 13], seed=2)
    results = []
    for chunk in (0, 1, 3):
        torch.manual_seed(0)
        d = DFlashDrafter(_cfg(target, ce_chunk_blocks=chunk), target)
        batch, feats, anchors = _setup(target, d, docs, packed=False)
        out = d.loss(batch, feats, anchors)
        out.loss.backward()
        results.append((out.loss.item(), out.acc, [p.grad.clone() for p in d.parameters()]))
    for loss, acc, grads in results[1:]:
        assert loss == pytest.approx(results[0][0], abs=1e-6) and acc == results[0][1]
        for g, g0 in zip(grads, results[0][2]):
            torch.testing.assert_close(g, g0, atol=1e-6, rtol=1e-5)


def test_global_normalizer_makes_split_batches_add_up(target, drafter):
    docs = _docs([18, 11, 14, 9], seed=4)
    batch, feats, anchors = _setup(target, drafter, docs, packed=False)
    whole = drafter.loss(batch, feats, anchors)
    assert drafter.weight_sum(anchors) == pytest.approx(whole.weight_sum)
    assert whole.loss.item() == pytest.approx(whole.ce_sum / whole.weight_sum, rel=1e-6)
    halves = [collate_padded(docs[:2], 0), collate_padded(docs[2:], 0)]
    anchors_h = [drafter.sample_anchors(b, torch.Generator().manual_seed(i)) for i, b in enumerate(halves)]
    total_w = sum(drafter.weight_sum(a) for a in anchors_h)
    parts = [drafter.loss(b, target.features(b), a, normalizer=total_w) for b, a in zip(halves, anchors_h)]
    own = [drafter.loss(b, target.features(b), a) for b, a in zip(halves, anchors_h)]
    assert sum(p.loss.item() for p in parts) == pytest.approx(sum(p.ce_sum for p in own) / total_w, rel=1e-5)
    acc = sum(p.correct_weight for p in parts) / total_w
    assert 0.0 <= acc <= 1.0 and len(whole.acc_per_pos) == 3
    with pytest.raises(ValueError, match="normalizer"):
        drafter.loss(batch, feats, anchors, normalizer=0.0)


# -- persistence and configs -----------------------------------------------------------------------------
def test_save_load_round_trip(target, drafter, tmp_path):
    export_drafter(drafter, tmp_path, torch.float32)
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert "fc.weight" in weights and "layers.1.self_attn.k_proj.weight" in weights
    assert not any("embed" in k or "lm_head" in k for k in weights)
    assert len(weights) == len([p for p in drafter.parameters() if p.requires_grad])
    doc = json.loads((tmp_path / "config.json").read_text())  # the serving layout, in fp32 (see test_export.py)
    assert doc["dflash_config"]["target_layer_ids"] == target.layer_ids and doc["vocab_size"] == VOCAB
    assert doc["torch_dtype"] == "float32" and all(w.dtype == torch.float32 for w in weights.values())
    loaded = read_drafter(tmp_path, target)
    feats = target.features(collate_padded(_docs([9]), 0))[0]
    ids = torch.tensor([5, MASK, MASK, MASK])
    with torch.no_grad():
        torch.testing.assert_close(loaded.draft_logits(feats, 6, ids), drafter.draft_logits(feats, 6, ids))
    other = TargetModel.from_hf_config(tiny_qwen3_config(hidden_size=H, num_layers=8, vocab_size=VOCAB), 2)
    with pytest.raises(ConfigError, match="num_target_layers is 6, the target has 8"):
        read_drafter(tmp_path, other)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        read_drafter(tmp_path, target)


@pytest.mark.parametrize("change, message", [
    (dict(mask_id=VOCAB), "mask_id 300 is outside the target vocabulary"),
    (dict(mask_id=-1), "outside the target vocabulary"),
    (dict(target_layer_ids=[1, 6]), r"target layer ids \[6\] are outside \[0, 6\)"),
    (dict(block_size=1), "block_size must be >= 2"),
])
def test_bad_drafter_configs_are_refused(target, change, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(target, **change)


def test_drafter_must_match_the_target(target):
    with pytest.raises(ConfigError, match="hidden_size 64 differs from the target's 32"):
        DFlashDrafter(_cfg(target, hidden_size=64), target)
    with pytest.raises(ConfigError, match="feature layers"):
        DFlashDrafter(_cfg(target, target_layer_ids=[2, 3]), target)


def test_real_qwen3_vocabulary_and_default_mask_id():
    cfg = ModelConfig(target_layers=4, hidden_size=32, num_features=1, block_size=4, num_anchors=4)
    target = TargetModel.from_model_config(cfg)
    assert target.vocab_size == 151936 and target.layer_ids == [2]
    drafter = DFlashDrafter(DrafterConfig.from_model_config(cfg, target), target)
    assert drafter.cfg.mask_id == 151669 and drafter.cfg.gamma == 2.0
    batch = collate_padded([(np.arange(151000, 151012), np.arange(12) >= 3)], 0)
    anchors = drafter.sample_anchors(batch, torch.Generator().manual_seed(0))
    out = drafter.loss(batch, target.features(batch), anchors)
    assert out.weight_sum > 0 and out.loss.item() == pytest.approx(np.log(151936), rel=0.05)


@pytest.mark.parametrize("chunk", [0, 1, 3, 7, 50])
def test_fused_head_ce_matches_plain_autograd(chunk):
    g = torch.Generator().manual_seed(5)
    head = torch.nn.Linear(16, 40, bias=True).requires_grad_(False)
    hidden = torch.randn(7, 16, generator=g, requires_grad=True)
    labels, w = torch.randint(0, 40, (7,), generator=g), torch.rand(7, generator=g)
    ce, pred = head_cross_entropy(hidden, head, labels, chunk)
    (w * ce).sum().backward()
    ref_hidden = hidden.detach().clone().requires_grad_(True)
    logits = head(ref_hidden)
    ref_ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    (w * ref_ce).sum().backward()
    torch.testing.assert_close(ce, ref_ce, atol=1e-6, rtol=1e-6)
    assert pred.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, atol=1e-6, rtol=1e-5)


def test_fused_head_ce_runs_the_head_once_per_chunk_and_never_in_backward(monkeypatch):
    import dflash_lib.models.loss as loss_mod

    calls = []
    real_linear = loss_mod.F.linear
    monkeypatch.setattr(loss_mod.F, "linear", lambda *a: calls.append(1) or real_linear(*a))
    head = torch.nn.Linear(8, 30, bias=False).requires_grad_(False)
    hidden = torch.randn(10, 8, requires_grad=True)
    ce, _ = head_cross_entropy(hidden, head, torch.randint(0, 30, (10,)), chunk=4)
    assert len(calls) == 3  # ceil(10 / 4) chunks
    ce.sum().backward()
    assert len(calls) == 3 and hidden.grad is not None  # the backward reuses the gradient: no recompute
    with torch.no_grad():  # evaluation computes no gradient at all
        head_cross_entropy(hidden, head, torch.randint(0, 30, (10,)), chunk=4)


def test_fused_head_ce_refuses_a_trainable_head():
    head = torch.nn.Linear(8, 30)
    with pytest.raises(ValueError, match="frozen"):
        head_cross_entropy(torch.randn(3, 8, requires_grad=True), head, torch.tensor([1, 2, 3]), 0)
