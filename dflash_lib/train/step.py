"""One optimizer step of the drafter: `train_step` over a step's micro-batches, and its optimizers (AdamW or Muon).

    global weight sum (host floats, one all-reduce) -> forward/backward per micro-batch, each loss normalised
    by it -> clip (the global norm) -> the optimizers -> the step's statistics (ONE device-to-host transfer)

The loss of a step is normalised by the weight sum of ALL its micro-batches on ALL ranks, sampled before any
forward, so the update does not depend on how the tokens were split. `filler_item` is what a rank with nothing
to score runs so that it still joins the gradient reduction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np
import torch

from dflash_lib.config import ConfigError, TrainConfig
from dflash_lib.data.batch import collate_padded
from dflash_lib.models import expected_acceptance
from dflash_lib.models.loss import stats_size
from dflash_lib.train import distributed
from dflash_lib.train.distributed import all_reduce_floats
from dflash_lib.train.feed import Item
from dflash_lib.train.state import BadStepGuard


@dataclass
class StepResult:
    """Statistics of one optimizer step, summed over its micro-batches (and ranks)."""

    loss: float  # sum(w * ce) / sum(w) over the whole step (nats); nan when nothing was scored
    acc: float  # weighted top-1 accuracy
    acc_per_pos: list[float]  # (B-1) top-1 accuracy per block position
    eal: float  # expected acceptance length from acc_per_pos
    weight_sum: float  # global loss weight sum (the normalizer)
    real_tokens: int  # real (document) tokens of the step, all ranks
    padded_tokens: int  # token slots paid for (R * T summed), all ranks
    grad_norm: float  # global gradient norm before clipping (nan when skipped)
    skipped: bool  # no optimizer update: nothing scored anywhere, or a non-finite loss
    blocks: int = 0  # anchor blocks the drafter ran on this rank
    head_rows: int = 0  # scored positions this rank ran through the LM head + CE (its work scales with them)
    tau_inbatch: float = math.nan  # EXACT in-batch acceptance length: mean over all ranks' blocks of 1 + the
    # block's own leading run of correct positions (`models.loss.leading_run_stats`); nan with no block


def clip_sharded_grads(params: Sequence[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """FSDP: the global 2-norm of the DTensor-sharded gradients (0-d, every rank the same), from each rank's local
    shards summed by ONE plain all-reduce, and the gradients scaled by min(1, max_norm / (norm + 1e-6)) in place,
    as `clip_grad_norm_` does. (Its DTensor path reduces through functional collectives, which deadlocked beside a
    sharded target's all-gathers in the feed thread.)"""
    grads = [p.grad.to_local() for p in params if p.grad is not None]  # type: ignore[union-attr]
    squares = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32).square() for g in grads]).sum()
    norm = distributed.all_reduce_sum(squares).sqrt()  # type: ignore[union-attr]
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def train_step(parallel: Any, items: Sequence[Item], params: list[torch.nn.Parameter],
               opt: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], lr: float, grad_clip: float, autocast: bool, guard: BadStepGuard, step: int,
               filler: Item | None = None) -> StepResult:
    """One optimizer step over `items`, whose drafter work was laid out on the host in the feed stage
    (`Item.layout`, `Item.device_layout`): the global weight sum first (host floats), then one forward/backward
    per micro-batch normalised by it, then clip and update. Returns the step's statistics (summed over ranks).

    `parallel`: a `distributed.DrafterParallel` (DDP, FSDP2 or one process), or a plain drafter (one process). Micro-batches
    but the last run under `grad_sync(False)` (DDP no_sync): the gradients are reduced once, overlapped with the
    last backward, in buckets. Each loss is multiplied by the engine's `loss_scale` (the world size) because DDP
    and FSDP AVERAGE over ranks while the loss is already normalised by the global weight sum: the reduced
    gradient is the sum, as one process holding every micro-batch computes it. A rank with nothing scored in a
    step where other ranks scored runs `filler` (a tiny item whose loss weights are zero) so it still joins the
    reduction (its gradient contribution is exactly zero).

    The device work makes ONE device-to-host transfer (the step's statistics and gradient norm together) and no
    other sync. Items whose batch is None (every sample failed validation, or a rank with no data shard)
    contribute nothing. No update when nothing was scored, or when the global loss is not finite (`guard` counts
    those and raises after `max_bad_steps` in a row)."""
    if not isinstance(parallel, distributed.DrafterParallel):  # a plain drafter: one process
        parallel = distributed.DrafterParallel(parallel, "single", 1, next(parallel.parameters()).device)
    drafter = parallel.drafter
    drafter.begin_step(step)  # a loss that changes with the step (dflash2's selector warm-up)
    device = next(drafter.parameters()).device
    live = [it for it in items if it.batch is not None]
    if any(it.layout is None or it.device_layout is None for it in live):
        raise ValueError("train_step: every item needs its drafter layout (make_collate(prepare=...))")
    for it in live:  # CUDA: this stream waits (on the device) for the target worker's stream; CPU: no-op
        it.wait_ready()
    local = [it.layout.weight_sum for it in live]
    n_pos = drafter.cfg.block_size - 1
    (weight_sum,) = all_reduce_floats([sum(local)])
    stats = torch.zeros(stats_size(n_pos + 1), dtype=torch.float64, device=device)  # see DrafterLoss.stats
    scored = [it for it, w in zip(live, local) if w > 0]  # nothing scored: zero loss and gradient, no forward
    runs = scored if scored or parallel.kind == "single" or not weight_sum > 0 else [filler]
    if runs and runs[0] is None:
        raise ValueError("train_step: this rank has nothing to score in a step other ranks train on; the wrapper "
                         "needs a `filler` item to join the gradient reduction")
    with distributed.collective_errors(f"{parallel.kind} gradient reduction"):
        for i, it in enumerate(runs):
            with parallel.grad_sync(i == len(runs) - 1):
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
                    out = parallel.loss(it.device_batch, it.features, it.device_layout, weight_sum,
                                      it.target_hidden)
                (out.loss * parallel.loss_scale if parallel.loss_scale != 1 else out.loss).backward()
            if it is not filler:
                stats = stats + out.stats()
    real = sum(it.batch.real_tokens for it in live)
    padded = sum(it.batch.padded_tokens for it in live)
    head_rows = sum(it.layout.num_scored for it in live)  # this rank's work
    have_grads = any(p.grad is not None for p in params)
    with distributed.collective_errors("gradient norm"):  # FSDP: the norm of sharded gradients is a collective
        clip = grad_clip if grad_clip > 0 else math.inf
        if not have_grads:
            norm = torch.zeros((), device=device)
        elif parallel.kind == "fsdp":
            norm = clip_sharded_grads(params, clip)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
    host = torch.cat([stats, norm.double().reshape(1)]).tolist()  # the step's one device-to-host transfer
    sums = all_reduce_floats([*host[:-1], real, padded])
    ce, correct = sums[0], sums[1]
    pos_correct, pos_count = sums[2:2 + n_pos], sums[2 + n_pos:2 + 2 * n_pos]
    real, padded = sums[-2], sums[-1]
    tau_sum, tau_blocks = sums[2 + 2 * n_pos], sums[3 + 2 * n_pos]
    skipped = not weight_sum > 0 or not guard.ok(ce, step)
    grad_norm = math.nan if skipped else host[-1]
    opts = (opt,) if isinstance(opt, torch.optim.Optimizer) else tuple(opt)  # `build_optimizer`'s tuple
    for o in opts:
        if not skipped:
            for group in o.param_groups:
                group["lr"] = lr
            o.step()
        o.zero_grad(set_to_none=True)
    acc_per_pos = [c / n if n else math.nan for c, n in zip(pos_correct, pos_count)]
    return StepResult(
        loss=ce / weight_sum if weight_sum > 0 else math.nan, acc=correct / weight_sum if weight_sum > 0 else math.nan,
        acc_per_pos=acc_per_pos, eal=expected_acceptance(acc_per_pos), weight_sum=weight_sum,
        real_tokens=int(real), padded_tokens=int(padded), grad_norm=grad_norm, skipped=skipped,
        blocks=sum(it.layout.num_blocks for it in live), head_rows=head_rows,
        tau_inbatch=tau_sum / tau_blocks if tau_blocks > 0 else math.nan)


