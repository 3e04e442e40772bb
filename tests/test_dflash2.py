"""The DFlash2 drafter (models/dflash2.py, models/drafters/dflash2.py): a fresh one drafts as DFlash; training and
inference forwards agree; the block convolution stays inside its block and is causal in it; the selector loss and
its warm-up; the serving folder; and the whole drafting step against a reference built from the installed vLLM's
own CPU functions (tests/vllm_dflash2_reference.py). vLLM's CPU build refuses to serve a DFlash2DraftModel: the
engine test pins that refusal (docs/serving.md, "DFlash2")."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_lib.config import ConfigError, ModelConfig
from dflash_lib.data.batch import collate_packed, collate_padded
from dflash_lib.models import DFlashDrafter, DrafterConfig
from dflash_lib.models.dflash2 import DFlash2Config, DFlash2Drafter, block_conv
from dflash_lib.models.drafters import dflash2 as kind2
from dflash_lib.models.export import export_drafter, read_drafter
from fp_tolerance import rounding_atol, tie_atol
from tiny_models import BLOCK, HIDDEN, MASK, VOCAB, tiny_target

FIELDS = dict(hidden_size=HIDDEN, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
              vocab_size=VOCAB, mask_id=MASK, num_anchors=64)
SMALL = dict(conv_group_size=8, selector_rank=16, selector_top_k=6)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def _drafter(target, block: int = BLOCK, perturbed: bool = True, **over) -> DFlash2Drafter:
    """A DFlash2 drafter on `target`; `perturbed`: convolutions, kernel deltas and both codebooks random (a fresh
    one is the identity and scores no edge), large enough that the selector changes picks."""
    torch.manual_seed(0)
    cfg = DFlash2Config(**FIELDS, target_layer_ids=target.layer_ids, target_num_layers=target.num_layers,
                        block_size=block, **(SMALL | over))
    d = DFlash2Drafter(cfg, target, attention="dense")
    if perturbed:
        with torch.no_grad():
            for name, p in d.named_parameters():
                if "base_kernel" in name:
                    p.add_(0.3 * torch.randn_like(p))
                elif "kernel_projection" in name:
                    p.normal_(0.0, 0.2)
                elif "codebook" in name or "hidden_projection" in name:
                    p.normal_(0.0, 1.0)
    return d


def _docs(lengths, seed):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, VOCAB - 1, n), np.arange(n) >= 3) for n in lengths]


def _batch(target, drafter, packed: bool, seed: int = 3):
    docs = _docs([14, 9, 17], seed)
    batch = collate_packed(docs, 0, row_len=48) if packed else collate_padded(docs, 0)
    feats = target.features(batch)
    anchors = drafter.sample_anchors(batch, torch.Generator().manual_seed(seed))
    return batch, feats, anchors


def test_a_fresh_dflash2_drafts_exactly_as_the_dflash_drafter_with_its_weights(target):
    d2 = _drafter(target, perturbed=False)
    d1 = DFlashDrafter(DrafterConfig(**{k: getattr(d2.cfg, k) for k in DrafterConfig.__dataclass_fields__}),
                       target, attention="dense")
    d1.load_state_dict({k: v for k, v in d2.state_dict().items() if k in d1.state_dict()})
    batch, feats, anchors = _batch(target, d1, packed=False)
    with torch.no_grad():
        assert torch.equal(d1.block_logits(batch, feats, anchors), d2.block_logits(batch, feats, anchors))
    assert d2.loss(batch, feats, anchors).ce_total.item() == d1.loss(batch, feats, anchors).ce_total.item()
    f = feats[0]
    for pos, token in [(4, 5), (9, 17), (12, 3)]:
        assert d2.draft(f, pos, token) == d1.draft(f, pos, token)


@pytest.mark.parametrize("packed", [False, True])
def test_training_forward_equals_per_block_inference_and_the_cached_path(target, packed):
    d = _drafter(target)
    batch, feats, anchors = _batch(target, d, packed)
    layout = d.layout(batch, anchors)
    with torch.no_grad():
        logits = d.block_logits(batch, feats, layout)  # (n, B, V)
    flat_doc, flat = batch.doc_ids.reshape(-1), feats.reshape(-1, feats.shape[-1])
    for i in range(layout.num_blocks):
        doc = flat[flat_doc == layout.block_doc[i]]
        with torch.no_grad():
            ref = d.draft_logits(doc, int(layout.anchor_pos[i]), layout.block_ids[i])
        torch.testing.assert_close(logits[i], ref, rtol=0, atol=rounding_atol(ref, terms=HIDDEN, depth=4))
    doc = flat[flat_doc == 0]
    cache = d.context_cache()
    d.extend_context(cache, doc[:7])
    assert d.draft_cached(cache, int(batch.input_ids.reshape(-1)[7])) == d.draft(doc, 7, int(
        batch.input_ids.reshape(-1)[7]))


def test_the_block_convolution_stays_in_its_block_and_is_causal_there():
    torch.manual_seed(1)
    B, taps, G, H = 5, 3, 4, 8
    y, delta, base = torch.randn(3 * B, H), torch.randn(3 * B, taps, G), torch.randn(taps, H)
    out = block_conv(y, delta, base, B)
    for row in range(3 * B):
        moved = y.clone()
        moved[row] += 1.0
        changed = (block_conv(moved, delta, base, B) - out).abs().sum(1) > 0  # (3B,)
        block, place = divmod(row, B)
        want = torch.zeros(3 * B, dtype=torch.bool)
        want[block * B + place: min(block * B + place + taps, (block + 1) * B)] = True  # itself and taps-1 after
        assert torch.equal(changed, want), row
    # tap t of row p multiplies y[p - t] by base[t] + its group's delta: one entry written out
    p, t, c = 7, 2, 5  # row 7 = place 2 of block 1, channel 5 of group 2
    one = torch.zeros_like(y)
    one[p - t, c] = 1.0
    assert block_conv(one, delta, base, B)[p, c].item() == pytest.approx((base[t, c] + delta[p, t, c // 2]).item())


def test_the_selector_loss_trains_the_codebooks_and_its_warm_up_ramps_it_in(target):
    d = _drafter(target, perturbed=False, selector_warmup=4)
    batch, feats, anchors = _batch(target, d, packed=False)
    plain = DFlashDrafter._objective  # the drafter's loss without the selector's term
    d.begin_step(0)
    base = d.loss(batch, feats, anchors)
    layout = d.layout(batch, anchors)
    assert base.loss.item() == plain(d, d.forward_hidden(batch, feats, layout), layout, None, None).loss.item()
    losses = []
    for step in (1, 2, 4, 9):
        d.begin_step(step)
        losses.append(d.loss(batch, feats, anchors).loss.item() - base.loss.item())
    assert losses[0] > 0 and losses[1] == pytest.approx(2 * losses[0]) and losses[2] == pytest.approx(4 * losses[0])
    assert losses[3] == pytest.approx(losses[2])  # full weight after the warm-up
    out = d.loss(batch, feats, anchors)
    out.loss.backward()
    assert d.candidate_selector.successor_codebook.grad.abs().sum() > 0  # the edge term learns from a fresh start
    opt = torch.optim.SGD(d.parameters(), lr=1.0)
    opt.step()
    opt.zero_grad()
    d.loss(batch, feats, anchors).loss.backward()  # now the successor codebook is not 0: all of it trains
    assert d.candidate_selector.predecessor_codebook.grad.abs().sum() > 0
    assert d.candidate_selector.hidden_projection.weight.grad.abs().sum() > 0


def test_the_serving_folder_round_trips_and_names_vllms_fields(target, tmp_path):
    d = _drafter(target, output_multiplier=1.0)
    out = export_drafter(d, tmp_path / "d2", torch.float32)
    doc = json.loads((out / "config.json").read_text())
    assert doc["architectures"] == ["DFlash2DraftModel"] and doc["model_type"] == "qwen3"
    assert {k: doc["dflash_config"][k] for k in kind2.SERVED} == {"conv_kernel_size": 2, "conv_group_size": 8,
                                                                  "selector_rank": 16, "selector_top_k": 6}
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"layers.1.attention_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight",
            "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight"} <= names
    back = read_drafter(out, target, attention="dense")
    assert isinstance(back, DFlash2Drafter) and back.cfg == d.cfg
    batch, feats, anchors = _batch(target, d, packed=False)
    with torch.no_grad():
        assert torch.equal(back.block_logits(batch, feats, anchors), d.block_logits(batch, feats, anchors))
    for key, value, message in [("selector_top_k", None, "dflash_config.selector_top_k is missing"),
                                ("draft_vocab_size", 100, "no d2t map")]:
        bad = json.loads(json.dumps(doc))
        if key == "draft_vocab_size":
            bad[key] = value
        else:
            del bad["dflash_config"][key]
        (out / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=message):
            read_drafter(out, target)


def test_the_settings_are_refused_for_another_kind_and_out_of_range():
    with pytest.raises(ConfigError, match="selector_rank is a setting of drafter_kind dflash2"):
        ModelConfig(selector_rank=8)
    with pytest.raises(ConfigError, match="conv_group_size must be > 0"):
        ModelConfig(drafter_kind="dflash2", conv_group_size=0)
    with pytest.raises(ConfigError, match="draft_vocab: a dflash2 drafter needs the whole head"):
        ModelConfig(drafter_kind="dflash2", draft_vocab=64)
    with pytest.raises(ConfigError, match="conv_group_size 7 does not divide hidden_size"):
        DFlash2Config(**FIELDS, target_layer_ids=[1], target_num_layers=6, conv_group_size=7)


# -- against vLLM's own CPU functions -------------------------------------------------------------------------
def _vllm_reference(python: Path, cases: list[tuple[DFlash2Drafter, list[tuple[torch.Tensor, int]]]], target,
                    tmp: Path) -> list[list[dict]]:
    """The reference's outputs for each (drafter, blocks) case, all in one run of the engine's Python."""
    files = []
    for i, (drafter, blocks) in enumerate(cases):
        c = drafter.cfg
        cfg = dict(block=c.block_size, hidden=c.hidden_size, taps=c.conv_kernel_size, group=c.conv_group_size,
                   heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim, eps=c.rms_norm_eps,
                   theta=c.rope_theta, mask=c.mask_id, layers=c.num_layers, top_k=c.selector_top_k,
                   input_embedding_scale=c.input_embedding_scale, output_multiplier=c.output_multiplier,
                   final_logit_softcapping=c.final_logit_softcapping)
        weights = {n: p.detach().clone() for n, p in drafter.named_parameters() if p.requires_grad}
        torch.save({"cfg": cfg, "weights": weights, "embed": target.embed_tokens.weight.detach().clone(),
                    "head": target.lm_head.weight.detach().clone(),
                    "blocks": [{"features": f.clone(), "anchor_token": t} for f, t in blocks]}, tmp / f"in{i}.pt")
        files += [str(tmp / f"in{i}.pt"), str(tmp / f"out{i}.pt")]
    script = Path(__file__).with_name("vllm_dflash2_reference.py")
    proc = subprocess.run([str(python), str(script), *files], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(tmp / f"out{i}.pt", weights_only=True) for i in range(len(cases))]


CASES = [(4, 2, {}), (5, 3, {"input_embedding_scale": 1.5, "output_multiplier": 0.7, "final_logit_softcapping": 3.0})]


@pytest.mark.slow  # a start of the engine's Python (~9 s): make test, not test-fast
def test_drafting_equals_the_reference_built_from_vllms_cpu_functions(installed_engine_python, target, tmp_path):
    """For blocks of 4 with 2 taps, and of 5 with 3 taps and the scales: logits, candidates, selector scores and the
    walked tokens of several blocks equal the reference's (float64 there, float32 here: the tolerance is
    float32's); the selector changes at least one pick against the head's argmax in each case, so the walk is
    exercised, not the identity. Both cases run in one start of the engine's Python."""
    cases = []
    for block, taps, scales in CASES:
        d = _drafter(target, block=block, conv_kernel_size=taps, **scales)
        batch, feats, _ = _batch(target, d, packed=False, seed=5)
        doc = feats[2]  # the 17-token document
        tokens = batch.input_ids[2]
        cases.append((d, doc, [(doc[:a], int(tokens[a])) for a in (3, 8, 12, 15)]))
    refs_all = _vllm_reference(installed_engine_python, [(d, b) for d, _, b in cases], target, tmp_path)
    for (d, doc, blocks), refs in zip(cases, refs_all):
        block, differs = d.cfg.block_size, 0
        for (f, token), ref in zip(blocks, refs):
            a = f.shape[0]
            with torch.no_grad():
                ids = torch.tensor([token] + [d.cfg.mask_id] * (block - 1))
                logits = d.draft_logits(doc, a, ids)
                h = d.draft_hidden(doc, a, ids)[1:]
                cand, unary = d.candidates(h, h.shape[0])
                previous = torch.cat([torch.full((1, cand.shape[1]), token), cand[:-1]])
                scores = d.selector_scores(h, previous, cand, unary)
            want = ref["logits"].float()
            torch.testing.assert_close(logits, want, rtol=0, atol=rounding_atol(want, terms=HIDDEN, depth=8,
                                                                                dtype=torch.float32))
            top = ref["logits"][1:].topk(d.cfg.selector_top_k + 1, dim=-1).values  # the order is fp32-proof here:
            assert float((top[:, :-1] - top[:, 1:]).min()) > tie_atol(want, dtype=torch.float32)  # no near tie
            assert torch.equal(cand, ref["ids"])
            torch.testing.assert_close(scores, ref["scores"].float(), rtol=0,
                                       atol=rounding_atol(ref["scores"], terms=HIDDEN, depth=8, dtype=torch.float32))
            walked = ref["scores"].topk(2, dim=-1).values  # (S, K, 2): each row's best two, the walk's choices
            assert float((walked[..., 0] - walked[..., 1]).min()) > tie_atol(ref["scores"].float(),
                                                                              dtype=torch.float32)
            assert d.draft(doc, a, token) == ref["tokens"]
            differs += ref["tokens"] != logits[1:].argmax(-1).tolist()
        assert differs > 0, f"block {block}: the selector never changed a pick"


