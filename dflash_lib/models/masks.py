"""Attention masks for both layouts (padded rows, packed rows), built only from `doc_ids` and `position_ids`.

The target never builds a mask: its documents are varlen segments of one flattened sequence (`segment_cu_seqlens`
for flash-attn, `document_segments` for per-document SDPA). The drafter's mask is boolean, True = the query may
attend to the key; because every rule is phrased in terms of (document, document-local position), one builder
serves padded and packed batches alike.
"""

from __future__ import annotations

import torch


def segment_cu_seqlens(doc_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Varlen boundaries over the row-major flattened slots: every run of equal `doc_ids` (a document, or a
    padding run) is one causal segment. Returns (cu_seqlens (S+1,) int32, longest segment in tokens)."""
    flat = doc_ids.reshape(-1)  # (R*T,)
    R, T = doc_ids.shape
    change = torch.ones_like(flat, dtype=torch.bool)
    change[1:] = flat[1:] != flat[:-1]
    change[::T] = True  # a new row always starts a new segment
    starts = torch.nonzero(change).flatten()
    cu = torch.cat([starts, torch.tensor([flat.numel()], device=flat.device)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def document_segments(doc_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) slot ranges of the documents over the row-major flattened slots (padding runs left out),
    in order. One host sync: call once per forward, not per layer."""
    cu, _ = segment_cu_seqlens(doc_ids)
    starts = cu[:-1].long()
    real = (doc_ids.reshape(-1)[starts] >= 0).tolist()
    bounds = cu.tolist()
    return [(bounds[i], bounds[i + 1]) for i, keep in enumerate(real) if keep]


def drafter_attention_mask(doc_ids: torch.Tensor, position_ids: torch.Tensor, anchor_doc: torch.Tensor,
                           anchor_pos: torch.Tensor, anchor_valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mask of the drafter's queries (the M blocks of B tokens of each row) over keys [T context | M*B block].

    A query of block j (document d_j, anchor position a_j) sees the context slots of document d_j whose
    document-local position is STRICTLY below a_j (the anchor token itself enters as the block's first
    token), and every token of block j (bidirectional). Invalid (padding) blocks see nothing; the attention
    guards the resulting all-False rows.

    doc_ids, position_ids: (R, T); anchor_doc, anchor_pos, anchor_valid: (R, M). Returns (R, M*B, T + M*B).
    """
    R, M = anchor_doc.shape
    B = block_size
    ctx = ((doc_ids.unsqueeze(1) == anchor_doc.unsqueeze(2))
           & (position_ids.unsqueeze(1) < anchor_pos.unsqueeze(2))
           & anchor_valid.unsqueeze(2))  # (R, M, T)
    ctx = ctx.repeat_interleave(B, dim=1)  # (R, M*B, T)
    block_of = torch.arange(M * B, device=doc_ids.device) // B  # (M*B,)
    own_block = block_of.unsqueeze(1) == block_of.unsqueeze(0)  # (M*B, M*B)
    blk = own_block.unsqueeze(0) & anchor_valid.repeat_interleave(B, dim=1).unsqueeze(2)  # (R, M*B, M*B)
    return torch.cat([ctx, blk], dim=2)
