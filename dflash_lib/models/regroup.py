"""A document-major view of a batch for the drafter: one row per document, whatever the batch layout.

A block only ever sees its own document (context before its anchor, plus itself), so the drafter can run on
rows that each hold one document's context slots and that document's blocks. For a padded batch this is the
batch itself; for a packed row it turns attention over the whole row (row tokens x row blocks) into attention
over each document (document tokens x document blocks), with exactly the same visible keys, so the same
math. The mask is still built by `drafter_attention_mask` from (doc id, position), on the regrouped rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_lib.models.anchors import Anchors, document_spans


@dataclass
class DocumentView:
    """Gather indices from a batch (R rows of T slots, M blocks per row) to D document rows."""

    ctx_index: torch.Tensor  # (D, L) int64: flat slot index r*T + t of each context slot (0 on padding)
    ctx_doc: torch.Tensor  # (D, L) int64: document id, -1 on padding
    ctx_pos: torch.Tensor  # (D, L) int64: document-local position (0 on padding)
    block_index: torch.Tensor  # (D, N) int64: flat block index r*M + j of each block (0 on padding)
    block_valid: torch.Tensor  # (D, N) bool: a real block of this document


def document_view(doc_ids: torch.Tensor, anchors: Anchors) -> DocumentView:
    """doc_ids (R, T) of the batch and its anchors -> gather indices of the D document rows."""
    R, T = doc_ids.shape
    dev = doc_ids.device
    spans = document_spans(doc_ids)
    D = len(spans)
    L = max((n for _, _, n in spans), default=1)
    start = torch.tensor([r * T + first for r, first, _ in spans], dtype=torch.long, device=dev).reshape(D, 1)
    length = torch.tensor([n for _, _, n in spans], dtype=torch.long, device=dev).reshape(D, 1)
    t = torch.arange(L, device=dev).unsqueeze(0)  # (1, L)
    real = t < length  # (D, L)
    docs = torch.arange(D, device=dev).unsqueeze(1)  # (D, 1)
    ctx_index = torch.where(real, start + t, 0)
    ctx_doc = torch.where(real, docs, -1)
    ctx_pos = torch.where(real, t, 0)
    # Blocks in row-major order are grouped by document (anchors are laid out document by document).
    flat_doc = torch.where(anchors.valid, anchors.doc, -1).reshape(-1)  # (R*M,)
    valid_flat = torch.nonzero(flat_doc >= 0).flatten()  # (V,)
    owner = flat_doc[valid_flat]  # (V,)
    if bool((owner[1:] < owner[:-1]).any()):
        raise ValueError("anchors: blocks must be laid out document by document in row-major order")
    counts = torch.bincount(owner, minlength=D)  # (D,)
    N = int(counts.max()) if valid_flat.numel() else 1
    first_of_doc = torch.cumsum(counts, 0) - counts  # (D,)
    rank = torch.arange(valid_flat.numel(), device=dev) - first_of_doc[owner]  # (V,) block rank inside its doc
    block_index = torch.zeros(D, N, dtype=torch.long, device=dev)
    block_valid = torch.zeros(D, N, dtype=torch.bool, device=dev)
    block_index[owner, rank] = valid_flat
    block_valid[owner, rank] = True
    return DocumentView(ctx_index, ctx_doc, ctx_pos, block_index, block_valid)