@pytest.mark.engine
def test_vllms_cpu_build_refuses_to_serve_a_dflash2_drafter_in_one_line(installed_engine_python, tmp_path):
    """The CPU build runs vLLM's V1 model runner (its V2 runner needs Triton, which has no CPU backend here), and V1
    refuses candidate-head drafts at start. When a build serves it, this test fails: then prove served tau equals
    ours as tests/test_engine.py does for dflash."""
    from dflash_lib.evaluate.engine_check import engine_check
    from dflash_lib.serve.connection import EngineError

    with pytest.raises(EngineError) as e:
        engine_check(str(installed_engine_python), new_tokens=8, log=tmp_path / "engine.log", kind="dflash2")
    message = str(e.value)
    assert "\n" not in message and "engine.log" in message
    assert "does not support: DFlash candidate-head drafts" in message


def test_muon_leaves_the_codebooks_and_the_convolution_bases_to_adamw(target):
    """The codebooks are lookup tables (rows gathered by token id, as an embedding's) and the bases 3-D: AdamW; the
    kernel projections and the selector's hidden projection are linear maps: Muon."""
    from dflash_lib.config import TrainConfig
    from dflash_lib.train.step import build_optimizer

    d = _drafter(target, perturbed=False)
    names = {id(p): n for n, p in d.named_parameters()}
    muon, adamw = build_optimizer([p for p in d.parameters() if p.requires_grad], TrainConfig(optimizer="muon"),
                                  torch.device("cpu"))
    in_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "layers.0.attention_conv.base_kernel"} <= in_adamw
    assert {"candidate_selector.hidden_projection.weight", "layers.1.mlp_conv.kernel_projection.weight"} <= in_muon


