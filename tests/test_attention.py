"""Drafter attention backends (dense, blocks, flex) against each other and against per-block inference.

The per-block inference forward (`draft_logits`) slices the context to exactly positions 0..anchor-1 and uses
no mask at all: an independent statement of the `<` rule that every training backend is checked against."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from dflash_lib.data.batch import collate_packed, collate_padded
from dflash_lib.models import DFlashDrafter, DrafterConfig, tiny_qwen3_config
from dflash_lib.target.local import TargetModel
from dflash_lib.models.attention import dense_mask, position_mask, resolve_attention, sdpa_flop_mapping
from dflash_lib.models.layout import attention_work, block_groups, build_layout
from tiny_models import BLOCK, HIDDEN, MASK, VOCAB, tiny_drafter, tiny_target

H, B = HIDDEN, BLOCK


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return tiny_target()


@pytest.fixture(scope="module")
def drafter(target) -> DFlashDrafter:
    return tiny_drafter(target, ce_chunk_blocks=2)


def _docs(lengths, seed=0, prompt=1):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, VOCAB - 1, n), np.arange(n) >= min(prompt, n - 2)) for n in lengths]


def _batch(docs, packed):
    return collate_packed(docs, 0, row_len=sum(len(t) for t, _ in docs) + 5) if packed else collate_padded(docs, 0)


def _run(drafter, backend, batch, feats, layout, grad=False):
    drafter.attention = backend
    try:
        if not grad:
            with torch.no_grad():
                return drafter.block_logits(batch, feats, layout)
        drafter.zero_grad(set_to_none=True)
        out = drafter.loss(batch, feats, layout)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()}
    finally:
        drafter.attention = "dense"


def _per_block_reference(drafter, batch, feats, layout):
    refs = []
    flat_doc = batch.doc_ids.reshape(-1)
    flat_feats = feats.reshape(-1, feats.shape[-1])
    with torch.no_grad():
        for i in range(layout.num_blocks):
            doc_feats = flat_feats[flat_doc == layout.block_doc[i]]
            refs.append(drafter.draft_logits(doc_feats, int(layout.anchor_pos[i]), layout.block_ids[i]))
    return torch.stack(refs)  # (n, B, V)


# Documents shorter than a block (3 < B... and 2 tokens: one anchor whose block runs past the end), anchors at
# the very end of a document (num_anchors 64 takes every valid anchor), a long one.
LENGTHS = [14, 3, 9, 2, 23]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("backend", ["dense", "blocks", "flex"])
def test_every_backend_equals_per_block_inference(target, drafter, backend, packed):
    docs = _docs(LENGTHS, seed=3)
    batch = _batch(docs, packed)
    layout = build_layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(1)), "blocks")
    last = [len(t) - 2 for t, _ in docs]  # the last valid anchor of every document
    assert all(any(int(layout.anchor_pos[i]) == a and int(layout.block_doc[i]) == d for i in range(layout.num_blocks))
               for d, a in enumerate(last))
    feats = target.features(batch)
    got = _run(drafter, backend, batch, feats, layout)
    ref = _per_block_reference(drafter, batch, feats, layout)
    assert got.shape == ref.shape == (layout.num_blocks, B, VOCAB)
    assert float((got - ref).abs().max()) < 1e-5


@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(st.integers(2, 30), min_size=1, max_size=5), seed=st.integers(0, 10**6),
       num_anchors=st.integers(1, 12), packed=st.booleans(), max_group=st.integers(0, 3))
def test_backends_equal_dense_on_random_anchors(target, drafter, lengths, seed, num_anchors, packed, max_group):
    docs = _docs(lengths, seed=seed)
    batch = _batch(docs, packed)
    drafter.cfg.num_anchors = num_anchors
    try:
        anchors = drafter.sample_anchors(batch, torch.Generator().manual_seed(seed))
    finally:
        drafter.cfg.num_anchors = 64
    layout = build_layout(batch, anchors, "blocks", max_group=max_group)
    if layout.num_blocks == 0:
        return
    feats = target.features(batch)
    dense = _run(drafter, "dense", batch, feats, layout)
    for backend in ("blocks", "flex"):
        assert float((_run(drafter, backend, batch, feats, layout) - dense).abs().max()) < 1e-5, backend


@pytest.mark.parametrize("packed", [False, True])
def test_blocks_gradients_equal_dense(target, drafter, packed):
    docs = _docs(LENGTHS, seed=5)
    batch = _batch(docs, packed)
    layout = build_layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(2)), "blocks",
                          max_group=2)
    feats = target.features(batch)
    loss_d, grads_d = _run(drafter, "dense", batch, feats, layout, grad=True)
    loss_b, grads_b = _run(drafter, "blocks", batch, feats, layout, grad=True)
    assert abs(float(loss_d - loss_b)) < 1e-6
    for name, g in grads_d.items():
        torch.testing.assert_close(grads_b[name], g, atol=1e-6, rtol=1e-5, msg=name)
    drafter.zero_grad(set_to_none=True)


def _leaky(layout):
    """The public `<=` bug: a block also sees the context slot of its own anchor (positions < anchor + 1)."""
    shifted = layout.anchor_pos + 1
    doc_start = {int(d): int(np.flatnonzero(layout.ctx_doc.numpy() == d)[0]) for d in layout.block_doc.unique()}
    starts = np.array([doc_start.get(d, 0) for d in range(int(layout.block_doc.max()) + 1)])
    groups = block_groups(shifted.numpy(), layout.block_doc.numpy(), starts, layout.block_size)
    return dataclasses.replace(layout, anchor_pos=shifted, groups=groups)


@pytest.mark.parametrize("backend", ["dense", "blocks", "flex"])
def test_the_leaky_mask_mutant_fails_the_inference_check(target, drafter, backend):
    docs = _docs([14, 9, 17], seed=3)
    batch = _batch(docs, packed=True)
    layout = build_layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(1)), "blocks")
    feats = target.features(batch)
    ref = _per_block_reference(drafter, batch, feats, layout)
    assert float((_run(drafter, backend, batch, feats, layout) - ref).abs().max()) < 1e-5
    assert float((_run(drafter, backend, batch, feats, _leaky(layout)) - ref).abs().max()) > 1e-3


def test_dense_mask_element_by_element():
    docs = [(np.arange(5), np.array([0, 1, 1, 1, 1], bool)), (np.arange(4), np.array([0, 1, 1, 1], bool))]
    batch = collate_packed(docs, 0, row_len=11)
    cfg_anchors = dict(num_anchors=9, block_size=2, gamma=1.0, mask_id=99)
    from dflash_lib.models.anchors import sample_anchors
    anchors = sample_anchors(batch, generator=torch.Generator().manual_seed(0), **cfg_anchors)
    doc, pos = batch.doc_ids[0], batch.position_ids[0]
    for every_slot, C in ((False, 9), (True, 11)):  # the 9 real tokens, or all 11 slots (static shapes)
        layout = build_layout(batch, anchors, every_slot=every_slot)
        m = dense_mask(layout)
        Q = layout.num_queries
        assert m.shape == (Q, C + Q) and layout.num_context == C
        slot = list(range(C)) if layout.ctx_index is None else layout.ctx_index.tolist()
        for q in range(Q):
            i = q // 2
            for key in range(C + Q):
                if key < C:  # context: same document, position STRICTLY before the anchor; padding never
                    s = slot[key]
                    want = int(doc[s]) == int(layout.block_doc[i]) and int(pos[s]) < int(layout.anchor_pos[i])
                else:  # its own block, both directions
                    want = (key - C) // 2 == i
                assert bool(m[q, key]) == want, (every_slot, q, key)


def test_attention_uses_grouped_kv_heads_without_copies(target, drafter):
    """GQA through SDPA's enable_gqa: no repeat_interleave / expand+reshape copy of K or V."""
    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    docs = _docs([14, 9], seed=1)
    batch = _batch(docs, packed=False)
    layout = build_layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(0)), "blocks")
    feats = target.features(batch)
    for backend in ("dense", "blocks"):
        with Ops() as ops:
            _run(drafter, backend, batch, feats, layout, grad=True)
        assert not any("repeat_interleave" in n for n in ops.names), backend
    drafter.zero_grad(set_to_none=True)


