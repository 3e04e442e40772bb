"""Sampling at temperature T > 0 with nucleus (top_p) truncation (`sampling_probs`, `draw`), and speculative
sampling's accept/resample rule for one drafted block (`block_rule`, `speculative_step`), exact whatever the
drafter's q_k, DFlash's slots drafted in one parallel pass included; every draw from one CPU `torch.Generator`.

The rule, why it stays exact, and its tests: docs/serving.md, "Sampling: `-p temperature T -p top_p P`". Sources:
Leviathan, Kalman and Matias 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al. 2023,
"Accelerating Large Language Model Decoding with Speculative Sampling".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs (..., V) -> (..., V) renormalised to each row's nucleus: a token is kept when the mass of the tokens
    strictly more probable than it is < top_p, i.e. the fewest most probable tokens whose mass reaches top_p, and
    every token tied with the least probable of them (ties never depend on an ordering, so not on the device).
    top_p 1 keeps every token. Reads a row's top 64 or 1024 when their mass reaches top_p (a trained model's
    nucleus is small), else sorts the whole row."""
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_p == 1.0:
        return probs
    V = probs.shape[-1]
    for k in (64, 1024, V):
        if k < V:
            ranked = probs.topk(k, dim=-1).values  # (..., k) descending
        else:
            ranked = probs.sort(dim=-1, descending=True).values  # (..., V)
        cum = ranked.cumsum(dim=-1)
        if k >= V or bool((cum[..., -1] >= top_p).all()):
            break
    last = ((cum - ranked) < top_p).sum(dim=-1, keepdim=True) - 1  # (..., 1): the last rank with mass above < top_p
    kept = probs * (probs >= ranked.gather(-1, last))
    return kept / kept.sum(dim=-1, keepdim=True)


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """logits (..., V) -> the sampling distribution (..., V): softmax(logits / temperature) cut to its nucleus
    (`nucleus`). float32 (float64 when given float64); -inf logits (masked stop ids) get probability 0."""
    if not temperature > 0:
        raise ValueError(f"sampling needs temperature > 0, got {temperature} (0 is greedy: take the argmax)")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return nucleus(torch.softmax(logits.to(dtype) / temperature, dim=-1), top_p)


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of probs (..., V) -> (...,) long, on probs' device: the inverse of each row's cumulative
    sum (float64) at a uniform from the CPU `generator` (one per row, row order), scaled by the row's total, so
    rows need not sum to exactly 1. A zero-probability token is never drawn (`searchsorted` right of ties)."""
    u = torch.rand(probs.shape[:-1], generator=generator, dtype=torch.float64)  # (...,) on the CPU
    cdf = probs.double().cumsum(dim=-1)  # (..., V)
    at = (u.to(probs.device) * cdf[..., -1]).unsqueeze(-1)  # (..., 1), < the row's total
    index = torch.searchsorted(cdf, at, right=True).squeeze(-1)
    return index.clamp_(max=probs.shape[-1] - 1)  # reached only when u * total rounds up to total (p ~ 2^-53)


@dataclass(frozen=True)
class BlockRule:
    """The accept/resample rule's numbers for one drafted block of B tokens (`block_rule`)."""

    accept: torch.Tensor  # (B-1,) [k-1]: probability of accepting draft slot k, min(1, p_k(d_k) / q_k(d_k))
    # (B, V) [n]: the distribution of the token that follows n accepted slots: n < B-1 the residual
    # norm(max(0, p_{n+1} - q_{n+1})) (p_{n+1} itself where the residual is all zero: p = q, never rejected),
    # n = B-1 the bonus p_B
    resample: torch.Tensor


def block_rule(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor) -> BlockRule:
    """p (B, V) the target's distributions at the block's B positions, q (B-1, V) the drafter's at its B-1 draft
    slots, draft (B-1,) the drafted tokens (d_k drawn from q_k) -> the rule's acceptance probabilities and
    resampling distributions. ValueError when a drafted token has q_k(d_k) = 0 (it cannot have been drawn)."""
    if p.dim() != 2 or q.shape != (p.shape[0] - 1, p.shape[1]) or draft.shape != (p.shape[0] - 1,):
        raise ValueError(f"block_rule: p (B, V), q (B-1, V), draft (B-1,) expected, got {tuple(p.shape)}, "
                         f"{tuple(q.shape)}, {tuple(draft.shape)}")
    draft = draft.to(p.device).long()
    slots = torch.arange(draft.shape[0], device=p.device)
    q_d, p_d = q[slots, draft], p[:-1][slots, draft]  # (B-1,) each
    if not bool((q_d > 0).all()):
        raise ValueError("block_rule: a drafted token has probability 0 under the distribution it was drawn from")
    residual = (p[:-1] - q).clamp(min=0)  # (B-1, V)
    mass = residual.sum(dim=-1, keepdim=True)  # (B-1, 1): also the slot's rejection probability
    residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(p.dtype).tiny), p[:-1])
    return BlockRule(accept=(p_d / q_d).clamp(max=1.0), resample=torch.cat([residual, p[-1:]]))


def speculative_step(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor,
                     generator: torch.Generator) -> tuple[int, int]:
    """One block verified by the rule (`block_rule`): (n, token) with n the draft slots accepted (0 .. B-1, the
    leading run of u_k < accept_k over B-1 uniforms from `generator`) and the token that follows them, drawn from
    `resample[n]`. Always draws B uniforms, so the generator's stream does not depend on the outcome."""
    rule = block_rule(p, q, draft)
    u = torch.rand(rule.accept.shape, generator=generator, dtype=torch.float64)  # (B-1,) on the CPU
    rejected = u.to(rule.accept.device) >= rule.accept.double()
    stop = torch.cat([rejected, rejected.new_ones(1)])  # (B,): the last is the bonus, never "rejected"
    n = int(stop.int().argmax())  # the first True
    return n, int(draw(rule.resample[n], generator))
