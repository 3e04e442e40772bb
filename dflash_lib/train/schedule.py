"""The training schedules: pure functions of the step index, and how many steps a run plans.

`lr_at` is a function of the 0-based OPTIMIZER step (a linear warm-up, then a cosine or a warm-up-stable-decay
to a floor); `noise_at` of the 0-based SAMPLER step (the feed stage lays anchors out ahead of the optimizer).
`count_steps` turns the `steps` / `epochs` / `accum_tokens` settings into the step count the lr schedule is
stretched over. A resume therefore needs only the step to continue on the same curves.
"""

from __future__ import annotations

import math

from dflash_lib.config import ConfigError, TrainConfig


def warmup_steps(total_steps: int, cfg: TrainConfig) -> int:
    """Warm-up length in optimizer steps: `warmup_steps` if > 0, else ceil(warmup_ratio * total_steps)."""
    return cfg.warmup_steps if cfg.warmup_steps > 0 else math.ceil(cfg.warmup_ratio * total_steps)


def lr_at(step: int, total_steps: int, cfg: TrainConfig) -> float:
    """Learning rate of the optimizer step with 0-based index `step` out of `total_steps`.

    Linear warm-up from 0 over W = `warmup_steps(...)` steps: lr * (step + 1) / W (so no step runs at lr 0
    and step W-1 reaches the peak). Then, `lr_schedule` "cosine": from lr down to lr_min = min_lr_ratio * lr,
    progress = (step - W) / (total - W), lr_min + (lr - lr_min) * (1 + cos(pi * progress)) / 2; "wsd"
    (warm-up, stable, decay): lr until the last D = ceil(decay_ratio * total) steps, then linear to lr_min,
    lr_min + (lr - lr_min) * (total - step) / D (step total - D runs at the peak, the last step at lr_min + 1/D
    of the way). Steps past `total_steps` stay at the floor (an estimated total may be slightly short).
    """
    if total_steps <= 0:
        raise ValueError(f"lr_at: total_steps must be > 0, got {total_steps}")
    w = warmup_steps(total_steps, cfg)
    if step < w:
        return cfg.lr * (step + 1) / w
    floor = cfg.min_lr_ratio * cfg.lr
    if cfg.lr_schedule == "wsd":
        decay = max(1, math.ceil(cfg.decay_ratio * total_steps))
        left = total_steps - step  # steps from this one to the end, this one included
        return cfg.lr if left >= decay else floor + (cfg.lr - floor) * max(0, left) / decay
    progress = min(1.0, (step - w) / max(1, total_steps - w))
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def noise_at(index: int, cfg: TrainConfig) -> float:
    """Fraction of block positions fed as MASK for the sampler step with 0-based run index `index` (the feed
    stage lays anchors out ahead of the optimizer, so the schedule's clock is the sampler step). Constant
    `cfg.noise` for now; a function of the index so a schedule can replace it without touching the loop."""
    return cfg.noise


def count_steps(cfg: TrainConfig, batches_per_epoch: int, corpus_tokens: int, world: int) -> tuple[int, int | None]:
    """(optimizer steps for the schedule, sampler steps to draw or None = until the steps are done).

    steps > 0: exactly that many steps, the sampler cycling through epochs. Otherwise `epochs` epochs of
    sampler steps; with token accumulation the step count is estimated as epochs * corpus_tokens / world /
    accum_tokens, `world` being the data shards D (the run ends when the sampler steps do; `lr_at` holds the
    floor past an estimate).
    """
    if cfg.steps > 0:
        return cfg.steps, None
    if batches_per_epoch <= 0:
        raise ConfigError("the sampler has no batch per epoch: the corpus is empty or smaller than one batch")
    batches = max(1, math.ceil(cfg.epochs * batches_per_epoch))
    if cfg.accum_tokens <= 0:
        return batches, batches
    return max(1, math.ceil(cfg.epochs * corpus_tokens / world / cfg.accum_tokens)), batches
