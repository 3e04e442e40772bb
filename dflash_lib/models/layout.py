"""What the drafter computes for one micro-batch, laid out on the HOST before the step.

`build_layout` turns a host batch and its anchors into a `DraftLayout` (the real blocks, their positions, the
scored positions and labels, the context as the batch's real tokens in row-major order, the `blocks` backend's runs
and the loss kl target rows), moved to the device once: the step then makes no device-to-host sync and runs
unchanged under `FakeTensorMode` (the dry run). Why: docs/scale.md, "The drafter's attention and the step on the
device"; the visibility rule: docs/dflash.md, "One training step"; no padding computed: docs/batching.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from dflash_lib.data.batch import Batch
from dflash_lib.models.anchors import Anchors

GROUP_BLOCK_SHARE = 4  # a run's own block keys stay within 1/4 of its mean context (<= ~25% extra work)
RUN_COST_PAIRS = 65536  # fixed cost of one more attention call (launch, concat, recompute), in query-key pairs


@dataclass(frozen=True)
class BlockGroups:
    """Runs of consecutive blocks of one document (host ints) for the `blocks` backend.

    Run g covers blocks first[g] .. first[g] + size[g] - 1 and the context entries ctx_start[g] ..
    ctx_start[g] + ctx_len[g] - 1 (its document's first context entry up to the largest anchor of the run, in the
    layout's context coordinates); its mask
    (size*B, ctx_len + size*B) is mask[offset[g]: offset[g + 1]] reshaped (True = attend).
    """

    first: tuple[int, ...]
    size: tuple[int, ...]
    ctx_start: tuple[int, ...]
    ctx_len: tuple[int, ...]
    offset: tuple[int, ...]  # (G + 1,) into `mask`
    mask: torch.Tensor  # (sum of mask sizes,) bool

    @property
    def count(self) -> int:
        return len(self.first)


@dataclass(frozen=True)
class DraftLayout:
    """One micro-batch's drafter work (shapes in the field comments; n blocks of B, m scored positions)."""

    block_ids: torch.Tensor  # (n, B) int64: drafter input tokens (anchor, then MASK or revealed tokens)
    block_pos: torch.Tensor  # (n, B) int64: document-local position of every query, anchor_i + k
    block_doc: torch.Tensor  # (n,) int64: batch document id of each block
    anchor_pos: torch.Tensor  # (n,) int64: document-local anchor position
    ctx_index: torch.Tensor | None  # (C,) int64: row-major slot r*T + t of each context entry; None = all R*T
    ctx_doc: torch.Tensor  # (C,) int64: document id of each context entry (-1 on padding, every-slot context only)
    ctx_pos: torch.Tensor  # (C,) int64: document-local position of each context entry
    scored: torch.Tensor  # (m,) int64: flat query index i*B + k of each scored position
    labels: torch.Tensor  # (m,) int64: the token at anchor + k
    weights: torch.Tensor  # (m,) float32: loss weight (decay x label valid x masked)
    scored_k: torch.Tensor  # (m,) int64: block position k (1..B-1) of each scored position
    previous: torch.Tensor  # (m,) int64: the token at anchor + k - 1 (the anchor's for k = 1): teacher forcing
    groups: BlockGroups | None  # runs for the `blocks` backend (None when another backend was asked for)
    block_size: int  # B
    noise: float  # fraction of block positions fed MASK
    weight_sum: float  # sum of `weights` (host float: the loss normaliser, known before any forward)
    target_rows: torch.Tensor | None = None  # (u,) int64, sorted unique: context entries (the target's sequence)
    # whose final hidden state predicts a scored label, i.e. position anchor + k - 1; None = not asked (loss ce)
    target_of: torch.Tensor | None = None  # (m,) int64: row of `target_rows` predicting each scored label

    @property
    def num_blocks(self) -> int:
        return int(self.block_ids.shape[0])

    @property
    def num_queries(self) -> int:
        """Drafter query tokens n * B."""
        return int(self.block_ids.numel())

    @property
    def num_context(self) -> int:
        """Context entries C: the batch's real tokens, or all R*T slots (every-slot context)."""
        return int(self.ctx_doc.shape[0])

    @property
    def num_scored(self) -> int:
        return int(self.scored.shape[0])

    def _map(self, fn) -> "DraftLayout":
        tensors = {f.name: fn(getattr(self, f.name)) for f in fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        groups = None if self.groups is None else replace(self.groups, mask=fn(self.groups.mask))
        return replace(self, groups=groups, **tensors)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "DraftLayout":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "DraftLayout":
        return self._map(lambda t: t.pin_memory())


def block_groups(anchor_pos: np.ndarray, block_doc: np.ndarray, doc_start: np.ndarray, block_size: int,
                 max_group: int = 0) -> BlockGroups:
    """Cut the blocks (sorted by document, then anchor) into runs for the `blocks` backend.

    anchor_pos, block_doc: (n,); doc_start: (D,) context entry of each document's first token. A run of G blocks
    computes, per query, about G*(B + s/2) keys beyond what it may see (its own run's blocks, and the gap to the
    run's last anchor; s = mean anchor spacing), and each run costs a call (RUN_COST_PAIRS). Per document:
      G = min(sqrt(RUN_COST_PAIRS / (B * (B + s/2))),        the run length that minimises extra work + calls,
              floor(mean anchor / (GROUP_BLOCK_SHARE * B)))   and keeps the extra keys within ~25% of the context;
    a document whose whole dense work (n*B queries x (context + n*B) keys) costs less than one call is one run.
    G is clamped to [1, n]; `max_group` > 0 caps it (tests).
    """
    B = block_size
    firsts, sizes, starts, lens, offsets, masks = [], [], [], [], [0], []
    n = len(anchor_pos)
    bounds = np.flatnonzero(np.diff(block_doc)) + 1
    for lo, hi in zip(np.concatenate([[0], bounds]), np.concatenate([bounds, [n]])):
        if hi <= lo:
            continue
        a = anchor_pos[lo:hi]
        m = hi - lo
        spacing = (float(a[-1]) - float(a[0])) / (m - 1) if m > 1 else 1.0
        if m * B * (int(a.max()) + m * B) <= RUN_COST_PAIRS:
            G = m
        else:
            best = math.sqrt(RUN_COST_PAIRS / (B * (B + spacing / 2)))
            G = max(1, min(m, int(best), int(a.mean() // (GROUP_BLOCK_SHARE * B))))
        if max_group > 0:
            G = min(G, max_group)
        for s in range(lo, hi, G):
            e = min(s + G, hi)
            ga = a[s - lo:e - lo]  # (g,)
            g, L = e - s, int(ga.max())
            ctx = np.arange(L)[None, :] < np.repeat(ga, B)[:, None]  # (g*B, L): strictly before the anchor
            own = (np.arange(g * B)[:, None] // B) == (np.arange(g * B)[None, :] // B)  # (g*B, g*B)
            masks.append(np.concatenate([ctx, own], axis=1).reshape(-1))
            firsts.append(int(s))
            sizes.append(int(g))
            starts.append(int(doc_start[block_doc[s]]))
            lens.append(L)
            offsets.append(offsets[-1] + masks[-1].size)
    mask = torch.from_numpy(np.concatenate(masks)) if masks else torch.zeros(0, dtype=torch.bool)
    return BlockGroups(tuple(firsts), tuple(sizes), tuple(starts), tuple(lens), tuple(offsets), mask)


def build_layout(batch: Batch, anchors: Anchors, attention: str = "blocks", max_group: int = 0,
                 every_slot: bool = False, target_rows: bool = False) -> DraftLayout:
    """The host-side layout of `batch` (host tensors) and its `anchors`; `attention` is the backend that will run
    (the `blocks` backend needs `groups`, the others do not). The context is the batch's real tokens, or with
    `every_slot` (static shapes: the target ran every slot too) all R*T slots. `target_rows`: also lay out where
    the target's next-token distributions of the scored labels come from (`DraftLayout.target_rows`)."""
    B = anchors.block_size
    doc_ids = batch.doc_ids.cpu()
    R, T = doc_ids.shape
    valid = anchors.valid.cpu().reshape(-1).numpy()  # (R*M,)
    take = np.flatnonzero(valid)  # real blocks, row-major = document order (anchors are laid out per document)
    pos = anchors.pos.cpu().reshape(-1).numpy()[take]  # (n,)
    doc = anchors.doc.cpu().reshape(-1).numpy()[take]  # (n,)
    if np.any(np.diff(doc) < 0):
        raise ValueError("anchors: blocks must be laid out document by document in row-major order")
    ids = anchors.block_ids.cpu().reshape(-1, B).numpy()[take]  # (n, B)
    labels = anchors.labels.cpu().reshape(-1, B).numpy()[take].reshape(-1)  # (n*B,)
    weights = anchors.weights.cpu().reshape(-1, B).numpy()[take].reshape(-1)  # (n*B,)
    scored = np.flatnonzero(weights > 0)  # (m,)
    flat_doc = doc_ids.reshape(-1).numpy()  # (R*T,)
    ctx_pos = batch.position_ids.cpu().reshape(-1).numpy()  # (R*T,)
    real = np.flatnonzero(flat_doc >= 0)  # (C,) the slots the target gathers (`masks.real_tokens`)
    ctx_index = None
    if not every_slot and real.size < flat_doc.size:
        ctx_index, ctx_doc, ctx_pos = real, flat_doc[real], ctx_pos[real]
    else:  # every slot: nothing left out (no padding, or fixed shapes asked for)
        ctx_doc = flat_doc
    groups = rows = row_of = None
    if attention == "blocks" or target_rows:
        D = int(ctx_doc.max()) + 1 if ctx_doc.size and ctx_doc.max() >= 0 else 0
        doc_start = np.full(D, -1, dtype=np.int64)
        present = np.flatnonzero(ctx_doc >= 0)
        first = np.unique(ctx_doc[present], return_index=True)
        doc_start[first[0]] = present[first[1]]  # in context coordinates (a document's entries are contiguous)
        if attention == "blocks":
            groups = block_groups(pos, doc, doc_start, B, max_group)
        if target_rows:  # label at anchor + k is predicted by the target's state at anchor + k - 1 (k >= 1)
            blk = scored // B
            predictor = doc_start[doc[blk]] + pos[blk] + scored % B - 1  # (m,) context entries
            rows, row_of = np.unique(predictor, return_inverse=True)
            rows, row_of = torch.from_numpy(rows.astype(np.int64)), torch.from_numpy(row_of.astype(np.int64))
    w = torch.from_numpy(np.ascontiguousarray(weights[scored], dtype=np.float32))
    return DraftLayout(
        block_ids=torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)),
        block_pos=torch.from_numpy((pos[:, None] + np.arange(B)[None, :]).astype(np.int64)),
        block_doc=torch.from_numpy(doc.astype(np.int64)), anchor_pos=torch.from_numpy(pos.astype(np.int64)),
        ctx_index=None if ctx_index is None else torch.from_numpy(ctx_index.astype(np.int64)),
        ctx_doc=torch.from_numpy(ctx_doc.astype(np.int64)), ctx_pos=torch.from_numpy(ctx_pos.astype(np.int64)),
        scored=torch.from_numpy(scored.astype(np.int64)),
        labels=torch.from_numpy(labels[scored].astype(np.int64)), weights=w,
        scored_k=torch.from_numpy((scored % B).astype(np.int64)),
        previous=torch.from_numpy(labels[scored - 1].astype(np.int64)), groups=groups, block_size=B,
        noise=anchors.noise, weight_sum=float(w.double().sum()), target_rows=rows, target_of=row_of,
    )


def attention_work(layout: DraftLayout, backend: str) -> dict[str, float]:
    """Query-key pairs per head: what the mask allows (`allowed`) and what `backend` computes (`computed`).
    allowed = sum over blocks of B * (anchor + B); dense computes n*B x (C + n*B); blocks sums its runs."""
    B, n = layout.block_size, layout.num_blocks
    allowed = float(B * (layout.anchor_pos.double() + B).sum())
    if backend == "dense":
        computed = float(n * B) * float(layout.num_context + n * B)
    elif backend == "blocks":
        g = layout.groups
        if g is None:
            raise ValueError("attention_work: this layout was built without block groups")
        computed = float(sum(s * B * (L + s * B) for s, L in zip(g.size, g.ctx_len)))
    else:
        raise ValueError(f"attention_work: unknown backend {backend!r}")
    return dict(allowed=allowed, computed=computed, ratio=computed / allowed if allowed else math.nan)
