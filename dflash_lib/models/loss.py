"""The drafter's loss: LM head + cross-entropy in chunks, decay-weighted, normalised by a given weight sum.

Only scored positions go through the frozen head, a chunk at a time, with the gradient of each position's term
computed in the same pass and kept, so the backward only scales it. Loss kl / ce+kl runs the same head on the
target's final hidden states beside the drafter's logits; D-PACE (`dpace_weights`) reweights positions by the
drafter's confidence. All of it: docs/dflash.md, "One training step" (Loss) and "Losses beyond the paper: the
target's distribution, and D-PACE weights".
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import torch
import torch.nn.functional as F

from dflash_lib.config import reads_final_states
from dflash_lib.models.layout import DraftLayout


class LinearHead(NamedTuple):
    """A frozen head as weights (what the loss reads of an nn.Linear): a draft vocabulary's rows."""

    weight: torch.Tensor  # (N, H)
    bias: torch.Tensor | None


@dataclass
class DrafterLoss:
    """One micro-batch's loss and statistics. The statistics stay tensors on the device (no host sync in the
    step); the properties read them (one sync each), `stats()` stacks them for ONE transfer."""

    loss: torch.Tensor  # scalar, differentiable: sum(w * term) / normalizer (term = ce, or the kl objective)
    weight_sum: float  # sum of w over scored positions (host float, known from the layout)
    ce_total: torch.Tensor  # 0-d: sum of w * term (nats; term = ce, or a*ce + b*T^2*KL_T under loss kl / ce+kl)
    correct_total: torch.Tensor  # 0-d: sum of w over correct top-1 predictions
    pos_correct_t: torch.Tensor  # (B-1,) correct predictions per block position k = 1..B-1
    pos_count_t: torch.Tensor  # (B-1,) scored positions per block position
    tau_sum_t: torch.Tensor | None = None  # 0-d: sum over blocks of (1 + leading run of correct positions); None = 0
    tau_blocks_t: torch.Tensor | None = None  # 0-d: blocks in tau_sum_t; None = 0
    block_runs_t: torch.Tensor | None = None  # (n,) each block's leading run of correct positions, layout order
    # (`leading_runs`): what the held-out evaluation walks decoding's cycles over; None = not computed
    top: tuple[torch.Tensor, torch.Tensor] | None = None  # (m, k) ids and float logits of each scored position's
    # top-k head rows from the loss's own head pass (`weighted_loss(top_k=k)`: dflash2's candidates); None = not asked

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

    @property
    def tau(self) -> float:
        """EXACT in-batch acceptance length: mean over blocks of 1 + the block's leading run of correct
        positions (`leading_run_stats`); nan with no block."""
        blocks = 0.0 if self.tau_blocks_t is None else float(self.tau_blocks_t)
        return float(self.tau_sum_t) / blocks if blocks > 0 else math.nan


def stats_size(block_size: int) -> int:
    """Length of `DrafterLoss.stats()` for blocks of `block_size`."""
    return 4 + 2 * (block_size - 1)


