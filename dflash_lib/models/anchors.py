"""Anchor sampling: where the drafter's training blocks start, what they read and what they are scored on.

Draws are made per DOCUMENT in document order from an explicit `torch.Generator`, so a packed row and the
same documents padded one per row receive identical anchors, and a run is reproducible from its seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dflash_lib.data.batch import Batch

PAPER_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}  # docs/dflash.md: loss decay gamma per block size


def default_gamma(block_size: int) -> float:
    """The paper's gamma for B = 8, 10, 16; between them linear interpolation; below 8, B / 2 (which meets
    B = 8 at 4); above 16, the 10 -> 16 slope continued (7 + (B - 16) / 3)."""
    knots = sorted(PAPER_GAMMA.items())
    if block_size <= knots[0][0]:
        return block_size / 2.0
    if block_size >= knots[-1][0]:
        return knots[-1][1] + (block_size - knots[-1][0]) / 3.0
    return float(np.interp(block_size, [b for b, _ in knots], [g for _, g in knots]))


def decay_weights(block_size: int, gamma: float) -> torch.Tensor:
    """(B,) float32 w_k = exp(-(k-1)/gamma) for k >= 1; w_0 = 0 (the anchor itself is never scored)."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def position_weights(block_size: int, gamma: float, scheme: str = "decay") -> torch.Tensor:
    """(B,) float32 static weight of block positions: "decay" = `decay_weights`; "dpace" = 1 for k >= 1, 0 for
    the anchor (D-PACE replaces the decay by per-example weights made in the loss: `loss.dpace_weights`)."""
    if scheme == "decay":
        return decay_weights(block_size, gamma)
    if scheme == "dpace":
        w = torch.ones(block_size, dtype=torch.float32)
        w[0] = 0.0
        return w
    raise ValueError(f"position_weight must be 'decay' or 'dpace', got {scheme!r}")


@dataclass
class Anchors:
    """The M blocks of each of the R rows of one batch (M = most blocks in any row; the rest are padding).

    Position k of a block holds the token at anchor + k (no shift) and is scored against it.
    """

    slot: torch.Tensor  # (R, M) int64: row slot of the anchor token (0 on padding blocks)
    pos: torch.Tensor  # (R, M) int64: document-local position of the anchor (0 on padding blocks)
    doc: torch.Tensor  # (R, M) int64: document id (-1 on padding blocks)
    valid: torch.Tensor  # (R, M) bool: a real block
    block_ids: torch.Tensor  # (R, M, B) int64: drafter input: anchor token, then MASK (or a revealed token)
    labels: torch.Tensor  # (R, M, B) int64: token at anchor + k (0 where not scored)
    weights: torch.Tensor  # (R, M, B) float32: loss weight (decay x label valid x masked x block valid)
    block_size: int  # B, tokens per block including the anchor
    noise: float  # fraction of positions 1..B-1 fed as MASK (1.0 = all, the paper)

    @property
    def num_blocks(self) -> int:
        """Real blocks in the batch."""
        return int(self.valid.sum())

    def to(self, device: torch.device | str) -> "Anchors":
        move = lambda t: t.to(device)  # noqa: E731
        return Anchors(move(self.slot), move(self.pos), move(self.doc), move(self.valid), move(self.block_ids),
                       move(self.labels), move(self.weights), self.block_size, self.noise)


