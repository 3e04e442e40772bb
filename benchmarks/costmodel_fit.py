"""Calibrate the step-time model on REAL measured steps and check it predicts a strategy it was not fitted on.

A small transformer (2 layers, SDPA attention, AdamW) trains on CPU on batches from each of the four
strategies (sorted, random, bucketed, packed) built from lognormal lengths. Steps of the four strategies are
interleaved so that load from other processes falls on all of them alike. Then:
- choose the terms of a + b * padded + r * real + c * attention (+ d per new shape) by held-out error, fit them
  on all steps, print the coefficients and q = b / c;
- leave-one-out: each strategy predicted from a fit on the other three, against its measured tokens/s (nested:
  the term choice also made without it);
- the reference run's padding-only estimate (sorted tokens/s x efficiency ratio) for comparison.

Packed rows use a block-diagonal mask through SDPA, which computes the whole row: priced with varlen=False. Every
batch runs this dense model over all its slots, so every shape is described as a padded kernel.
Run: .venv/bin/python benchmarks/costmodel_fit.py [--steps 40] [--budget 2048]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from dflash_lib.plan.costmodel import (BatchShape, StepObservation, attention_q_from_fit, describe_packed,
                                       describe_padded, select_cost_model, throughput_rel_sd)
from dflash_lib.plan.sampler import split_by_budget


class Block(torch.nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.qkv, self.out = torch.nn.Linear(h, 3 * h), torch.nn.Linear(h, h)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        R, T, H = x.shape
        qkv = self.qkv(self.norm1(x)).view(R, T, 3, self.heads, H // self.heads)  # (R, T, 3, nh, hd)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # (R, nh, T, hd) each
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (R, nh, T, hd)
        x = x + self.out(a.transpose(1, 2).reshape(R, T, H))  # (R, T, H)
        return x + self.mlp(self.norm2(x))  # (R, T, H)


def make_mask(doc: torch.Tensor) -> torch.Tensor:
    """(R, 1, T, T) bool: causal, within the same document; padding attends to itself only (no NaN rows)."""
    T = doc.shape[1]
    same = doc[:, :, None] == doc[:, None, :]  # (R, T, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()  # (T, T)
    return (same & causal)[:, None]  # (R, 1, T, T)


def batch_tensors(rows: list[list[int]], T: int) -> torch.Tensor:
    """Document ids (R, T) per slot; each padding slot gets its own negative id, so it attends only to itself."""
    doc = torch.full((len(rows), T), -1, dtype=torch.long)  # (R, T)
    for r, docs in enumerate(rows):
        start = 0
        for d, n in enumerate(docs):
            doc[r, start:start + n] = d
            start += n
    pad = doc < 0
    doc[pad] = -1 - torch.arange(int(pad.sum()))  # distinct ids: a pad slot sees only itself
    return doc


Planned = tuple[list[list[int]], int, BatchShape]  # (rows of document lengths, row length T, priced shape)


def strategies(lens: np.ndarray, budget: int, rng: np.random.Generator) -> dict[str, list[Planned]]:
    """Batches of each strategy as (rows of doc lengths, row length, shape)."""
    def fill(order: np.ndarray) -> list[list[int]]:  # each batch grown while (n + 1) * max length <= budget
        return [b.tolist() for b in split_by_budget(lens[order], budget)]

    def padded(batches: list[list[int]]) -> list[Planned]:
        return [([[n] for n in b], max(b), describe_padded(b, padded_kernel=True)) for b in batches]

    edges = np.quantile(lens, [0.3, 0.55, 0.75, 0.9, 1.0])
    bucket = np.searchsorted(edges, lens)
    bucketed = [b for k in range(len(edges)) for b in fill(rng.permutation(np.flatnonzero(bucket == k)))]
    rows, cur = [], []
    for i in rng.permutation(len(lens)):
        if sum(cur) + lens[i] > budget:
            rows.append(cur)
            cur = []
        cur.append(int(lens[i]))
    return {"sorted": padded(fill(np.argsort(lens, kind="stable"))), "random": padded(fill(rng.permutation(len(lens)))),
            "bucketed": padded(bucketed),
            "packed": [([r], budget, describe_packed([r], budget, varlen=False, padded_kernel=True)) for r in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="measured steps per strategy")
    ap.add_argument("--budget", type=int, default=2048, help="tokens per batch incl. padding (packed: per row)")
    ap.add_argument("--hidden", type=int, default=128, help="model width")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    lens = np.clip(rng.lognormal(5.0, 0.8, 4000).astype(np.int64), 16, args.budget // 2)  # (N,) tokens
    plans = strategies(lens, args.budget, rng)
    model = torch.nn.Sequential(*[Block(args.hidden, 4) for _ in range(2)])
    emb = torch.nn.Embedding(1000, args.hidden)
    opt = torch.optim.AdamW([*model.parameters(), *emb.parameters()], lr=1e-4)

    def step(rows: list[list[int]], T: int) -> float:
        doc = batch_tensors(rows, T)  # (R, T)
        ids = torch.randint(0, 1000, doc.shape)  # (R, T)
        t0 = time.perf_counter()
        x = emb(ids)  # (R, T, H)
        for blk in model:
            x = blk(x, make_mask(doc))
        loss = x.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    picks = {name: [batches[i] for i in rng.choice(len(batches), min(args.steps, len(batches)), replace=False)]
             for name, batches in plans.items()}
    for name, batches in picks.items():  # warm-up: one step of each strategy, not recorded
        step(*batches[0][:2])
    order = [(name, i) for name in picks for i in range(len(picks[name]))]
    rng.shuffle(order)  # interleave strategies so background load hits all of them alike
    obs: dict[str, list[StepObservation]] = {name: [] for name in picks}
    t_all = time.perf_counter()
    for name, i in order:
        rows, T, shape = picks[name][i]
        seconds = step(rows, T)
        obs[name].append(StepObservation(shape.rows, shape.row_len, shape.real_tokens, shape.attention,
                                         seconds, run="bench", padded_kernel=True))
    print(f"measured {len(order)} steps in {time.perf_counter() - t_all:.1f} s "
          f"(budget {args.budget} tokens, hidden {args.hidden}, {args.threads} thread(s))")

    choice = select_cost_model(obs)
    m = choice.model
    print(f"terms chosen by held-out error: {'+'.join(m.terms)}; fit on all steps: a = {m.a * 1e3:.3f} ms/step, "
          f"b = {m.b * 1e9:.2f} ns/padded token, r = {m.r * 1e9:.2f} ns/real token, c = {m.c * 1e12:.4f} ps/token^2, "
          f"d = {m.d * 1e3:.3f} ms/new shape; q = b/c = {attention_q_from_fit(m):.0f} tokens; "
          f"in-sample rel. RMSE {m.rel_rmse:.1%}")
    eff = {k: sum(o.real_tokens for o in v) / sum(o.padded_tokens for o in v) for k, v in obs.items()}
    tok_s = {k: sum(o.real_tokens for o in v) / sum(o.seconds for o in v) for k, v in obs.items()}
    print(f"{'strategy':>9} {'efficiency':>10} {'realized':>10} {'noise 2sd':>9} {'LOO pred':>10} {'LOO err':>8} "
          f"{'nested err':>10} {'padding-only err':>16}")
    for name, h in choice.held_out.items():
        naive = tok_s["sorted"] * eff[name] / eff["sorted"]
        nested = choice.nested[name].rel_error
        noise = 2 * throughput_rel_sd(obs[name], rng)
        print(f"{name:>9} {eff[name]:>10.1%} {h.realized_tok_s / 1e3:>8.2f} K {noise:>9.1%} "
              f"{h.predicted_tok_s / 1e3:>8.2f} K {h.rel_error:>+8.1%} {nested:>+10.1%} "
              f"{naive / tok_s[name] - 1:>+16.1%}")
    print(f"worst held-out error: {choice.max_abs_error:.1%}, nested {choice.nested_max_abs_error:.1%} "
          "(goal: within 3%; compare with each noise 2sd)")


if __name__ == "__main__":
    main()
