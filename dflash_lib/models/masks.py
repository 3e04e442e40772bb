"""Document segments of a batch for the target's attention, built only from `doc_ids`.

The target never builds a mask, and never runs a padding slot: `real_tokens` says where a batch's real tokens sit,
so the target gathers them into one flattened sequence whose varlen segments are the documents (flash-attn's
cu_seqlens, or the [start, end) ranges of per-document SDPA), and scatters its feature layers back. (The drafter's
visibility rules live in `attention.py` and `layout.py`.)
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class RealTokens:
    """The sequence the target's layers run for a batch of R x T slots, and its documents (host tensors, made by
    `real_tokens`; the target copies them to its device). Gathered: the N slots with doc_ids >= 0 in row-major
    order, in which every document is contiguous. Not gathered (no padding, or fixed shapes asked for): every
    slot, the padding runs as segments of their own."""

    index: torch.Tensor | None  # (N,) int64 row-major slot of each gathered token; None = every slot runs
    cu_seqlens: torch.Tensor  # (S+1,) int32 segment boundaries over the sequence run (flash-attn varlen)
    segments: tuple[tuple[int, int], ...]  # [start, end) of each document over the sequence run (per-doc SDPA)
    longest: int  # tokens of the longest segment
    num_real: int  # N, the batch's real tokens
    slots: int  # R * T

    @property
    def runs_padding(self) -> bool:
        """True when padding slots go through the layers (fixed shapes): their outputs must be zeroed."""
        return self.index is None and self.num_real < self.slots


def real_tokens(doc_ids: torch.Tensor, gather: bool = True) -> RealTokens:
    """The `RealTokens` of a batch from its HOST doc_ids (R, T) (-1 = padding): one host pass, no device sync.
    Documents are the runs of equal doc_ids within a row (`segment_cu_seqlens`) that are not padding. `gather`
    False: every slot runs (fixed shapes), the padding runs as segments of their own, as flash-attn needs."""
    doc_ids = doc_ids.cpu()
    flat = doc_ids.reshape(-1)  # (R*T,)
    cu, longest = segment_cu_seqlens(doc_ids)
    starts, lens = cu[:-1].long(), (cu[1:] - cu[:-1]).long()  # (S,) every run, padding runs included
    real = flat[starts] >= 0  # (S,)
    num_real = int(lens[real].sum())
    if not gather or num_real == flat.numel():
        bounds = cu.tolist()
        segments = tuple((bounds[i], bounds[i + 1]) for i, keep in enumerate(real.tolist()) if keep)
        return RealTokens(None, cu, segments, longest, num_real, flat.numel())
    doc_cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens[real], 0)])  # (D+1,)
    bounds = doc_cu.tolist()
    index = torch.nonzero(flat >= 0).flatten()  # (N,)
    return RealTokens(index, doc_cu.to(torch.int32), tuple(zip(bounds[:-1], bounds[1:])),
                      int(lens[real].max()) if num_real else 0, num_real, flat.numel())
