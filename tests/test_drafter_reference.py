"""The drafter's math against references we did not derive from its own code (issue 16).

Training and inference share `DraftLayer`, so "training forward == inference forward" cannot see a bug inside
the layer. Here the layer is checked against
- a Hugging Face Qwen3 decoder layer with the same weights, full (non-causal) attention over the block and HF's
  own rotary embedding, when the context is empty (RoPE, q/k norms, GQA, SwiGLU);
- the docs/dflash.md formula written out in float64 tensor ops, when a context is present (K/V of the UN-normed
  context through the same projections, RoPE at absolute context and block positions);
and the whole drafter (every attention backend, and the per-block inference path) is checked for what its
drafted logits may and may not depend on: the anchor token and the context strictly before the anchor, and
nothing at or after the anchor nor of another document.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

from dflash_lib.data.batch import collate_packed, collate_padded
from dflash_lib.models import DFlashDrafter
from dflash_lib.target.local import TargetModel
from dflash_lib.models.attention import unmasked_attend
from dflash_lib.models.layers import DraftLayer, Rotary
from dflash_lib.models.layout import build_layout
from tiny_models import BLOCK, MASK, VOCAB, tiny_drafter, tiny_target

# One layer: head_dim * heads (64) != hidden (32) and 2 query heads per KV head, so a transposed projection or
# a wrong head mapping changes shapes or numbers; theta 10_000 rotates every frequency pair noticeably.
H, HEADS, KV, D, INTER, EPS, THETA = 32, 4, 2, 16, 48, 1e-6, 10_000.0


def _random_layer(seed: int) -> DraftLayer:
    """A draft layer with non-trivial weights: linear std 1/sqrt(fan_in), norm weights around 1 (not ones)."""
    torch.manual_seed(seed)
    layer = DraftLayer(H, HEADS, KV, D, INTER, EPS)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)
    return layer.eval()


def _hf_layer(layer: DraftLayer) -> tuple[Qwen3DecoderLayer, Qwen3RotaryEmbedding]:
    cfg = Qwen3Config(vocab_size=16, hidden_size=H, intermediate_size=INTER, num_hidden_layers=1,
                      num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=D, rms_norm_eps=EPS,
                      rope_theta=THETA, attention_bias=False, attn_implementation="eager")
    assert cfg.rope_parameters["rope_theta"] == THETA and cfg.rope_parameters["rope_type"] == "default"
    hf = Qwen3DecoderLayer(cfg, layer_idx=0).eval()
    ours = layer.state_dict()
    assert set(ours) == set(hf.state_dict())  # same Hugging Face names, nothing left at HF's init
    hf.load_state_dict(ours, strict=True)
    return hf, Qwen3RotaryEmbedding(cfg)


def _hf_forward(hf, rotary, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x (Q, H) at `positions` (Q,); mask (Q, Q) additive -> (Q, H) through HF's layer and rotary embedding."""
    pos = positions.unsqueeze(0)  # (1, Q)
    out = hf(x.unsqueeze(0), attention_mask=mask[None, None], position_ids=pos,
             position_embeddings=rotary(x.unsqueeze(0), pos))
    out = out[0] if isinstance(out, tuple) else out
    return out[0]


def test_empty_context_layer_equals_huggingface_qwen3_layer_with_full_attention():
    layer = _random_layer(0)
    hf, hf_rotary = _hf_layer(layer)
    B, anchor = 6, 37
    torch.manual_seed(1)
    x = torch.randn(B, H)  # (Q, H)
    block_pos = torch.arange(anchor, anchor + B)
    rotary = Rotary(D, THETA)
    ctx, ctx_pos = torch.zeros(0, H), torch.zeros(0, dtype=torch.long)
    with torch.no_grad():
        ours = layer(x, ctx, rotary(block_pos, torch.float32), rotary(ctx_pos, torch.float32), unmasked_attend)
        full = _hf_forward(hf, hf_rotary, x, block_pos, torch.zeros(B, B))
        causal = _hf_forward(hf, hf_rotary, x, block_pos,
                             torch.full((B, B), float("-inf")).triu(1))
    assert ours.shape == full.shape == (B, H)
    assert float((ours - full).abs().max()) < 1e-5
    assert float((ours - x).abs().max()) > 0.1  # the layer did something
    # The comparison can tell the attention pattern apart: a causal HF layer differs except on the last query.
    assert float((ours[:-1] - causal[:-1]).abs().max()) > 1e-2


