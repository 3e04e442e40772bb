"""The drafter's loss: LM head + cross-entropy in chunks, decay-weighted, normalised by a given weight sum.

Only scored positions (weight > 0) go through the LM head. With more than one chunk each chunk runs under
activation checkpointing, so neither the forward nor the backward ever holds more than one chunk of logits
(chunk x vocab floats).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class DrafterLoss:
    """One batch's loss and statistics; `loss` is the only tensor, the rest are Python floats."""

    loss: torch.Tensor  # scalar, differentiable: sum(w * ce) / normalizer
    weight_sum: float  # sum of w over scored positions of this batch
    ce_sum: float  # sum of w * ce (nats) over this batch
    acc: float  # weighted top-1 accuracy: correct_weight / weight_sum (nan with no scored position)
    acc_per_pos: list[float]  # (B-1) unweighted top-1 accuracy at block positions k = 1..B-1 (nan if none)
    eal: float  # expected acceptance length 1 + sum_k prod_{i<=k} acc_i (nan positions count as 0)
    correct_weight: float  # sum of w over correct top-1 predictions (for globally normalised accuracy)
    pos_correct: list[float]  # (B-1) correct predictions per block position (to aggregate acc_per_pos)
    pos_count: list[float]  # (B-1) scored positions per block position


def expected_acceptance(acc_per_pos: list[float]) -> float:
    """EAL = 1 + sum_k prod_{i<=k} acc_i over k = 1..B-1; an unmeasured position (nan) counts as 0."""
    eal, run = 1.0, 1.0
    for a in acc_per_pos:
        run *= 0.0 if a != a else a
        eal += run
    return eal


def _head_ce(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden, weight, bias).float()  # (n, V)
    return F.cross_entropy(logits, labels, reduction="none"), logits.argmax(dim=-1)


def head_cross_entropy(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor,
                       chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position CE (nats) and argmax of `head(hidden)`: hidden (n, H), labels (n,) -> ce (n,), pred (n,).

    chunk: positions per LM-head call; 0 or >= n = a single plain call (logits for all n kept for backward).
    """
    n = hidden.shape[0]
    if chunk <= 0 or chunk >= n:
        return _head_ce(hidden, head.weight, head.bias, labels)
    ces, preds = [], []
    for start in range(0, n, chunk):
        part = slice(start, start + chunk)
        ce, pred = checkpoint(_head_ce, hidden[part], head.weight, head.bias, labels[part], use_reentrant=False)
        ces.append(ce)
        preds.append(pred)
    return torch.cat(ces), torch.cat(preds)


def weighted_loss(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, weights: torch.Tensor,
                  block_size: int, chunk_positions: int, normalizer: float | None) -> DrafterLoss:
    """hidden (R, M*B, H) drafter outputs; labels, weights (R, M, B). See `DrafterLoss`."""
    B = block_size
    w = weights.reshape(-1).to(hidden.device)  # (R*M*B,)
    scored = torch.nonzero(w > 0).flatten()  # (n,)
    h = hidden.reshape(-1, hidden.shape[-1])[scored]  # (n, H)
    y = labels.reshape(-1).to(hidden.device)[scored]  # (n,)
    ws = w[scored].float()  # (n,)
    ce, pred = head_cross_entropy(h, head, y, chunk_positions)
    total = (ws * ce).sum()
    weight_sum = float(ws.sum())
    norm = weight_sum if normalizer is None else float(normalizer)
    if normalizer is not None and not norm > 0:
        raise ValueError(f"loss normalizer must be > 0, got {normalizer}")
    # An empty batch still returns a graph-connected zero so a distributed backward stays in step.
    loss = total / norm if norm > 0 else hidden.sum() * 0.0
    with torch.no_grad():
        correct = (pred == y).float()  # (n,)
        k = (scored % B).long()  # block position of each scored slot
        pos_correct = torch.bincount(k, weights=correct, minlength=B)[1:].tolist()
        pos_count = torch.bincount(k, minlength=B)[1:].float().tolist()
        correct_weight = float((ws * correct).sum())
    acc_per_pos = [c / n if n else float("nan") for c, n in zip(pos_correct, pos_count)]
    return DrafterLoss(
        loss=loss, weight_sum=weight_sum, ce_sum=float(total.detach()),
        acc=correct_weight / weight_sum if weight_sum > 0 else float("nan"),
        acc_per_pos=acc_per_pos, eal=expected_acceptance(acc_per_pos), correct_weight=correct_weight,
        pos_correct=pos_correct, pos_count=pos_count,
    )
