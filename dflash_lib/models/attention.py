"""The drafter's attention backends, `dense` (the reference), `blocks`, `flex` and `auto`: block queries over
[document context ; own block] for one micro-batch in the flat layout of `layout.py`, under the visibility rule of
docs/dflash.md ("One training step"; sliding and causal layers: "The drafter"). `make_attend` builds one layer
kind's attention (its window, its causality) once per micro-batch, its masks shared by every layer of the kind.

What each backend computes, where it runs and what it costs: docs/scale.md, "The drafter's attention and the step
on the device".
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash_lib.models.layout import DraftLayout

# attend(q (1, h, Q, d), kc, vc (1, kv, C, d), kb, vb (1, kv, Q, d)) -> (1, h, Q, d); GQA heads shared, never copied
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
BACKENDS = ("dense", "blocks", "flex")


def resolve_attention(name: str, device: torch.device | str) -> str:
    """`auto` -> flex on CUDA, blocks elsewhere; a named backend is returned as is (checked)."""
    if name == "auto":
        return "flex" if torch.device(device).type == "cuda" else "blocks"
    if name not in BACKENDS:
        raise ValueError(f"drafter_attention must be one of {['auto', *BACKENDS]}, got {name!r}")
    return name


def dense_mask(layout: DraftLayout) -> torch.Tensor:
    """(Q, C + Q) bool: the whole visibility of the micro-batch (True = attend), built on the layout's device."""
    B = layout.block_size
    Q = layout.num_queries
    blk = torch.arange(Q, device=layout.block_doc.device) // B  # (Q,) block of each query
    ctx = ((layout.ctx_doc.unsqueeze(0) == layout.block_doc[blk].unsqueeze(1))
           & (layout.ctx_pos.unsqueeze(0) < layout.anchor_pos[blk].unsqueeze(1)))  # (Q, C)
    return torch.cat([ctx, blk.unsqueeze(1) == blk.unsqueeze(0)], dim=1)


def position_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, causal: bool) -> torch.Tensor:
    """(Q, K) bool: query position q_pos[i] may see key position k_pos[j] under one layer's rule (positions:
    document-local ints; (Q,) and (K,)). `causal`: k <= q. `window` w > 0: q - w < k, and k < q + w when not
    causal (the engines' non-causal sliding window reaches both ways). Neither: every key."""
    d = q_pos.unsqueeze(1) - k_pos.unsqueeze(0)  # (Q, K) q - k
    seen = d >= 0 if causal else torch.ones_like(d, dtype=torch.bool)
    if window:
        seen = seen & (d < window) & (d > -window)  # d > -w is implied by d >= 0 when causal
    return seen


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def unmasked_attend(q, kc, vc, kb, vb) -> torch.Tensor:
    """Every query sees every context and block key: one block drafted over exactly its context (inference)."""
    return _sdpa(q, torch.cat([kc, kb], dim=2), torch.cat([vc, vb], dim=2), None)


def dense_attend(layout: DraftLayout, window: int = 0, causal: bool = False) -> Attend:
    mask = dense_mask(layout)  # built once, shared by every layer of the kind
    if window or causal:
        q_pos = layout.block_pos.reshape(-1)  # (Q,)
        mask = mask & position_mask(q_pos, torch.cat([layout.ctx_pos, q_pos]), window, causal)

    def attend(q, kc, vc, kb, vb):
        return _sdpa(q, torch.cat([kc, kb], dim=2), torch.cat([vc, vb], dim=2), mask)

    return attend


def _run_attention(q, kc, vc, kb, vb, mask) -> torch.Tensor:
    """One run of the blocks backend: its queries over [its context prefix ; its own blocks]."""
    return _sdpa(q, torch.cat([kc, kb], dim=2), torch.cat([vc, vb], dim=2), mask)


def blocks_attend(layout: DraftLayout, window: int = 0, causal: bool = False) -> Attend:
    g = layout.groups
    if g is None:
        raise ValueError("the blocks backend needs a layout built with attention='blocks' (block groups)")
    B = layout.block_size
    runs = []  # (query slice, context slice, mask) of each run, the masks built once for every layer of the kind
    q_pos = layout.block_pos.reshape(-1)  # (Q,)
    for i in range(g.count):
        qs = slice(g.first[i] * B, (g.first[i] + g.size[i]) * B)
        cs = slice(g.ctx_start[i], g.ctx_start[i] + g.ctx_len[i])
        mask = g.mask[g.offset[i]:g.offset[i + 1]].view(g.size[i] * B, g.ctx_len[i] + g.size[i] * B)
        if window or causal:
            mask = mask & position_mask(q_pos[qs], torch.cat([layout.ctx_pos[cs], q_pos[qs]]), window, causal)
        runs.append((qs, cs, mask))

    def attend(q, kc, vc, kb, vb):
        outs = []
        recompute = torch.is_grad_enabled() and any(t.requires_grad for t in (q, kc, vc, kb, vb))
        for qs, cs, mask in runs:
            args = (q[:, :, qs], kc[:, :, cs], vc[:, :, cs], kb[:, :, qs], vb[:, :, qs], mask)
            # Recomputed in the backward: only views of the layer's q/k/v are kept, never a run's own copy of
            # its context keys (runs overlap: kept, those copies would sum to several times the context).
            outs.append(checkpoint(_run_attention, *args, use_reentrant=False) if recompute
                        else _run_attention(*args))  # (1, h, G*B, d)
        return torch.cat(outs, dim=2) if outs else q.new_zeros(q.shape)

    return attend