def test_blocks_attention_work_is_close_to_what_the_mask_allows(target):
    """Counted with torch's FLOP counter: blocks stays within 1.5x of the allowed work at the paper's anchor
    density; dense pays for the whole (Q, C + Q) grid."""
    n_tok, Bp = 600, 16
    tokens = np.arange(n_tok) % (VOCAB - 1)
    docs = [(tokens, np.arange(n_tok) >= 40)]
    batch = collate_padded(docs, 0)
    from dflash_lib.models.anchors import sample_anchors
    anchors = sample_anchors(batch, 100, Bp, 7.0, MASK, torch.Generator().manual_seed(0))
    layout = build_layout(batch, anchors, "blocks")
    cfg = DrafterConfig(hidden_size=H, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                        vocab_size=VOCAB, target_layer_ids=target.layer_ids, target_num_layers=target.num_layers,
                        block_size=Bp, mask_id=MASK, num_anchors=100)
    d = DFlashDrafter(cfg, target)
    feats = target.features(batch)
    flops = {}
    for backend in ("dense", "blocks"):
        d.attention = backend
        with FlopCounterMode(display=False, custom_mapping=sdpa_flop_mapping()) as fc:
            d.loss(batch, feats, layout).loss.backward()
        counts = fc.get_flop_counts()["Global"]
        flops[backend] = sum(v for k, v in counts.items() if "scaled_dot_product" in str(k))
    per_pair = 2 * 4 * 8 * (2 + 5)  # FLOPs per (query, key) pair: 2 * heads * head_dim a matmul, 2 fwd + 5 bwd
    work = attention_work(layout, "blocks")
    # blocks recomputes each run's forward in the backward (memory): 9 matmuls instead of 7
    assert flops["blocks"] == pytest.approx(work["computed"] * per_pair * 9 / 7)
    assert flops["dense"] == pytest.approx(attention_work(layout, "dense")["computed"] * per_pair)
    assert work["ratio"] <= 1.5
    assert flops["blocks"] <= 0.6 * flops["dense"]  # this short document; the paper's 3072 tokens: benchmarks/


