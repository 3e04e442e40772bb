"""The drafter's loss: LM head + cross-entropy in chunks, decay-weighted, normalised by a given weight sum.

Only scored positions (weight > 0) go through the LM head, a chunk of positions at a time. The head is frozen
(shared with the target), so the gradient of each position's CE with respect to its hidden state,
(softmax - onehot) @ W, is computed in the same pass as the CE and kept (n x H floats); the backward only scales
it. Neither pass ever holds more than one chunk of logits (chunk x vocab floats), and the LM head runs twice per
position (logits, gradient), not three times as under activation checkpointing (LOG.md, 2026-11-29).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_lib.models.layout import DraftLayout


@dataclass
class DrafterLoss:
    """One micro-batch's loss and statistics. The statistics stay tensors on the device (no host sync in the
    step); the properties read them (one sync each), `stats()` stacks them for ONE transfer."""

    loss: torch.Tensor  # scalar, differentiable: sum(w * ce) / normalizer
    weight_sum: float  # sum of w over scored positions (host float, known from the layout)
    ce_total: torch.Tensor  # 0-d: sum of w * ce (nats)
    correct_total: torch.Tensor  # 0-d: sum of w over correct top-1 predictions
    pos_correct_t: torch.Tensor  # (B-1,) correct predictions per block position k = 1..B-1
    pos_count_t: torch.Tensor  # (B-1,) scored positions per block position
    tau_sum_t: torch.Tensor | None = None  # 0-d: sum over blocks of (1 + leading run of correct positions); None = 0
    tau_blocks_t: torch.Tensor | None = None  # 0-d: blocks in tau_sum_t; None = 0

    def stats(self) -> torch.Tensor:
        """(stats_size(B),) float64 on the device: ce_total, correct_total, pos_correct (B-1), pos_count (B-1),
        tau_sum, tau_blocks (appended last: the earlier offsets are unchanged)."""
        zero = torch.zeros(1, dtype=torch.float64, device=self.ce_total.device)
        tau = [zero if t is None else t.double().reshape(1) for t in (self.tau_sum_t, self.tau_blocks_t)]
        return torch.cat([self.ce_total.double().reshape(1), self.correct_total.double().reshape(1),
                          self.pos_correct_t.double(), self.pos_count_t.double(), *tau])

    @property
    def ce_sum(self) -> float:
        return float(self.ce_total)

    @property
    def correct_weight(self) -> float:
        return float(self.correct_total)

    @property
    def pos_correct(self) -> list[float]:
        return self.pos_correct_t.tolist()

    @property
    def pos_count(self) -> list[float]:
        return self.pos_count_t.tolist()

    @property
    def acc(self) -> float:
        """Weighted top-1 accuracy (nan with no scored position)."""
        return self.correct_weight / self.weight_sum if self.weight_sum > 0 else float("nan")

    @property
    def acc_per_pos(self) -> list[float]:
        """Unweighted top-1 accuracy at block positions k = 1..B-1 (nan where none was scored)."""
        return [c / n if n else float("nan") for c, n in zip(self.pos_correct, self.pos_count)]

    @property
    def eal(self) -> float:
        """The marginal-product ESTIMATE of the acceptance length (`expected_acceptance`; biased low)."""
        return expected_acceptance(self.acc_per_pos)

    eal_marginal = eal  # the same estimate under its labelled name

    @property
    def tau(self) -> float:
        """EXACT in-batch acceptance length: mean over blocks of 1 + the block's leading run of correct
        positions (`leading_run_stats`); nan with no block."""
        blocks = 0.0 if self.tau_blocks_t is None else float(self.tau_blocks_t)
        return float(self.tau_sum_t) / blocks if blocks > 0 else math.nan


def stats_size(block_size: int) -> int:
    """Length of `DrafterLoss.stats()` for blocks of `block_size`."""
    return 4 + 2 * (block_size - 1)


def leading_run_stats(correct: torch.Tensor, scored: torch.Tensor, num_blocks: int,
                      block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over blocks of 1 + leading run, number of blocks) as 0-d float tensors on the device, no sync.

    correct (m,) 0/1 flags of the scored positions, scored (m,) their flat query index i*B + k. A block's
    leading run counts its positions k = 1, 2, ... while each is scored AND correct: the first wrong or
    unscored position stops it (what greedy verification of that block would accept). Every block of the
    layout counts, so a block whose position 1 is unscored or wrong contributes 1.
    """
    B = block_size
    flags = torch.zeros(num_blocks * B, dtype=torch.float32, device=correct.device)  # (n*B,)
    flags = flags.index_copy(0, scored, correct.float())
    run = flags.view(num_blocks, B)[:, 1:].cumprod(dim=1).sum(dim=1)  # (n,) leading run of each block
    return (1.0 + run).sum(), torch.full((), float(num_blocks), device=correct.device)


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


def weighted_loss(hidden: torch.Tensor, head: torch.nn.Linear, layout: "DraftLayout", chunk_positions: int,
                  normalizer: float | None) -> DrafterLoss:
    """hidden (n*B, H) drafter outputs of the layout's queries -> `DrafterLoss`. Only the layout's m scored
    positions (host-known indices) go through the head; no device-to-host sync."""
    B = layout.block_size
    if normalizer is not None and not float(normalizer) > 0:
        raise ValueError(f"loss normalizer must be > 0, got {normalizer}")
    norm = layout.weight_sum if normalizer is None else float(normalizer)
    dev = hidden.device
    zeros = torch.zeros(B - 1, dtype=torch.float32, device=dev)
    if layout.num_scored == 0:  # nothing scored: a graph-connected zero keeps a distributed backward in step
        z = hidden.sum() * 0.0
        n = torch.full((), float(layout.num_blocks), device=dev)  # every block accepts its anchor only
        return DrafterLoss(z, 0.0, z.detach().float(), z.detach().float(), zeros, zeros.clone(), n, n.clone())
    h = hidden.index_select(0, layout.scored).to(head.weight.dtype)  # (m, H), in the head's dtype
    y, w = layout.labels, layout.weights.float()  # (m,)
    ce, pred = head_cross_entropy(h, head, y, chunk_positions)
    total = (w * ce).sum()
    with torch.no_grad():
        correct = (pred == y).float()  # (m,)
        k = layout.scored_k - 1  # (m,) 0-based block position of each scored slot
        pos_correct = zeros.index_add(0, k, correct)
        pos_count = zeros.index_add(0, k, torch.ones_like(correct))
        correct_total = (w * correct).sum()
        tau_sum, tau_blocks = leading_run_stats(correct, layout.scored, layout.num_blocks, B)
    return DrafterLoss(loss=total / norm, weight_sum=layout.weight_sum, ce_total=total.detach(),
                       correct_total=correct_total, pos_correct_t=pos_correct, pos_count_t=pos_count,
                       tau_sum_t=tau_sum, tau_blocks_t=tau_blocks)