def filler_item(drafter: Any, device: torch.device) -> Item:
    """A one-document item whose loss weights are all zero: what a rank with nothing to score runs so that it
    still joins DDP's/FSDP's gradient reduction (every drafter parameter gets an exactly-zero gradient). Its
    target features (and loss kl's final states) are zeros in the dtype of the target the drafter shares: no value
    of them reaches a gradient, so no target (local, sharded or served) is run for it (a cache holds no such
    document; a sharded target's pass is a collective)."""
    tokens = np.arange(1, drafter.cfg.block_size + 3, dtype=np.int64) % max(2, drafter.cfg.vocab_size - 1)  # (L,)
    batch = collate_padded([(tokens, np.ones(len(tokens), dtype=np.uint8))], 0)  # one row, no padding: C = L
    layout = drafter.layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(0)))
    layout = replace(layout, weights=torch.zeros_like(layout.weights), weight_sum=0.0)
    H, dtype = drafter.cfg.hidden_size, drafter.target.embed_tokens.weight.dtype  # the target's width and dtype
    features = torch.zeros(len(tokens), drafter.cfg.num_features * H, dtype=dtype, device=device)  # (L, F*H)
    final = None  # loss kl / ce+kl: the target's final states at the layout's rows, (u, H)
    if layout.target_rows is not None:
        final = torch.zeros(len(layout.target_rows), H, dtype=dtype, device=device)
    return Item(0, batch, batch.to(device), features, layout=layout, device_layout=layout.to(device),
                target_hidden=final)


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig,
                    device: torch.device) -> tuple[torch.optim.Optimizer, ...]:
    """The optimizers of the trainable parameters; the lr is set by `lr_at` before every step (`train_step`).

    "adamw": one AdamW (fused on CUDA). "muon": torch's Muon on the 2-D parameters (the drafter's projections and
    its feature fc: every trainable matrix but a lookup table's rows, dflash2's codebooks, marked `lookup_table`;
    the embedding and LM head are the target's, frozen) with
    `adjust_lr_fn="match_rms_adamw"` (its update scaled to AdamW's RMS, so one lr and schedule fit both), and
    AdamW on the rest (norms). Both take `weight_decay`. A tuple, as torch's distributed state dict takes it."""
    if not params:
        raise ConfigError("the drafter has no trainable parameter")
    fused = device.type == "cuda"
    if cfg.optimizer == "adamw":
        return (torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused),)
    matrices = [p for p in params if p.ndim == 2 and not getattr(p, "lookup_table", False)]
    rest = [p for p in params if p.ndim != 2 or getattr(p, "lookup_table", False)]
    opts: list[torch.optim.Optimizer] = [torch.optim.Muon(matrices, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                                          adjust_lr_fn="match_rms_adamw")] if matrices else []
    if rest:
        opts.append(torch.optim.AdamW(rest, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused))
    return tuple(opts)