def flex_block_mask(layout: DraftLayout, compile_mask: bool, window: int = 0, causal: bool = False):
    """FlexAttention BlockMask of the micro-batch over keys [C context entries ; Q block queries] (a sliding
    layer's with `window` w > 0, a causal layer's with `causal`: `position_mask`'s rule)."""
    from torch.nn.attention.flex_attention import create_block_mask  # only the flex backend needs it (heavy)

    B, n, Q = layout.block_size, layout.num_blocks, layout.num_queries
    C = int(layout.ctx_doc.shape[0])
    dev = layout.block_doc.device
    key_doc = torch.cat([layout.ctx_doc, torch.full((Q,), -2, dtype=torch.long, device=dev)])  # (C+Q,)
    q_pos = layout.block_pos.reshape(-1)  # (Q,)
    key_pos = torch.cat([layout.ctx_pos, q_pos])
    key_blk = torch.cat([torch.full((C,), -1, dtype=torch.long, device=dev),
                         torch.arange(Q, device=dev) // B])
    q_doc, q_anchor = layout.block_doc, layout.anchor_pos

    def mask_mod(b, h, qi, ki):
        blk = torch.clamp(qi // B, max=n - 1)  # create_block_mask pads Q and KV up to its tile: clamp
        kk = torch.clamp(ki, max=C + Q - 1)
        ctx = (key_doc[kk] == q_doc[blk]) & (key_pos[kk] < q_anchor[blk])
        seen = ctx | (key_blk[kk] == blk)
        d = q_pos[torch.clamp(qi, max=Q - 1)] - key_pos[kk]
        if causal:
            seen = seen & (d >= 0)
        if window:
            seen = seen & (d < window) & (d > -window)
        return seen

    return create_block_mask(mask_mod, None, None, Q, C + Q, device=dev, _compile=compile_mask)


_COMPILED_FLEX = None


def flex_attend(layout: DraftLayout, window: int = 0, causal: bool = False) -> Attend:
    from torch.nn.attention.flex_attention import flex_attention  # only the flex backend needs it (heavy)

    global _COMPILED_FLEX
    cuda = layout.block_doc.device.type == "cuda"
    block_mask = flex_block_mask(layout, compile_mask=cuda, window=window, causal=causal)
    fn = flex_attention
    if cuda:  # eager FlexAttention on CUDA is a slow reference; the compiled kernel is the real one
        if _COMPILED_FLEX is None:
            _COMPILED_FLEX = torch.compile(flex_attention, dynamic=True)
        fn = _COMPILED_FLEX

    def attend(q, kc, vc, kb, vb):
        # FlexAttention is not an autocast op and wants one dtype (q/k leave fp32 norms, v a bf16 matmul):
        # run it in the autocast dtype when autocast is on, else in the query's.
        dev = q.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else q.dtype
        k, v = torch.cat([kc, kb], dim=2).to(dtype), torch.cat([vc, vb], dim=2).to(dtype)
        return fn(q.to(dtype), k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])

    return attend


def make_attend(layout: DraftLayout, backend: str, window: int = 0, causal: bool = False) -> Attend:
    """The attention of every drafter layer of one kind for this micro-batch (masks built once here, not per
    layer): full layers (`window` 0) or sliding layers of `window` w positions, attending causally inside their
    block or not (`causal`; `position_mask`)."""
    if layout.num_blocks == 0:
        raise ValueError("make_attend: the layout has no block")
    if backend == "dense":
        return dense_attend(layout, window, causal)
    if backend == "blocks":
        return blocks_attend(layout, window, causal)
    if backend == "flex":
        return flex_attend(layout, window, causal)
    raise ValueError(f"unknown drafter attention backend {backend!r}; known: {list(BACKENDS)}")


def sdpa_flop_mapping() -> dict:
    """`FlopCounterMode(custom_mapping=...)` entries for SDPA's CPU flash kernel, which torch's counter leaves at
    0: torch's own formulas for its CUDA flash kernels, whose matmuls the CPU kernel runs too. Forward QK^T and PV,
    4*b*h*Sq*Sk*d FLOPs; backward 5 matmuls, 10*b*h*Sq*Sk*d: the scores QK^T recomputed from the saved logsumexp,
    then dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q (the math backend keeps P and pays 8). GQA: h = query
    heads, the kernel broadcasts K/V heads."""
    aten = torch.ops.aten

    def forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        b, h, sq, d = query_shape
        return 4 * b * h * sq * key_shape[-2] * d  # 2 matmuls of (Sq x d) by (d x Sk) per query head

    def backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return forward(query_shape, key_shape, value_shape) * 5 // 2  # 5 matmuls of the same size

    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}