def _reference_layer(layer: DraftLayer, x: torch.Tensor, ctx: torch.Tensor, ctx_pos: torch.Tensor,
                     block_pos: torch.Tensor) -> torch.Tensor:
    """docs/dflash.md's draft layer in float64 tensor ops, every query seeing every key. x (Q, H), ctx (C, H)."""
    W = {n: p.detach().double() for n, p in layer.named_parameters()}
    x, ctx = x.double(), ctx.double()
    Q, C = x.shape[0], ctx.shape[0]

    def rms(t, w):
        return w * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + EPS)

    def rope(t, pos):  # t (N, heads, D): pair (i, i + D/2) rotated by pos * theta^(-2i/D)
        ang = pos.double()[:, None, None] * THETA ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (N,1,D/2)
        a, b = t[..., : D // 2], t[..., D // 2:]
        return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], dim=-1)

    pre = "self_attn."
    h = rms(x, W["input_layernorm.weight"])  # (Q, H): the block is normed, the context is not
    q = rope(rms((h @ W[pre + "q_proj.weight"].T).view(Q, HEADS, D), W[pre + "q_norm.weight"]), block_pos)
    kv_in = torch.cat([ctx, h])  # (C + Q, H)
    kv_pos = torch.cat([ctx_pos, block_pos])
    k = rope(rms((kv_in @ W[pre + "k_proj.weight"].T).view(C + Q, KV, D), W[pre + "k_norm.weight"]), kv_pos)
    v = (kv_in @ W[pre + "v_proj.weight"].T).view(C + Q, KV, D)
    heads = []
    for head in range(HEADS):
        g = head // (HEADS // KV)  # the KV head this query head shares
        scores = q[:, head] @ k[:, g].T / math.sqrt(D)  # (Q, C + Q)
        p = scores.exp() / scores.exp().sum(-1, keepdim=True)
        heads.append(p @ v[:, g])  # (Q, D)
    x = x + torch.cat(heads, dim=-1) @ W[pre + "o_proj.weight"].T
    m = rms(x, W["post_attention_layernorm.weight"])
    gate, up = m @ W["mlp.gate_proj.weight"].T, m @ W["mlp.up_proj.weight"].T
    return x + (gate * torch.sigmoid(gate) * up) @ W["mlp.down_proj.weight"].T


@pytest.mark.parametrize("anchor", [7, 12])  # the block right after its context, and after a gap
def test_context_layer_equals_the_written_out_formula(anchor):
    layer = _random_layer(2)
    C, B = 7, 4
    torch.manual_seed(3)
    ctx = 3.0 * torch.randn(C, H)  # far from unit RMS: normalising it by mistake would show
    x = torch.randn(B, H)
    ctx_pos, block_pos = torch.arange(C), torch.arange(anchor, anchor + B)
    rotary = Rotary(D, THETA)
    with torch.no_grad():
        ours = layer(x, ctx, rotary(block_pos, torch.float32), rotary(ctx_pos, torch.float32), unmasked_attend)
    ref = _reference_layer(layer, x, ctx, ctx_pos, block_pos)
    assert ours.shape == ref.shape == (B, H)
    assert float((ours.double() - ref).abs().max()) < 1e-5
    # The context matters to the answer (the check is not blind to the context path).
    no_ctx = _reference_layer(layer, x, ctx[:0], ctx_pos[:0], block_pos)
    assert float((no_ctx - ref).abs().max()) > 1e-2


# -- sensitivity of the whole drafter ------------------------------------------------------------------------
BS = BLOCK
LENGTHS = [9, 14, 11]  # the chosen block lives in document 1, between two others
DOC, ANCHOR = 1, 6


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return tiny_target()


@pytest.fixture(scope="module")
def drafter(target) -> DFlashDrafter:
    return tiny_drafter(target)


def _batch(packed: bool):
    rng = np.random.default_rng(4)
    docs = [(rng.integers(0, VOCAB - 1, n), np.arange(n) >= 1) for n in LENGTHS]
    if packed:
        return collate_packed(docs, 0, row_len=sum(LENGTHS) + 3)
    return collate_padded(docs, 0)


def _slot(batch, doc: int, pos: int) -> tuple[int, int]:
    hit = ((batch.doc_ids == doc) & (batch.position_ids == pos)).nonzero()
    assert hit.shape[0] == 1, (doc, pos)
    return int(hit[0, 0]), int(hit[0, 1])


