"""The one batch layout every stage agrees on, and the two collators (pad, pack) that make it.

A batch is R rows of T token slots. Padded: one document per row, right-padded to the longest. Packed: one (or
more) rows of documents laid end to end, no padding except the row tail (under `pack_multiple` slots, or up to the
token budget with static shapes: `packed_row_len`). Both carry `doc_ids` (which document each slot belongs to, -1
for padding) and `position_ids` (restarting at 0 for each document), so a single mask builder and a single loss
serve both layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch


@dataclass
class Batch:
    input_ids: torch.Tensor  # (R, T) int64 token ids; padding slots hold `pad_id`
    loss_mask: torch.Tensor  # (R, T) bool: True on tokens the drafter is trained to predict (assistant)
    position_ids: torch.Tensor  # (R, T) int64: position inside its own document, 0-based
    doc_ids: torch.Tensor  # (R, T) int64: document index within the batch (0..D-1), -1 on padding
    cu_seqlens: torch.Tensor  # (D+1,) int32: cumulative document lengths over the row-major real tokens
    indices: list[int] = field(default_factory=list)  # sample indices in the store, one per document
    bucket: int = -1  # bucket id of a bucketed batch, -1 otherwise
    packed: bool = False  # True when documents share rows
    num_real: int = -1  # real tokens, counted once where the batch is made (host); -1 = count now

    def __post_init__(self) -> None:
        if self.num_real < 0:
            self.num_real = int((self.doc_ids >= 0).sum())

    @property
    def real_tokens(self) -> int:
        """Tokens that belong to a document (not padding); a host int (no device sync)."""
        return self.num_real

    @property
    def padded_tokens(self) -> int:
        """Token slots paid for: R * T."""
        return int(self.input_ids.numel())

    @property
    def max_doc_len(self) -> int:
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max()) if len(self.cu_seqlens) > 1 else 0

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Batch(move(self.input_ids), move(self.loss_mask), move(self.position_ids), move(self.doc_ids),
                     move(self.cu_seqlens), self.indices, self.bucket, self.packed, self.num_real)

    def pin_memory(self) -> "Batch":
        pin = lambda t: t.pin_memory()  # noqa: E731
        return Batch(pin(self.input_ids), pin(self.loss_mask), pin(self.position_ids), pin(self.doc_ids),
                     pin(self.cu_seqlens), self.indices, self.bucket, self.packed, self.num_real)


Sample = tuple[np.ndarray, np.ndarray]  # (tokens (L,) int, loss_mask (L,) bool/uint8)


def collate_padded(samples: Sequence[Sample], pad_id: int, indices: Sequence[int] = (), bucket: int = -1,
                   pad_to: int = 0) -> Batch:
    """One document per row, right-padded to the longest document (or to `pad_to` tokens if larger)."""
    if not samples:
        raise ValueError("collate_padded: empty batch")
    lens = np.array([len(t) for t, _ in samples], dtype=np.int64)
    R, T = len(samples), max(int(lens.max()), pad_to)
    ids = np.full((R, T), pad_id, dtype=np.int64)
    mask = np.zeros((R, T), dtype=bool)
    for r, (tok, lm) in enumerate(samples):
        ids[r, : len(tok)] = tok
        mask[r, : len(tok)] = lm
    slot = np.arange(T)[None, :]  # (1, T)
    real = slot < lens[:, None]  # (R, T)
    doc = np.where(real, np.arange(R)[:, None], -1)
    pos = np.where(real, slot, 0)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return Batch(torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(pos.astype(np.int64)),
                 torch.from_numpy(doc.astype(np.int64)), torch.from_numpy(cu), list(indices), bucket, False)


def packed_row_len(real: int, budget: int, multiple: int = 0) -> int:
    """Token slots of a packed row holding `real` tokens under a row budget of `budget` tokens: `real` rounded up
    to a multiple of `multiple`, at most `budget`; `multiple` 0 = exactly `budget` (static shapes)."""
    if multiple < 0:
        raise ValueError(f"packed_row_len: multiple must be >= 0, got {multiple}")
    if multiple == 0:
        return int(budget)
    return int(min(budget, -(-real // multiple) * multiple))


def collate_packed(samples: Sequence[Sample], pad_id: int, row_len: int, indices: Sequence[int] = (),
                   bucket: int = -1, multiple: int = 0) -> Batch:
    """Documents laid end to end in one row; the tail is padding. The row has `packed_row_len(tokens, row_len,
    multiple)` slots: its tokens rounded up to `multiple`, at most `row_len`; `multiple` 0 = exactly `row_len`.

    `row_len` is the token budget of a packed batch; documents must fit (the packer guarantees it).
    """
    if not samples:
        raise ValueError("collate_packed: empty batch")
    lens = np.array([len(t) for t, _ in samples], dtype=np.int64)
    total = int(lens.sum())
    if total > row_len:
        raise ValueError(f"collate_packed: {total} tokens do not fit a row of {row_len}")
    row_len = packed_row_len(total, row_len, multiple)
    ids = np.full((1, row_len), pad_id, dtype=np.int64)
    mask = np.zeros((1, row_len), dtype=bool)
    doc = np.full((1, row_len), -1, dtype=np.int64)
    pos = np.zeros((1, row_len), dtype=np.int64)
    start = 0
    for d, (tok, lm) in enumerate(samples):
        end = start + len(tok)
        ids[0, start:end] = tok
        mask[0, start:end] = lm
        doc[0, start:end] = d
        pos[0, start:end] = np.arange(len(tok))
        start = end
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return Batch(torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(pos), torch.from_numpy(doc),
                 torch.from_numpy(cu), list(indices), bucket, True)