def leading_runs(correct: torch.Tensor, scored: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """(n,) float32 on the device, no sync: each block's leading run of correct positions, 0 .. B-1.

    correct (m,) 0/1 flags of the scored positions, scored (m,) their flat query index i*B + k. A block's
    leading run counts its positions k = 1, 2, ... while each is scored AND correct: the first wrong or
    unscored position stops it (what greedy verification of that block would accept)."""
    B = block_size
    flags = torch.zeros(num_blocks * B, dtype=torch.float32, device=correct.device)  # (n*B,)
    flags = flags.index_copy(0, scored, correct.float())
    return flags.view(num_blocks, B)[:, 1:].cumprod(dim=1).sum(dim=1)  # (n,)


def leading_run_stats(correct: torch.Tensor, scored: torch.Tensor, num_blocks: int,
                      block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over blocks of 1 + leading run, number of blocks) as 0-d float tensors on the device, no sync
    (`leading_runs`). Every block of the layout counts, so a block whose position 1 is unscored or wrong
    contributes 1."""
    run = leading_runs(correct, scored, num_blocks, block_size)  # (n,)
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
                chunk: int, need_grad: bool, top_k: int) -> tuple[torch.Tensor, ...]:
        n = hidden.shape[0]
        ce = torch.empty(n, dtype=torch.float32, device=hidden.device)  # (n,)
        pred = torch.empty(n, dtype=torch.long, device=hidden.device)  # (n,)
        top_ids, top_vals = _top_buffers(n, top_k, hidden.device, torch.float32)  # (n, k) each
        grad = torch.empty_like(hidden) if need_grad else None  # (n, H): d ce_i / d hidden_i
        for start in range(0, n, chunk):
            part = slice(start, start + chunk)
            y = labels[part]  # (c,)
            logits = F.linear(hidden[part], weight, bias).float()  # (c, V)
            pred[part] = logits.argmax(dim=-1)
            if top_k:
                top_vals[part], top_ids[part] = logits.topk(top_k, dim=-1)
            lse = torch.logsumexp(logits, dim=-1)  # (c,)
            ce[part] = lse - logits.gather(1, y.unsqueeze(1)).squeeze(1)
            if need_grad:
                probs = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place: (c, V)
                probs[torch.arange(len(y), device=y.device), y] -= 1.0
                grad[part] = (probs.to(weight.dtype) @ weight).to(grad.dtype)  # (c, H)
        ctx.save_for_backward(grad if need_grad else ce.new_empty(0))
        ctx.mark_non_differentiable(pred, top_ids, top_vals)
        return ce, pred, top_ids, top_vals

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor, *unused):
        (grad,) = ctx.saved_tensors
        return grad_ce.unsqueeze(1).to(grad.dtype) * grad, None, None, None, None, None, None


def _top_buffers(n: int, k: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, k) int64 ids and (n, k) values a head's chunk loop fills with each row's top-k logits (k 0: empty)."""
    return (torch.empty(n, k, dtype=torch.long, device=device), torch.empty(n, k, dtype=dtype, device=device))


def head_cross_entropy(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor,
                       chunk: int, top_k: int = 0) -> tuple[torch.Tensor, ...]:
    """Per-position CE (nats) and argmax of `head(hidden)`: hidden (n, H), labels (n,) -> ce (n,), pred (n,), and
    with `top_k` > 0 also each row's top-k logits' ids and values (n, top_k), best first (from the same pass).

    chunk: positions per LM-head call (0 = all n at once). The head must be frozen: its weight gets no gradient
    (the gradient with respect to `hidden` is exact; see the module docstring).
    """
    if head.weight.requires_grad and torch.is_grad_enabled():
        raise ValueError("head_cross_entropy: the LM head must be frozen (requires_grad=False); it is shared with "
                         "the target and its weight gets no gradient here")
    n = hidden.shape[0]
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    out = _FusedHeadCE.apply(hidden, head.weight, head.bias, labels, chunk if 0 < chunk < n else max(n, 1),
                             need_grad, top_k)
    return out if top_k else out[:2]


@dataclass(frozen=True)
class LossSpec:
    """What the loss of one scored position is and how positions are weighted (docs/dflash.md, "Loss")."""

    kind: str = "ce"  # "ce" | "kl" | "ce+kl"
    kl_weight: float = 1.0  # lambda of ce+kl: ce + lambda * T^2 * KL_T
    temperature: float = 1.0  # T of the KL term (both distributions softened)
    position_weight: str = "decay"  # "decay" (the weights of the layout as they are) | "dpace" (times dpace_weights)
    dpace_alpha: float = 0.5  # D-PACE smoothing alpha in [0, 1]

    @property
    def ce_coef(self) -> float:
        """a in a * ce + b * T^2 * KL_T."""
        return 0.0 if self.kind == "kl" else 1.0

    @property
    def kl_coef(self) -> float:
        """b in a * ce + b * T^2 * KL_T."""
        return {"ce": 0.0, "kl": 1.0, "ce+kl": self.kl_weight}[self.kind]


class _FusedHeadCEKL(torch.autograd.Function):
    """Per position obj = a * ce + b * T^2 * KL(softmax(t / T) || softmax(z / T)) of a frozen linear head, z the
    drafter's logits, t the target's (the same head on the target's final hidden states), with d obj / d hidden
    = (a * (softmax(z) - onehot) + b * T * (softmax(z / T) - softmax(t / T))) @ W computed chunk by chunk in the
    forward: one gradient matmul for both terms. Outputs obj (differentiable), ce, kl (KL_T, unscaled) and argmax;
    logits and terms in float32 (float64 when `hidden` is float64: the gradient tests).

    Memory per chunk of c positions: at most three (c, V) float32 buffers at once (z, log p, p; then z, p and
    softmax(z / T) when T != 1; the previous chunk's are freed first), where `_FusedHeadCE`'s loop holds its new
    logits and the previous chunk's (each also holds a (c, V) copy in the head's dtype while a matmul's output is
    converted): 12cV bytes against 10cV."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                target_hidden: torch.Tensor, target_of: torch.Tensor, chunk: int, a: float, b: float, T: float,
                need_grad: bool, top_k: int) -> tuple[torch.Tensor, ...]:
        n = hidden.shape[0]
        acc = torch.promote_types(torch.float32, hidden.dtype)  # logits and terms: float32 (float64 for a float64 h)
        ce = torch.empty(n, dtype=acc, device=hidden.device)  # (n,)
        kl = torch.empty_like(ce)  # (n,)
        pred = torch.empty(n, dtype=torch.long, device=hidden.device)  # (n,)
        top = _top_buffers(n, top_k, hidden.device, acc)  # (n, k) ids and values
        grad = torch.empty_like(hidden) if need_grad else None  # (n, H): d obj_i / d hidden_i
        # explicit dtypes: autocast would run the row dots in bf16 (and copy p and log p for them)
        with torch.autocast(hidden.device.type, enabled=False):
            _ce_kl_chunks(hidden, weight, bias, labels, target_hidden, target_of, chunk, a, b, T, acc, ce, kl, pred,
                          grad, top)
        obj = a * ce + (b * T * T) * kl  # (n,)
        ctx.save_for_backward(grad if need_grad else obj.new_empty(0))
        ctx.mark_non_differentiable(ce, kl, pred, *top)
        return obj, ce, kl, pred, *top

    @staticmethod
    def backward(ctx, grad_obj: torch.Tensor, *unused):
        (grad,) = ctx.saved_tensors
        return (grad_obj.unsqueeze(1).to(grad.dtype) * grad, *(None,) * 11)


def _ce_kl_chunks(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                  target_hidden: torch.Tensor, target_of: torch.Tensor, chunk: int, a: float, b: float, T: float,
                  acc: torch.dtype, ce: torch.Tensor, kl: torch.Tensor, pred: torch.Tensor,
                  grad: torch.Tensor | None, top: tuple[torch.Tensor, torch.Tensor]) -> None:
    """`_FusedHeadCEKL`'s chunk loop: fills ce, kl, pred (n,), the top-k ids and values `top` (n, k) when k > 0
    and, unless None, grad (n, H) in place."""
    n = hidden.shape[0]
    for start in range(0, n, chunk):
        part = slice(start, start + chunk)
        y = labels[part]  # (c,)
        rows = torch.arange(len(y), device=y.device)  # (c,)
        z = F.linear(hidden[part], weight, bias).to(acc)  # (c, V) drafter logits
        pred[part] = z.argmax(dim=-1)
        if top[0].shape[1]:
            top[1][part], top[0][part] = z.topk(top[0].shape[1], dim=-1)
        lse = torch.logsumexp(z, dim=-1)  # (c,)
        lse_T = lse if T == 1.0 else torch.logsumexp(z / T, dim=-1)  # (c,): before log p exists (memory)
        ce[part] = lse - z[rows, y]
        log_p = F.linear(target_hidden[target_of[part]].to(weight.dtype), weight, bias).to(acc)  # (c, V)
        log_p.div_(T)
        log_p.sub_(torch.logsumexp(log_p, dim=-1, keepdim=True))  # log softmax(t / T), in place
        p = log_p.exp()  # (c, V)
        # KL = sum p log p - sum p z / T + logsumexp(z / T): row dots, no (c, V) temporary
        kl[part] = (_rowdot(p, log_p) - _rowdot(p, z) / T + lse_T)
        del log_p  # the gradient needs z and p only
        if grad is not None:
            g = p.mul_(-b * T)  # (c, V): - b T p, in p's buffer
            if T != 1.0:
                g.add_(z.div(T).sub_(lse_T.unsqueeze(1)).exp_(), alpha=b * T)  # + b T softmax(z / T)
            soft = z.sub_(lse.unsqueeze(1)).exp_()  # softmax(z), in z's buffer
            g.add_(soft, alpha=a + b * T if T == 1.0 else a)
            g[rows, y] -= a
            grad[part] = (g.to(weight.dtype) @ weight).to(grad.dtype)  # (c, H)
            del g, soft  # (views of p and z)
        del z, p  # before the next chunk's logits exist: one chunk's buffers alive at a time


def _rowdot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(c, V), (c, V) -> (c,) row-wise dot products as one batched matmul (no (c, V) product is materialised)."""
    return (x.unsqueeze(1) @ y.unsqueeze(2)).reshape(-1)


def head_ce_kl(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, target_hidden: torch.Tensor,
               target_of: torch.Tensor, chunk: int, spec: LossSpec, top_k: int = 0) -> tuple[torch.Tensor, ...]:
    """Per-position objective a * ce + b * T^2 * KL_T (nats), ce, KL_T and argmax of `head(hidden)` against the
    target's distributions `head(target_hidden[target_of])`: hidden (n, H), labels (n,), target_hidden (u, H)
    final-normed target states, target_of (n,) -> obj, ce, kl (n,) float32 (float64 for a float64 hidden), pred
    (n,), and with `top_k` > 0 each row's top-k ids and values (n, top_k). chunk: positions per head call (0 = all
    n at once). The head must be frozen, as for `head_cross_entropy`."""
    if head.weight.requires_grad and torch.is_grad_enabled():
        raise ValueError("head_ce_kl: the LM head must be frozen (requires_grad=False); it is shared with the "
                         "target and its weight gets no gradient here")
    n = hidden.shape[0]
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    return _FusedHeadCEKL.apply(hidden, head.weight, head.bias, labels, target_hidden, target_of,
                                chunk if 0 < chunk < n else max(n, 1), spec.ce_coef, spec.kl_coef,
                                float(spec.temperature), need_grad, top_k)[:6 if top_k else 4]


def dpace_weights(q: torch.Tensor, scored: torch.Tensor, num_blocks: int, block_size: int,
                  alpha: float) -> torch.Tensor:
    """D-PACE weights (m,) of the m scored positions (docs/dflash.md), no gradient: q (m,) the drafter's
    probability of each scored label, scored (m,) flat query index i*B + k. Per block, s_k = (1 - alpha) q_k +
    alpha at scored positions and 1 elsewhere (anchor, revealed or out-of-document positions: no-ops),
    P_k = prod_{j <= k} s_j, and the weight of a scored position k is sum over scored j >= k of P_j."""
    n, B = num_blocks, block_size
    q = q.detach().double()
    s = torch.ones(n * B, dtype=torch.float64, device=q.device).index_copy(0, scored, (1.0 - alpha) * q + alpha)
    on = torch.zeros(n * B, dtype=torch.float64, device=q.device).index_copy(0, scored, torch.ones_like(q))
    prefix = s.view(n, B).cumprod(dim=1) * on.view(n, B)  # (n, B): P_k at scored positions, 0 elsewhere
    suffix = prefix.flip(1).cumsum(dim=1).flip(1)  # (n, B): sum_{j >= k} of scored P_j
    return suffix.reshape(-1).index_select(0, scored).float()


def weighted_loss(hidden: torch.Tensor, head: torch.nn.Linear | LinearHead, layout: "DraftLayout",
                  chunk_positions: int, normalizer: float | None, spec: LossSpec | None = None,
                  target_hidden: torch.Tensor | None = None, t2d: torch.Tensor | None = None,
                  top_k: int = 0) -> DrafterLoss:
    """hidden (n*B, H) drafter outputs of the layout's queries -> `DrafterLoss`. Only the layout's m scored
    positions (host-known indices) go through the head; no device-to-host sync.

    `spec` None or LossSpec() is the paper's loss, computed as it always was (`head_cross_entropy`). Loss kl or
    ce+kl needs `target_hidden` (u, H), the target's final-normed states at `layout.target_rows`; the loss total
    `ce_total` is then the objective's weighted sum. D-PACE multiplies the layout's weights by `dpace_weights`
    (made from the drafter's label probabilities exp(-ce), detached). `t2d` (V,): `head` holds a draft
    vocabulary's rows and t2d maps a target id to its row (-1 outside): a label outside is scored wrong and adds
    nothing to the loss (the KL term is then against the target's distribution over the same rows). `top_k` > 0:
    `DrafterLoss.top` holds each scored position's top-k head rows from the same head pass."""
    spec = spec or LossSpec()
    B = layout.block_size
    if normalizer is not None and not float(normalizer) > 0:
        raise ValueError(f"loss normalizer must be > 0, got {normalizer}")
    norm = layout.weight_sum if normalizer is None else float(normalizer)
    dev = hidden.device
    zeros = torch.zeros(B - 1, dtype=torch.float32, device=dev)
    if layout.num_scored == 0:  # nothing scored: a graph-connected zero keeps a distributed backward in step
        z = hidden.sum() * 0.0
        n = torch.full((), float(layout.num_blocks), device=dev)  # every block accepts its anchor only
        return DrafterLoss(z, 0.0, z.detach().float(), z.detach().float(), zeros, zeros.clone(), n, n.clone(),
                           torch.zeros(layout.num_blocks, dtype=torch.float32, device=dev))
    h = hidden.index_select(0, layout.scored).to(head.weight.dtype)  # (m, H), in the head's dtype
    y, w = layout.labels, layout.weights.float()  # (m,)
    inside = None
    if t2d is not None:
        y = t2d[y]  # (m,) rows of the draft vocabulary, -1 outside it
        inside = (y >= 0).float()
    rows = y if inside is None else y.clamp(min=0)  # a label outside: any row, its term is zeroed below
    if spec.kind == "ce":
        ce, pred, *top = head_cross_entropy(h, head, rows, chunk_positions, top_k)  # type: ignore[arg-type]
        per = ce  # (m,)
    else:
        if target_hidden is None or layout.target_of is None:
            raise ValueError(f"loss {spec.kind!r} needs the target's final hidden states at the layout's target rows "
                             "(a layout built with target_rows=True and TargetModel.context_features_and_final)")
        per, ce, _, pred, *top = head_ce_kl(h, head, rows, target_hidden, layout.target_of,  # type: ignore
                                            chunk_positions, spec, top_k)
    if inside is not None:
        per = per * inside
    if spec.position_weight == "dpace":
        q = torch.exp(-ce.detach())  # (m,) the drafter's probability of each label (0 outside the vocabulary)
        q = q if inside is None else q * inside
        w = w * dpace_weights(q, layout.scored, layout.num_blocks, B, spec.dpace_alpha)
    total = (w * per).sum()
    with torch.no_grad():
        correct = (pred == y).float()  # (m,)
        k = layout.scored_k - 1  # (m,) 0-based block position of each scored slot
        pos_correct = zeros.index_add(0, k, correct)
        pos_count = zeros.index_add(0, k, torch.ones_like(correct))
        correct_total = (layout.weights.float() * correct).sum()  # the layout's weights: acc = this / weight_sum
        runs = leading_runs(correct, layout.scored, layout.num_blocks, B)  # (n,)
        tau_sum, tau_blocks = (1.0 + runs).sum(), torch.full((), float(layout.num_blocks), device=dev)
    return DrafterLoss(loss=total / norm, weight_sum=layout.weight_sum, ce_total=total.detach(),
                       correct_total=correct_total, pos_correct_t=pos_correct, pos_count_t=pos_count,
                       tau_sum_t=tau_sum, tau_blocks_t=tau_blocks, block_runs_t=runs,
                       top=(top[0], top[1]) if top else None)


@contextmanager
def subnormals_flushed(device: torch.device, loss: str) -> Iterator[None]:
    """On the CPU with a KL loss (`loss` != "ce"): subnormal floats flushed to zero inside, restored after. As the KL
    nears 0 the products (q - p) @ W go subnormal, which x86 CPUs compute in microcode, many times slower.
    CUDA kernels flush already; ce is untouched (bitwise as before)."""
    flush = device.type == "cpu" and reads_final_states(loss) and torch.set_flush_denormal(True)  # False: CPU cannot
    try:
        yield
    finally:
        if flush:
            torch.set_flush_denormal(False)