def _perturbed(feats: torch.Tensor, slots, seed: int) -> torch.Tensor:
    out = feats.clone()
    g = torch.Generator().manual_seed(seed)
    for r, t in slots:
        out[r, t] += 2.0 * torch.randn(feats.shape[-1], generator=g)
    return out


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


# flex (eager on CPU, ~0.3 s a call) runs the packed batch only: there the documents share a row, so (d) is the
# harder case; flex on padded rows is held to dense by tests/test_attention.py.
@pytest.mark.parametrize("backend, packed", [("dense", False), ("dense", True), ("blocks", False),
                                             ("blocks", True), ("flex", True)])
def test_training_logits_depend_on_the_anchor_and_the_context_before_it_only(target, drafter, backend, packed):
    batch = _batch(packed)
    layout = build_layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(0)), "blocks")
    chosen = [i for i in range(layout.num_blocks)
              if int(layout.block_doc[i]) == DOC and int(layout.anchor_pos[i]) == ANCHOR]
    assert len(chosen) == 1
    i = chosen[0]
    others = [j for j in range(layout.num_blocks) if j != i]
    feats = target.features(batch)
    drafter.attention = backend
    try:
        def logits(f, lay=layout):
            with torch.no_grad():
                return drafter.block_logits(batch, f, lay)  # (n, B, V)

        base = logits(feats)
        assert base.shape == (layout.num_blocks, BS, VOCAB)
        # (a) the anchor token: block i changes, every other block stays exactly as it was
        ids = layout.block_ids.clone()
        ids[i, 0] = (ids[i, 0] + 17) % (VOCAB - 1)
        moved = logits(feats, dataclasses.replace(layout, block_ids=ids))
        assert _max_diff(moved[i], base[i]) > 1e-4
        assert _max_diff(moved[others], base[others]) < 1e-6
        # (b) a feature strictly before the anchor, in its own document: the first and the last such position
        for p in (0, ANCHOR - 1):
            got = logits(_perturbed(feats, [_slot(batch, DOC, p)], seed=p))
            assert _max_diff(got[i], base[i]) > 1e-4, p
        # (c) every feature at or after the anchor at once (the anchor's own slot, the block's span, beyond)
        got = logits(_perturbed(feats, [_slot(batch, DOC, p) for p in range(ANCHOR, LENGTHS[DOC])], seed=7))
        assert _max_diff(got[i], base[i]) < 1e-6
        # (d) every feature of the other documents at once
        other_slots = [_slot(batch, d, p) for d in range(len(LENGTHS)) if d != DOC for p in range(LENGTHS[d])]
        got = logits(_perturbed(feats, other_slots, seed=99))
        assert _max_diff(got[i], base[i]) < 1e-6
        moved_other = [j for j in others if int(layout.block_doc[j]) != DOC]
        assert _max_diff(got[moved_other], base[moved_other]) > 1e-4  # those features did reach their blocks
    finally:
        drafter.attention = "dense"


def test_inference_logits_depend_on_the_anchor_and_the_context_before_it_only(target, drafter):
    batch = _batch(packed=False)
    feats = target.features(batch)[DOC, : LENGTHS[DOC]]  # (T_doc, F*H): document 1's row, no padding
    ids = torch.full((BS,), MASK, dtype=torch.long)
    ids[0] = int(batch.input_ids[DOC, ANCHOR])

    def logits(f, block_ids=ids):
        with torch.no_grad():
            return drafter.draft_logits(f, ANCHOR, block_ids)  # (B, V)

    base = logits(feats)
    assert base.shape == (BS, VOCAB)
    other = ids.clone()
    other[0] = (other[0] + 17) % (VOCAB - 1)
    assert _max_diff(logits(feats, other), base) > 1e-4  # (a)
    for p in (0, ANCHOR - 1):  # (b)
        f = feats.clone()
        f[p] += 2.0 * torch.randn(f.shape[-1], generator=torch.Generator().manual_seed(p))
        assert _max_diff(logits(f), base) > 1e-4, p
    f = feats.clone()  # (c) every feature at or after the anchor at once
    f[ANCHOR:] += 2.0 * torch.randn(f[ANCHOR:].shape, generator=torch.Generator().manual_seed(7))
    assert _max_diff(logits(f), base) < 1e-6
