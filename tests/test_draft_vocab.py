"""The draft vocabulary (models/draft_vocab.py): the top tokens by brute force, the loss over the head's rows against
log-softmax over full logits restricted to them (labels outside: wrong, no loss), the drafted logits -inf outside,
and the export vLLM reads (draft_vocab_size, d2t, lm_head) read back to the same drafter."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dflash_lib.config import ConfigError
from dflash_lib.data.batch import collate_padded
from dflash_lib.doctor import weight_rules
from dflash_lib.models import tiny_qwen3_config
from dflash_lib.target.local import TargetModel
from dflash_lib.models.draft_vocab import (coverage, from_d2t, scored_token_counts, target_to_draft, to_d2t,
                                           top_tokens)
from dflash_lib.models.export import export_drafter, init_from, read_drafter
from fp_tolerance import rounding_atol
from tiny_models import HIDDEN, VOCAB, tiny_drafter

N = 12  # draft tokens: fewer than the documents' distinct labels, so some labels fall outside


@pytest.fixture(scope="module")
def target64() -> TargetModel:
    hf = tiny_qwen3_config(hidden_size=HIDDEN, num_layers=6, vocab_size=VOCAB)
    return TargetModel.from_hf_config(hf, 2, dtype=torch.float64, seed=0)


def _docs(seed=0):
    """Three documents over 40 ids (so a few dominate), the first 3 tokens a prompt (never scored)."""
    rng = np.random.default_rng(seed)
    out = []
    for L in (21, 13, 9):
        mask = np.ones(L, dtype=np.uint8)
        mask[:3] = 0
        out.append((rng.integers(0, 40, L) * 3 % (VOCAB - 1), mask))
    return out


def test_the_top_tokens_are_the_most_scored_ties_by_the_lower_id():
    docs = _docs()
    counts = scored_token_counts(docs, VOCAB, chunk=2)
    brute = Counter(int(t) for tokens, mask in docs for t, m in zip(tokens, mask) if m)
    assert {i: int(c) for i, c in enumerate(counts) if c} == dict(brute)
    ranked = sorted(range(VOCAB), key=lambda i: (-brute.get(i, 0), i))  # count down, then id up
    ids = top_tokens(counts, N)
    assert ids.tolist() == sorted(ranked[:N])
    assert coverage(counts, ids) == pytest.approx(sum(brute[i] for i in ranked[:N]) / sum(brute.values()))
    assert from_d2t(to_d2t(ids), VOCAB, "here").tolist() == ids.tolist()
    t2d = target_to_draft(ids, VOCAB)
    assert [int(t2d[i]) for i in ids] == list(range(N)) and int((t2d >= 0).sum()) == N
    with pytest.raises(ConfigError, match="d2t"):
        from_d2t(to_d2t(ids.flip(0)), VOCAB, "here")  # not ascending
    with pytest.raises(ConfigError, match="draft_vocab"):
        top_tokens(counts, VOCAB + 1)
    with pytest.raises(ConfigError, match="outside the target vocabulary"):
        scored_token_counts(docs, 10)


@pytest.mark.parametrize("ids, says", [
    ([3, 7, 7, 20], "draft ids 1 and 2 both to target id 7"),  # a duplicate: the only fault a `<` rule lets by
    ([3, 7, 5, 20], "draft ids 1 and 2 to target ids 7 then 5, not ascending"),
    ([3, 7, 20, 7], "draft ids 2 and 3 to target ids 20 then 7, not ascending"),  # a duplicate further apart
    ([3, 7, 20, VOCAB], f"draft id 3 to target id {VOCAB}, outside"),
    ([-1, 7, 20, 30], "draft id 0 to target id -1, outside"),
])
def test_a_d2t_that_is_not_strictly_ascending_in_the_vocabulary_is_refused_naming_the_draft_ids(ids, says):
    """vLLM's d2t (N,): target id = draft id + d2t[draft id]; two draft ids on one target token are refused in one
    line naming both and the token, as is any pair out of order or an id outside 0 .. V-1."""
    with pytest.raises(ConfigError) as caught:
        from_d2t(to_d2t(torch.tensor(ids)), VOCAB, "out/model.safetensors")
    line = str(caught.value)
    assert "\n" not in line and line.startswith("out/model.safetensors: d2t maps ") and says in line, line
    assert from_d2t(to_d2t(torch.tensor([3, 7, 8, VOCAB - 1])), VOCAB, "here").tolist() == [3, 7, 8, VOCAB - 1]


def test_an_export_whose_d2t_puts_two_draft_ids_on_one_token_is_refused(target64, tmp_path):
    """The exported d2t edited so that draft id 5 drafts draft id 4's target token: read back, it is refused,
    naming the weights file, the two draft ids and the token."""
    drafter = _vocab_drafter(target64, _docs())
    export_drafter(drafter, tmp_path / "out", torch.float32)
    weights = tmp_path / "out" / "model.safetensors"
    from safetensors.torch import load_file, save_file
    state = load_file(str(weights))
    token = int(state["d2t"][4]) + 4
    state["d2t"][5] = token - 5
    save_file(state, str(weights))
    with pytest.raises(ConfigError, match=rf"^{weights}: d2t maps draft ids 4 and 5 both to target id {token} "):
        read_drafter(tmp_path / "out", target64)


def _vocab_drafter(target, docs, **cfg):
    drafter = tiny_drafter(target, draft_vocab_size=N, **cfg).to(torch.float64)
    drafter.set_draft_vocab(top_tokens(scored_token_counts(docs, VOCAB), N))
    return drafter


@pytest.mark.parametrize("loss, weights", [("ce", "decay"), ("ce+kl", "decay"), ("ce", "dpace")])
def test_the_loss_is_log_softmax_over_the_rows_labels_outside_wrong_and_free(target64, loss, weights):
    docs = _docs()
    drafter = _vocab_drafter(target64, docs, loss=loss, position_weight=weights, ce_chunk_blocks=2)
    batch = collate_padded(docs, 0)
    layout = drafter.layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(0)))
    if layout.target_rows is None:
        feats, final = target64.context_features(batch), None
    else:
        feats, final = target64.context_features_and_final(batch, layout.target_rows)
    out = drafter.loss(batch, feats, layout, target_hidden=final)
    out.loss.backward()
    got = [p.grad.clone() for p in drafter.parameters()]
    drafter.zero_grad()
    # brute force: the full (n, B, V) logits (-inf outside the rows), log-softmax over all of them
    z = drafter.block_logits(batch, feats, layout).reshape(-1, VOCAB)[layout.scored]  # (m, V)
    ids = drafter.draft_ids
    assert torch.isinf(z).sum() == z.shape[0] * (VOCAB - N)
    inside = torch.isin(layout.labels, ids)
    assert 0 < int(inside.sum()) < len(inside)  # some labels fall outside
    log_q = F.log_softmax(z, dim=-1)
    ce = torch.where(inside, -log_q.gather(1, layout.labels.clamp(max=VOCAB - 1).unsqueeze(1)).squeeze(1),
                     torch.zeros(()).double())
    per = ce
    if loss == "ce+kl":
        t = F.linear(final[layout.target_of], target64.lm_head.weight[ids])  # the target's logits over the rows
        log_p = F.log_softmax(t, dim=-1)
        kl = (log_p.exp() * (log_p - log_q[:, ids])).sum(-1)
        per = ce + torch.where(inside, kl, torch.zeros(()).double())
    w = layout.weights.double()
    if weights == "dpace":
        from dflash_lib.models.loss import dpace_weights
        q = torch.where(inside, torch.exp(-ce.detach()), torch.zeros(()).double())
        w = w * dpace_weights(q, layout.scored, layout.num_blocks, layout.block_size, 0.5).double()
    expected = (w * per).sum() / layout.weight_sum
    expected.backward()
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-9)
    for g, p in zip(got, drafter.parameters()):
        assert torch.allclose(g, p.grad, rtol=0, atol=1e-7)  # the ce path: float32 logits
    right = (z.argmax(-1) == layout.labels) & inside
    assert out.correct_weight == pytest.approx(float((layout.weights.double() * right).sum()))


def test_drafts_come_from_the_rows_and_the_export_is_what_vllm_reads(target64, tmp_path):
    docs = _docs()
    drafter = _vocab_drafter(target64, docs)
    ids = drafter.draft_ids.clone()
    feats = target64.context_features(collate_padded(docs[:1], 0))  # (C, F*H) of the one document
    logits = drafter.draft_logits(feats, 6, torch.tensor([int(docs[0][0][6])] + [drafter.cfg.mask_id] * 3))
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(logits[:, outside]).all() and torch.isfinite(logits[:, ids]).all()
    assert torch.equal(drafter.draft_head, target64.lm_head.weight[ids])  # the target's own rows
    export_drafter(drafter, tmp_path / "out", torch.float32)
    doc = json.loads((tmp_path / "out" / "config.json").read_text())
    assert doc["draft_vocab_size"] == N and doc["vocab_size"] == VOCAB
    from safetensors import safe_open
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        d2t, head = f.get_tensor("d2t"), f.get_tensor("lm_head.weight")
        header = {k: ({torch.float32: "F32", torch.int64: "I64"}[f.get_tensor(k).dtype],
                      tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    assert d2t.dtype == torch.int64 and torch.equal(d2t + torch.arange(N), ids)  # target id = draft id + d2t
    assert torch.equal(head, drafter.draft_head.float())
    assert [r.line() for r in weight_rules(doc, header) if r.ok is not True] == []
    back = read_drafter(tmp_path / "out", target64, torch.float64)
    assert torch.equal(back.draft_ids, ids) and torch.equal(back.draft_head, drafter.draft_head.float().double())
    # the export's fp32 weights (each rounded by <= eps/2) against the fp64 drafter's: rounding_atol over the
    # widest sum (hidden, intermediate, context) and each layer plus the head; -inf outside the rows, in both
    got, want = (d.draft_logits(feats, 6, torch.tensor([5, 7, 7, 7])) for d in (back, drafter))  # (B, V)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    c = drafter.cfg
    atol = rounding_atol(want[:, ids], terms=max(c.hidden_size, c.intermediate_size, feats.shape[0]),
                         depth=c.num_layers + 1, dtype=torch.float32)
    torch.testing.assert_close(got[:, ids], want[:, ids], rtol=0, atol=atol)
    plain = tiny_drafter(target64).to(torch.float64)  # init_from takes the weights, keeps its own (whole) head
    init_from(plain, tmp_path / "out")
    assert torch.equal(plain.fc.weight, drafter.fc.weight.float().double())
    assert not plain.cfg.draft_vocab_size and not list(plain.buffers(recurse=False))


def test_a_draft_vocabulary_the_file_lacks_or_the_target_outgrows_is_refused(target64, tmp_path):
    drafter = _vocab_drafter(target64, _docs())
    export_drafter(drafter, tmp_path / "out", torch.float32)
    doc = json.loads((tmp_path / "out" / "config.json").read_text())
    (tmp_path / "out" / "config.json").write_text(json.dumps({**doc, "draft_vocab_size": N + 1}))
    with pytest.raises(ConfigError, match=rf"draft_vocab_size {N + 1} needs d2t"):
        read_drafter(tmp_path / "out", target64)
    doc.pop("draft_vocab_size")
    (tmp_path / "out" / "config.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="holds an LM head or d2t"):
        read_drafter(tmp_path / "out", target64)
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        tiny_drafter(target64, draft_vocab_size=VOCAB + 1)


def test_the_dry_run_prices_the_head_by_its_rows():
    """`dryrun -p draft_vocab N`: the loss head's FLOPs per scored position 4HN instead of 4HV, everything else the
    same; the buffers (N ids, N x H rows) held on top."""
    from dflash_lib import dryrun
    from dflash_lib.config import from_params

    V, H, n = 8000, 64, 1000
    hf = tiny_qwen3_config(hidden_size=H, num_layers=4, vocab_size=V)
    figures = {}
    for rows in (0, n):
        cfg = from_params(dict(hidden_size=H, target_layers=4, num_features=2, drafter_layers=2, block_size=4,
                               num_anchors=8, token_budget=256, max_len=128, mask_id=V - 1, ce_chunk_blocks=2,
                               draft_vocab=rows))
        worst = dryrun.worst_bucket_batch(0, 0, 64, cfg, block_budget=80)
        models = dryrun.build_step_models(cfg, hf, dryrun.StepSettings("blocks", False), fake=True)
        figures[rows] = dryrun.measure_step(models, dryrun.host_batch(worst, V, cfg.model.mask_id), seed=0)
    full, cut = figures[0].flops, figures[n].flops
    assert full["head_ce"] == cut["head_ce"] * V // n > 0
    assert {k: v for k, v in full.items() if k != "head_ce"} == {k: v for k, v in cut.items() if k != "head_ce"}


def test_a_draft_vocabulary_of_the_whole_vocabulary_is_refused_wherever_it_is_set(target64):
    """N = V is no draft vocabulary (the doctor and the export's reader count it as none): refused by the drafter's
    config and by the run's vocabulary check (which also covers the `tiny` target and named shapes, whose folder
    config.py cannot read); N = V - 1 taken by both."""
    from dflash_lib.config import from_params, preset
    from dflash_lib.models import DrafterConfig
    from dflash_lib.models.target_config import target_hf_config
    from dflash_lib.train.build import check_vocabulary

    fields = tiny_drafter(target64).cfg.to_dict()
    assert DrafterConfig(**{**fields, "draft_vocab_size": VOCAB - 1}).draft_vocab_size == VOCAB - 1
    with pytest.raises(ConfigError, match=f"draft_vocab_size {VOCAB} is outside 0 .. {VOCAB - 1}"):
        DrafterConfig(**{**fields, "draft_vocab_size": VOCAB})
    tiny = from_params({"target": "tiny"}, preset("smoke"))
    V = target_hf_config(tiny.model).vocab_size
    check_vocabulary(from_params({"draft_vocab": V - 1}, tiny), {"n_vocab": 2})
    with pytest.raises(ConfigError, match=f"draft_vocab {V} is not below target 'tiny''s vocab_size {V}"):
        check_vocabulary(from_params({"draft_vocab": V}, tiny), {"n_vocab": 2})