def _sdpa_flops(backend: SDPBackend, mapping: dict, kv_heads: int = 4) -> tuple[int, int]:
    """(forward, backward) FLOPs FlopCounterMode counts for one SDPA call on CPU: 4 query heads of 8, 5 queries,
    7 keys (batch 2), run by `backend`."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 7, 8, generator=gen, requires_grad=True) for _ in range(2))
    with sdpa_kernel(backend):
        with FlopCounterMode(display=False, custom_mapping=mapping) as fwd:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=kv_heads < 4)
        with FlopCounterMode(display=False, custom_mapping=mapping) as bwd:
            out.sum().backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


def test_sdpa_flop_mapping_counts_what_torch_counts():
    """SDPA's CPU flash kernel: torch counts nothing; the mapping counts torch's own formulas for its flash
    kernels, which is the math backend's matmuls plus the backward's recompute of the scores."""
    unit = 2 * 2 * 4 * 5 * 7 * 8  # 2 * b * h * Sq * Sk * d FLOPs: one (Sq x d) by (d x Sk) matmul per head
    assert _sdpa_flops(SDPBackend.FLASH_ATTENTION, {}) == (0, 0)
    flash = _sdpa_flops(SDPBackend.FLASH_ATTENTION, sdpa_flop_mapping())
    assert flash == (2 * unit, 5 * unit)
    aten, q, kv = torch.ops.aten, (2, 4, 5, 8), (2, 4, 7, 8)
    assert flash == (flop_registry[aten._scaled_dot_product_flash_attention](q, kv, kv),
                     flop_registry[aten._scaled_dot_product_flash_attention_backward](q, q, kv, kv))
    math_fwd, math_bwd = _sdpa_flops(SDPBackend.MATH, {})  # QK^T, PV; then dV, dP, dQ, dK from the kept P
    assert flash == (math_fwd, math_bwd + unit)
    assert _sdpa_flops(SDPBackend.FLASH_ATTENTION, sdpa_flop_mapping(), kv_heads=2) == flash  # GQA: per query head


def test_auto_backend_and_unknown_names():
    assert resolve_attention("auto", "cpu") == "blocks" and resolve_attention("auto", "cuda") == "flex"
    assert resolve_attention("dense", "cpu") == "dense"
    with pytest.raises(ValueError, match="drafter_attention"):
        resolve_attention("sparse", "cpu")


def test_activation_checkpointing_gives_the_same_gradients(target, drafter):
    docs = _docs(LENGTHS, seed=8)
    batch = _batch(docs, packed=True)
    layout = build_layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(4)), "blocks")
    feats = target.features(batch)
    results = []
    for ckpt in (0, drafter.cfg.num_layers):  # layers recomputed in the backward: none, all
        drafter.checkpointing = ckpt
        results.append(_run(drafter, "blocks", batch, feats, layout, grad=True))
    drafter.checkpointing = 0
    (loss0, g0), (loss1, g1) = results
    assert float(loss0) == float(loss1)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-7, rtol=1e-6, msg=name)
    drafter.zero_grad(set_to_none=True)


def test_bf16_target_with_fp32_drafter_trains_under_autocast_and_drafts_without(drafter):
    """The CUDA recipe's dtypes on CPU: a bf16 target (features and LM head in bf16), fp32 master weights,
    bf16 autocast for the training step; drafting (no autocast on CPU) feeds the bf16 head from fp32 states."""
    hf = tiny_qwen3_config(hidden_size=H, num_layers=6, vocab_size=VOCAB)
    t32 = TargetModel.from_hf_config(hf, 2, seed=0)
    t16 = TargetModel.from_hf_config(hf, 2, seed=0, dtype=torch.bfloat16)
    cfg = drafter.cfg
    torch.manual_seed(0)
    d32 = DFlashDrafter(cfg, t32, attention="blocks")
    d16 = DFlashDrafter(cfg, t16, attention="blocks")
    d16.load_state_dict(d32.state_dict())
    docs = _docs([20, 11], seed=9)
    batch = _batch(docs, packed=False)
    layout = build_layout(batch, d32.sample_anchors(batch, torch.Generator().manual_seed(0)), "blocks")
    f32, f16 = t32.features(batch), t16.features(batch)
    assert f16.dtype == torch.bfloat16 and d16.fc.weight.dtype == torch.float32
    ref = d32.loss(batch, f32, layout)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = d16.loss(batch, f16, layout)
    out.loss.backward()
    assert torch.isfinite(out.loss) and abs(out.loss.item() - ref.loss.item()) < 0.02 * ref.loss.item()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
               for p in d16.parameters() if p.requires_grad)
    with torch.no_grad():
        logits = d16.draft_logits(f16[0, :20], 9, layout.block_ids[0])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_flex_training_on_cpu_is_refused_before_any_work(tmp_path):
    from dflash_lib.config import ConfigError, from_params, preset
    from dflash_lib.train.build import build_parts

    config = from_params(dict(drafter_attention="flex", limit=20), preset("smoke"))
    with pytest.raises(ConfigError, match="flex' trains only on CUDA"):
        build_parts(config, torch.device("cpu"))


@pytest.mark.parametrize("n_tok, anchors, Bp, max_ratio, max_runs", [
    (3072, 512, 16, 1.5, 64),  # the paper's shape: work close to what the mask allows
    (600, 100, 16, 1.5, 30),
    (30, 64, 4, 10.0, 1),  # a tiny document: one call beats many (its whole dense work is below one call's cost)
])
def test_block_runs_balance_work_and_calls(n_tok, anchors, Bp, max_ratio, max_runs):
    docs = [(np.arange(n_tok) % (VOCAB - 1), np.arange(n_tok) >= min(100, n_tok // 4))]
    batch = collate_padded(docs, 0)
    from dflash_lib.models.anchors import sample_anchors
    layout = build_layout(batch, sample_anchors(batch, anchors, Bp, 7.0, MASK, torch.Generator().manual_seed(0)))
    work = attention_work(layout, "blocks")
    assert work["ratio"] <= max_ratio and 1 <= layout.groups.count <= max_runs
    assert attention_work(layout, "dense")["computed"] >= work["computed"]


def test_flex_runs_under_bf16_autocast_with_mixed_input_dtypes(target, drafter):
    """Under autocast q/k leave the fp32 norms while v comes from a bf16 matmul: flex gets one dtype."""
    docs = _docs([14, 9], seed=2)
    batch = _batch(docs, packed=True)
    layout = build_layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(0)), "blocks")
    feats = target.features(batch)
    out = {}
    for backend in ("blocks", "flex"):
        drafter.attention = backend
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out[backend] = drafter.block_logits(batch, feats, layout).float()
    drafter.attention = "dense"
    assert torch.isfinite(out["flex"]).all()
    assert float((out["flex"] - out["blocks"]).abs().max()) < 0.05 * float(out["blocks"].abs().max())


# -- sliding drafter layers (vLLM's DFlash rule: causal in the block, the window over positions) ------------------

SLIDING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5)  # a window shorter than
# the documents, so it bites on the context; longer than a block (4), so the block part is causal only


@pytest.fixture(scope="module")
def sliding(target) -> DFlashDrafter:
    return tiny_drafter(target, ce_chunk_blocks=2, **SLIDING)


def test_a_sliding_query_sees_exactly_its_window_by_brute_force(target, sliding):
    """The inference forward of one block, sliding layer by layer, equals attending key by key to the set the
    rule names, each query alone: context positions p - w < j < anchor and block positions anchor .. p."""
    from dflash_lib.models.layers import apply_rotary

    docs = _docs([17], seed=5)
    feats = target.features(collate_padded(docs, 0))[0]  # (17, F*H)
    anchor, w = 11, SLIDING["sliding_window"]
    ids = torch.tensor([int(docs[0][0][anchor])] + [MASK] * (B - 1))
    layer = sliding.layers[0]
    attn = layer.self_attn
    with torch.no_grad():
        ctx = sliding.fuse(feats[:anchor])  # (a, H)
        x = layer.input_layernorm(sliding._embed(ids))  # (B, H)
        pos_q, pos_c = anchor + torch.arange(B), torch.arange(anchor)
        mask = position_mask(pos_q, torch.cat([pos_c, pos_q]), w, True)  # what every backend and the decoder use

        def masked(q, kc, vc, kb, vb):
            return F.scaled_dot_product_attention(q, torch.cat([kc, kb], 2), torch.cat([vc, vb], 2), attn_mask=mask,
                                                  enable_gqa=True)

        got = attn(x, ctx, sliding.rotary(pos_q, torch.float32), sliding.rotary(pos_c, torch.float32), masked)
        q = attn.q_norm(attn.q_proj(x).view(B, 4, 8)).transpose(0, 1).unsqueeze(0)
        q = apply_rotary(q, *sliding.rotary(pos_q, torch.float32))
        kc, vc = attn._kv(ctx, sliding.rotary(pos_c, torch.float32))
        kb, vb = attn._kv(x, sliding.rotary(pos_q, torch.float32))
        k, v = torch.cat([kc, kb], 2), torch.cat([vc, vb], 2)  # (1, 2, a + B, 8)
        keys = torch.cat([pos_c, pos_q])
        rows = []
        for i in range(B):  # one query at a time over exactly the keys it may see
            p = anchor + i
            seen = [j for j in range(anchor + B) if p - w < int(keys[j]) <= p]
            assert seen == [j for j in range(anchor + B) if (j < anchor and j > p - w) or anchor <= j <= p]
            o = F.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, seen], v[:, :, seen],
                                               enable_gqa=True)  # (1, 4, 1, 8)
            rows.append(o[0, :, 0].reshape(-1))
        want = attn.o_proj(torch.stack(rows))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("backend", ["dense", "blocks", "flex"])
def test_every_backend_with_sliding_layers_equals_per_block_inference(target, sliding, backend, packed):
    docs = _docs(LENGTHS, seed=3)
    batch = _batch(docs, packed)
    layout = build_layout(batch, sliding.sample_anchors(batch, torch.Generator().manual_seed(1)), "blocks")
    feats = target.features(batch)
    got = _run(sliding, backend, batch, feats, layout)
    ref = _per_block_reference(sliding, batch, feats, layout)
    assert float((got - ref).abs().max()) < 1e-5
    full = tiny_drafter(target, ce_chunk_blocks=2)  # the same weights, every layer full: the window bites
    assert float((_run(full, backend, batch, feats, layout) - got).abs().max()) > 1e-3


def test_sliding_gradients_equal_dense_and_the_cached_decoder_equals_one_forward(target, sliding):
    docs = _docs(LENGTHS, seed=4)
    batch = _batch(docs, True)
    layout = build_layout(batch, sliding.sample_anchors(batch, torch.Generator().manual_seed(2)), "blocks")
    feats = target.features(batch)
    loss_d, grads_d = _run(sliding, "dense", batch, feats, layout, grad=True)
    loss_b, grads_b = _run(sliding, "blocks", batch, feats, layout, grad=True)
    assert float(abs(loss_d - loss_b)) < 1e-5
    assert all(float((grads_d[n] - grads_b[n]).abs().max()) < 1e-5 for n in grads_d)
    doc_feats = target.features(collate_padded(docs[4:], 0))[0]  # (23, F*H)
    cache = sliding.context_cache()
    sliding.extend_context(cache, doc_feats[:15])
    ids = torch.tensor([int(docs[4][0][15])] + [MASK] * (B - 1))
    with torch.no_grad():
        torch.testing.assert_close(sliding.draft_logits_cached(cache, ids), sliding.draft_logits(doc_feats, 15, ids),
                                   atol=1e-5, rtol=0)
