"""The drafter's loss: LM head + cross-entropy in chunks, decay-weighted, normalised by a given weight sum.

Only scored positions (weight > 0) go through the LM head, a chunk of positions at a time. The head is frozen
(shared with the target), so the gradient of each position's CE with respect to its hidden state,
(softmax - onehot) @ W, is computed in the same pass as the CE and kept (n x H floats); the backward only scales
it. Neither pass ever holds more than one chunk of logits (chunk x vocab floats), and the LM head runs twice per
position (logits, gradient), not three times as under activation checkpointing (LOG.md, 2026-11-29).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


class _FusedHeadCE(torch.autograd.Function):
    """CE and argmax of a frozen linear head, with d ce / d hidden computed chunk by chunk in the forward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                chunk: int, need_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        ce = torch.empty(n, dtype=torch.float32, device=hidden.device)  # (n,)
        pred = torch.empty(n, dtype=torch.long, device=hidden.device)  # (n,)
        grad = torch.empty_like(hidden) if need_grad else None  # (n, H): d ce_i / d hidden_i
        for start in range(0, n, chunk):
            part = slice(start, start + chunk)
            y = labels[part]  # (c,)
            logits = F.linear(hidden[part], weight, bias).float()  # (c, V)
            pred[part] = logits.argmax(dim=-1)
            lse = torch.logsumexp(logits, dim=-1)  # (c,)
            ce[part] = lse - logits.gather(1, y.unsqueeze(1)).squeeze(1)
            if need_grad:
                probs = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place: (c, V)
                probs[torch.arange(len(y), device=y.device), y] -= 1.0
                grad[part] = (probs.to(weight.dtype) @ weight).to(grad.dtype)  # (c, H)
        ctx.save_for_backward(grad if need_grad else ce.new_empty(0))
        ctx.mark_non_differentiable(pred)
        return ce, pred

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor, grad_pred: torch.Tensor | None):
        (grad,) = ctx.saved_tensors
        return grad_ce.unsqueeze(1).to(grad.dtype) * grad, None, None, None, None, None


def head_cross_entropy(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor,
                       chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position CE (nats) and argmax of `head(hidden)`: hidden (n, H), labels (n,) -> ce (n,), pred (n,).

    chunk: positions per LM-head call (0 = all n at once). The head must be frozen: its weight gets no gradient
    (the gradient with respect to `hidden` is exact; see the module docstring).
    """
    if head.weight.requires_grad and torch.is_grad_enabled():
        raise ValueError("head_cross_entropy: the LM head must be frozen (requires_grad=False); it is shared with "
                         "the target and its weight gets no gradient here")
    n = hidden.shape[0]
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    return _FusedHeadCE.apply(hidden, head.weight, head.bias, labels, chunk if 0 < chunk < n else max(n, 1),
                              need_grad)


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