@pytest.mark.parametrize("loss", ["ce", "ce+kl"])
def test_the_candidates_from_the_losss_head_pass_equal_a_separate_top_k(target, loss):
    """Training takes the selector's candidates from the main loss's own chunked head pass (no second pass over the
    vocabulary): the same ids and logits as the head's top-k computed apart."""
    d = _drafter(target, loss=loss, ce_chunk_blocks=2)
    batch, feats, anchors = _batch(target, d, packed=False)
    layout = d.layout(batch, anchors)
    final = target.context_features_and_final(batch, layout.target_rows)[1] if loss != "ce" else None
    hidden = d.forward_hidden(batch, feats, layout)
    out = DFlashDrafter._objective(d, hidden, layout, None, final, top_k=d.cfg.selector_top_k)
    ids, unary = d.candidates(hidden.index_select(0, layout.scored), 2 * BLOCK)  # the loss's chunks: one GEMM path
    assert torch.equal(out.top[0], ids)
    torch.testing.assert_close(out.top[1], unary, rtol=0, atol=rounding_atol(unary, terms=HIDDEN))
    assert DFlashDrafter._objective(d, hidden, layout, None, final).top is None


def test_the_block_convolutions_gradient_passes_gradcheck():
    """`block_conv` is a custom autograd function (its backward rebuilds what it needs from the inputs): gradcheck
    in float64 over y, the deltas and the base, blocks of 3 (not a power of two), 3 taps."""
    g = torch.Generator().manual_seed(0)
    y, delta, base = (torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
                      for shape in ((9, 8), (9, 3, 2), (3, 8)))
    assert torch.autograd.gradcheck(lambda a, b, c: block_conv(a, b, c, 3), (y, delta, base))