def document_spans(doc_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, first slot, length in tokens) of each document 0..D-1 of a batch, in document order.

    Refuses a batch whose document ids are not contiguous runs numbered 0..D-1 in row-major order."""
    R, T = doc_ids.shape
    flat = doc_ids.reshape(-1).cpu().numpy()
    real = np.flatnonzero(flat >= 0)
    if real.size == 0:
        return []
    ids = flat[real]
    breaks = np.flatnonzero((np.diff(ids) != 0) | (np.diff(real) != 1)) + 1
    starts, ends = np.concatenate([[0], breaks]), np.concatenate([breaks, [real.size]])
    order = ids[starts]
    if not np.array_equal(order, np.arange(len(order))):
        raise ValueError(f"batch doc_ids must be contiguous runs numbered 0..D-1 in row-major order, "
                         f"got the run order {order[:10].tolist()}")
    spans = []
    for s, e in zip(starts, ends):
        first = int(real[s])
        if first // T != int(real[e - 1]) // T:
            raise ValueError(f"document {int(ids[s])} spans two rows of the batch")
        spans.append((first // T, first % T, int(e - s)))
    return spans


def sample_anchors(batch: Batch, num_anchors: int, block_size: int, gamma: float, mask_id: int,
                   generator: torch.Generator, noise: float = 1.0, position_weight: str = "decay",
                   weighting: str = "token") -> Anchors:
    """Draw min(num_anchors, #valid) anchors per document uniformly without replacement, sorted.

    The weights' position factor is `position_weights(B, gamma, position_weight)` (decay, or 1 under D-PACE).
    weighting "document": each document's weights are then divided by their sum (every document with a scored
    position sums to 1: a loss normalised by the weight sum is the mean over documents of each one's own mean);
    "token": left as they are.

    Valid anchor a (document-local): loss_mask[a] and loss_mask[a + 1] set, a + 1 inside the document.
    noise < 1: in each block round(noise * (B-1)) (at least 1) of positions 1..B-1 are fed MASK, the others
    their real token and are not scored. Generator calls per document: randperm(#valid), then, only when
    noise < 1, rand(n, B-1).
    """
    if not 0.0 < noise <= 1.0:
        raise ValueError(f"noise must be in (0, 1], got {noise}")
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    if weighting not in ("token", "document"):
        raise ValueError(f"loss_weighting must be 'token' or 'document', got {weighting!r}")
    B = block_size
    n_masked = max(1, round(noise * (B - 1)))
    lm = batch.loss_mask.cpu().numpy().astype(bool)
    picks = []
    for row, first, length in document_spans(batch.doc_ids):
        mask = lm[row, first:first + length]
        cand = np.flatnonzero(mask[:-1] & mask[1:])  # a with a + 1 < length
        pick = torch.randperm(len(cand), generator=generator)[: min(num_anchors, len(cand))]
        a = np.sort(cand[pick.numpy()])  # (n,)
        masked = np.ones((len(a), B), dtype=bool)  # position k fed as MASK
        if noise < 1.0:
            rank = torch.rand((len(a), B - 1), generator=generator).argsort(dim=1).argsort(dim=1).numpy()
            masked[:, 1:] = rank < n_masked
        picks.append((a, masked))
    return _blocks_at(batch, picks, block_size, gamma, mask_id, noise, position_weight,
                      per_document=weighting == "document")


def decoding_anchors(batch: Batch, max_new_tokens: int, block_size: int, gamma: float, mask_id: int,
                     position_weight: str = "decay", stop_id: int | None = None) -> Anchors:
    """An anchor at every answer position where greedy speculative decoding of `max_new_tokens` tokens may start a
    cycle, every block fed MASK (what `evaluate.acceptance.acceptance_length` drafts from when a document's answer
    is the target's own). A document's answer is `answer_span`'s (cut after its first `stop_id`, the end of turn
    decoding stops at; nothing after it is scored); the prompt decoding starts from ends where it starts. A
    cycle's anchor is its pending output token, answer index j = 0 .. min(max_new_tokens, L) - 2 (a cycle runs
    while fewer than max_new_tokens tokens are out and the answer's last token is not). A document without an
    answer of 2 tokens, or without a prompt before it, gets no block."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ids = batch.input_ids.cpu().numpy()
    lm = batch.loss_mask.cpu().numpy().astype(bool)
    picks, ends = [], []
    for row, first, length in document_spans(batch.doc_ids):
        a = answer_span(lm[row, first:first + length], ids[row, first:first + length], stop_id)
        start, n = (a[0], min(max_new_tokens, a[1]) - 1) if a is not None and a[0] > 0 else (0, 0)
        at = start + np.arange(max(n, 0))  # (n,)
        picks.append((at, np.ones((len(at), block_size), dtype=bool)))
        ends.append(start + a[1] if a is not None else 0)
    return _blocks_at(batch, picks, block_size, gamma, mask_id, 1.0, position_weight, ends)


def answer_span(loss_mask: np.ndarray, tokens: np.ndarray | None = None,
                stop_id: int | None = None) -> tuple[int, int] | None:
    """(first position, length in tokens) of the first run of set entries of a document's loss mask (L,), the
    answer decoding produces after the prompt, cut after its first `stop_id` among `tokens` (L,) when given (a
    chat template's end of turn may be followed by a newline the loss mask also holds); None when none is set."""
    mask = np.asarray(loss_mask, dtype=bool)
    if not mask.any():
        return None
    first = int(np.argmax(mask))
    n = int(np.argmin(np.append(mask[first:], False)))
    if stop_id is not None and tokens is not None:
        stops = np.flatnonzero(np.asarray(tokens[first:first + n]) == stop_id)
        n = int(stops[0]) + 1 if len(stops) else n
    return first, n


def _blocks_at(batch: Batch, picks: list[tuple[np.ndarray, np.ndarray]], block_size: int, gamma: float,
               mask_id: int, noise: float, position_weight: str, ends: list[int] | None = None,
               per_document: bool = False) -> Anchors:
    """The Anchors of `picks`: per document (in document order) its sorted anchor positions a (n,) and which
    block positions are fed MASK (n, B) (position 0 never is). Labels are the tokens at a + k inside the
    document; weights the position factor x label inside the document and loss-masked x fed MASK x before the
    document's entry of `ends` (document-local; None: no such cut), divided by their sum per document when
    `per_document`."""
    B = block_size
    ids = batch.input_ids.cpu().numpy()
    lm = batch.loss_mask.cpu().numpy().astype(bool)
    R = ids.shape[0]
    decay = position_weights(B, gamma, position_weight).numpy()  # (B,)
    k = np.arange(B)
    per_row: list[list[tuple]] = [[] for _ in range(R)]
    for d, ((row, first, length), (a, masked)) in enumerate(zip(document_spans(batch.doc_ids), picks)):
        tok, mask = ids[row, first:first + length], lm[row, first:first + length]
        a = np.asarray(a, dtype=np.int64)
        n = len(a)
        masked = masked.copy()
        masked[:, 0] = False
        at = a[:, None] + k[None, :]  # (n, B) document-local positions of the block
        inside = at < length
        real = tok[np.minimum(at, length - 1)]  # (n, B)
        labels = np.where(inside, real, 0)
        weights = decay[None, :] * inside * mask[np.minimum(at, length - 1)] * masked
        if ends is not None:
            weights = weights * (at < ends[d])
        if per_document and weights.sum() > 0:
            weights = weights / weights.sum()
        block_ids = np.where(masked | ~inside, mask_id, real)
        block_ids[:, 0] = real[:, 0]
        per_row[row].append((first + a, a, np.full(n, d), block_ids, labels, weights))
    M = max([sum(len(p[0]) for p in blocks) for blocks in per_row] + [0])
    out = dict(slot=np.zeros((R, M), np.int64), pos=np.zeros((R, M), np.int64), doc=np.full((R, M), -1, np.int64),
               block_ids=np.full((R, M, B), mask_id, np.int64), labels=np.zeros((R, M, B), np.int64),
               weights=np.zeros((R, M, B), np.float32))
    for r, blocks in enumerate(per_row):
        if blocks:
            for name, value in zip(("slot", "pos", "doc", "block_ids", "labels", "weights"),
                                   (np.concatenate(col) for col in zip(*blocks))):
                out[name][r, : len(value)] = value
    t = {name: torch.from_numpy(v) for name, v in out.items()}
    device = batch.input_ids.device
    return Anchors(t["slot"], t["pos"], t["doc"], t["doc"] >= 0, t["block_ids"], t["labels"],
                   t["weights"], B, float(noise)).to(device)
