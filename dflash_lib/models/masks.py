"""Document segments of a batch for the target's attention, built only from `doc_ids`.

The target never builds a mask: its documents are varlen segments of one flattened sequence (`segment_cu_seqlens`
for flash-attn, `document_segments` for per-document SDPA). (The drafter's visibility rules live in
`attention.py` and `layout.py`.)
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
