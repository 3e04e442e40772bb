"""`train(config, run_dir) -> summary`: the drafter training loop on top of the CSP pipeline.

    store (tokens) -> sampler (index batches) -> pipeline [collate -> target workers] -> accumulate
    micro-batches to `accum_tokens` real tokens -> anchors -> global weight sum -> loss/backward per
    micro-batch -> clip -> AdamW -> metrics (log line, metrics.jsonl, wandb) -> summary.json + drafter/

Schedules are pure functions of the optimizer step (`lr_at`, `noise_at`). The loss of a step is normalised by
the weight sum of ALL its micro-batches on ALL ranks, sampled before any forward, so the update does not
depend on how the tokens were split. On CUDA: the target runs in bf16, the drafter under bf16 autocast with
fp32 weights, batches are pinned and copied non-blocking, AdamW is fused.

Steps are numbered from 1 in logs (step 1 = the first optimizer step); the schedules take the 0-based index.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from dflash_lib import distributed
from dflash_lib.batch import Batch, collate_packed, collate_padded
from dflash_lib.config import Config, ConfigError, TrainConfig
from dflash_lib.metrics import (JsonlSink, NullSink, ThroughputMeter, WandbSink, eta_seconds, format_duration,
                                format_log_line)
from dflash_lib.models import DFlashDrafter, DrafterConfig, TargetModel, expected_acceptance
from dflash_lib.pipeline import Pipeline
from dflash_lib.runs import environment, new_run_dir, write_json
from dflash_lib.validate import BadStepGuard

# -- schedules -------------------------------------------------------------------------------------------------


def warmup_steps(total_steps: int, cfg: TrainConfig) -> int:
    """Warm-up length in optimizer steps: `warmup_steps` if > 0, else ceil(warmup_ratio * total_steps)."""
    return cfg.warmup_steps if cfg.warmup_steps > 0 else math.ceil(cfg.warmup_ratio * total_steps)


def lr_at(step: int, total_steps: int, cfg: TrainConfig) -> float:
    """Learning rate of the optimizer step with 0-based index `step` out of `total_steps`.

    Linear warm-up from 0 over W = `warmup_steps(...)` steps: lr * (step + 1) / W (so no step runs at lr 0
    and step W-1 reaches the peak), then a cosine from lr down to min_lr_ratio * lr:
    progress = (step - W) / (total - W), lr_min + (lr - lr_min) * (1 + cos(pi * progress)) / 2.
    Steps past `total_steps` stay at the floor (an estimated total may be slightly short).
    """
    if total_steps <= 0:
        raise ValueError(f"lr_at: total_steps must be > 0, got {total_steps}")
    w = warmup_steps(total_steps, cfg)
    if step < w:
        return cfg.lr * (step + 1) / w
    floor = cfg.min_lr_ratio * cfg.lr
    progress = min(1.0, (step - w) / max(1, total_steps - w))
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def noise_at(step: int, cfg: TrainConfig) -> float:
    """Fraction of block positions fed as MASK at optimizer step `step` (0-based). Constant `cfg.noise` for
    now; a function of the step so a schedule can replace it without touching the loop."""
    return cfg.noise


# -- environment -------------------------------------------------------------------------------------------------


def in_notebook() -> bool:
    """True inside a Jupyter kernel (including papermill), where a tqdm bar replaces scrolling lines."""
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return type(shell).__name__ == "ZMQInteractiveShell"


def all_reduce_floats(values: Sequence[float]) -> list[float]:
    """Sum a list of floats over ranks in one collective (identity in a single process)."""
    if distributed.info().world_size == 1:
        return [float(v) for v in values]
    return distributed.all_reduce_sum(torch.tensor(list(values), dtype=torch.float64)).tolist()


# -- data side ---------------------------------------------------------------------------------------------------


@dataclass
class Item:
    """One micro-batch leaving the pipeline."""

    epoch: int  # sampler epoch it came from
    batch: Batch  # host copy (pinned on CUDA): anchors are sampled from it without a device sync
    device_batch: Batch  # the same batch on the training device
    features: torch.Tensor  # (R, T, num_features * H) target features on the training device


def bucket_of(max_len: int, edges: Sequence[int]) -> int:
    """Index of the first bucket whose upper edge (tokens) holds `max_len`; -1 without edges."""
    if not len(edges):
        return -1
    k = int(np.searchsorted(np.asarray(edges), max_len, side="left"))
    if k >= len(edges):
        raise ValueError(f"a sample of {max_len} tokens exceeds the last bucket edge {edges[-1]}")
    return k


def make_collate(store: Any, packed: bool, pad_id: int, row_len: int,
                 edges: Sequence[int] = ()) -> Callable[[tuple[int, list[int]]], tuple[int, Batch]]:
    """(epoch, sample indices) -> (epoch, Batch): padded (bucket id from `edges`) or packed into `row_len`."""

    def collate(work: tuple[int, list[int]]) -> tuple[int, Batch]:
        epoch, indices = work
        samples = [store[i] for i in indices]
        if packed:
            return epoch, collate_packed(samples, pad_id, row_len, indices)
        bucket = bucket_of(max(len(t) for t, _ in samples), edges)
        return epoch, collate_padded(samples, pad_id, indices, bucket)

    return collate


def epoch_batches(sampler: Any, max_batches: int | None) -> Iterator[tuple[int, list[int]]]:
    """(epoch, indices) over successive epochs (`set_epoch` before each) until `max_batches` (None = endless)."""
    n, epoch = 0, 0
    while max_batches is None or n < max_batches:
        sampler.set_epoch(epoch)
        empty = True
        for indices in sampler:
            empty = False
            yield epoch, list(indices)
            n += 1
            if max_batches is not None and n >= max_batches:
                return
        if empty:
            raise ValueError(f"sampler {type(sampler).__name__} yielded no batch in epoch {epoch}")
        epoch += 1


def make_target_workers(targets: Sequence[Any], n_workers: int,
                        main_device: torch.device) -> list[Callable[[tuple[int, Batch]], Item]]:
    """`n_workers` callables (epoch, host batch) -> Item; worker w runs targets[w % len(targets)] (one replica
    per device; on CPU several threads share one) and hands its features to `main_device`."""

    def worker(target: Any) -> Callable[[tuple[int, Batch]], Item]:
        def run(work: tuple[int, Batch]) -> Item:
            epoch, batch = work
            dev_batch = batch.to(target.device, non_blocking=True)
            feats = target.features(dev_batch)  # (R, T, F*H)
            if target.device != main_device:
                dev_batch = batch.to(main_device, non_blocking=True)
                feats = feats.to(main_device, non_blocking=True)
            return Item(epoch, batch, dev_batch, feats)
        return run

    return [worker(targets[w % len(targets)]) for w in range(n_workers)]


def plan_steps(cfg: TrainConfig, batches_per_epoch: int, corpus_tokens: int, world: int) -> tuple[int, int | None]:
    """(optimizer steps for the schedule, micro-batches to draw or None = until the steps are done).

    steps > 0: exactly that many steps, the sampler cycling through epochs. Otherwise `epochs` epochs of
    micro-batches; with token accumulation the step count is estimated as epochs * corpus_tokens / world /
    accum_tokens (the run ends when the micro-batches do; `lr_at` holds the floor past an estimate).
    """
    if cfg.steps > 0:
        return cfg.steps, None
    if batches_per_epoch <= 0:
        raise ConfigError("the sampler has no batch per epoch: the corpus is empty or smaller than one batch")
    batches = max(1, math.ceil(cfg.epochs * batches_per_epoch))
    if cfg.accum_tokens <= 0:
        return batches, batches
    return max(1, math.ceil(cfg.epochs * corpus_tokens / world / cfg.accum_tokens)), batches


# -- one optimizer step -------------------------------------------------------------------------------------------


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


def train_step(drafter: Any, items: Sequence[Item], params: list[torch.nn.Parameter], opt: torch.optim.Optimizer,
               lr: float, noise: float, generator: torch.Generator, grad_clip: float, autocast: bool,
               guard: BadStepGuard, step: int) -> StepResult:
    """Anchors for every micro-batch first, then one forward/backward each with the global weight sum, then
    clip and update. Returns the step's statistics (floats, already summed over ranks).

    No update when nothing was scored, or when the global loss is not finite (`guard` counts those and raises
    after `max_bad_steps` in a row)."""
    device = items[0].features.device
    anchors = [drafter.sample_anchors(it.batch, generator, noise) for it in items]
    local = [drafter.weight_sum(a) for a in anchors]
    n_pos = drafter.cfg.block_size - 1
    ce = correct = 0.0
    pos_correct, pos_count = [0.0] * n_pos, [0.0] * n_pos
    (weight_sum,) = all_reduce_floats([sum(local)])
    for it, a, w in zip(items, anchors, local):
        if w == 0:  # nothing scored in this micro-batch: its loss and gradient are zero, skip the forward
            continue
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
            out = drafter.loss(it.device_batch, it.features, a, normalizer=weight_sum if weight_sum > 0 else None)
        out.loss.backward()
        ce, correct = ce + out.ce_sum, correct + out.correct_weight
        pos_correct = [x + y for x, y in zip(pos_correct, out.pos_correct)]
        pos_count = [x + y for x, y in zip(pos_count, out.pos_count)]
    real = sum(it.batch.real_tokens for it in items)
    padded = sum(it.batch.padded_tokens for it in items)
    sums = all_reduce_floats([ce, correct, real, padded, *pos_correct, *pos_count])
    ce, correct, real, padded = sums[:4]
    pos_correct, pos_count = sums[4:4 + n_pos], sums[4 + n_pos:]
    skipped = not weight_sum > 0 or not guard.ok(ce, step)
    grad_norm = math.nan
    if not skipped:
        if distributed.info().world_size > 1:
            for p in params:  # every rank reduces every tensor in the same order, even where it saw no data
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                p.grad = distributed.all_reduce_sum(grad)  # losses are globally normalised already: sum
        max_norm = grad_clip if grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    opt.zero_grad(set_to_none=True)
    acc_per_pos = [c / n if n else math.nan for c, n in zip(pos_correct, pos_count)]
    return StepResult(
        loss=ce / weight_sum if weight_sum > 0 else math.nan, acc=correct / weight_sum if weight_sum > 0 else math.nan,
        acc_per_pos=acc_per_pos, eal=expected_acceptance(acc_per_pos), weight_sum=weight_sum,
        real_tokens=int(real), padded_tokens=int(padded), grad_norm=grad_norm, skipped=skipped)


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW on the trainable parameters, fused on CUDA. The lr is set by `lr_at` before every step."""
    if not params:
        raise ConfigError("the drafter has no trainable parameter")
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=device.type == "cuda")


def save_drafter(drafter: Any, directory: Path) -> Path:
    """drafter.save into a temporary sibling, then rename: a reader never sees half a checkpoint."""
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    drafter.save(tmp)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return directory


# -- the loop ----------------------------------------------------------------------------------------------------


@dataclass
class TrainingParts:
    """Everything the loop consumes: built from a Config by `build_parts`, or by a test from small stand-ins."""

    store: Any  # store[i] -> (tokens (L,), loss_mask (L,)) numpy arrays
    lengths: np.ndarray  # (N,) tokens per sample of the store
    sampler: Any  # iterable of sample-index lists, with set_epoch(e) and len() = batches per epoch (this rank)
    targets: list[TargetModel]  # one replica per target device; targets[0] is on the training device
    drafter: DFlashDrafter  # on the training device, sharing targets[0]'s embedding and LM head
    pad_id: int  # token id written into padding slots (never scored)
    packed: bool  # collate by packing documents into rows of `row_len` tokens instead of padding
    row_len: int  # packed row length in tokens (the token budget)
    edges: list[int]  # bucket upper edges in tokens, for the bucket id of padded batches ([] = no buckets)


def full_run_tokens(cfg: TrainConfig, lengths: np.ndarray) -> float:
    """Real tokens of the full run the ETA is for: full_run_epochs x (the corpus, or `full_run_samples`
    samples of the corpus' mean length)."""
    per_epoch = float(lengths.sum()) if cfg.full_run_samples == 0 else cfg.full_run_samples * float(lengths.mean())
    return cfg.full_run_epochs * per_epoch


def _next_step_items(it: Iterator[Item], pipeline: Pipeline, accum_tokens: int) -> tuple[list[Item], float, bool]:
    """Micro-batches until `accum_tokens` real tokens (at least one): (items, seconds blocked, stream ended)."""
    items: list[Item] = []
    wait, tokens = 0.0, 0
    while True:
        try:
            item = next(it)
        except StopIteration:
            return items, wait, True
        wait += pipeline.last_wait_s
        items.append(item)
        tokens += item.batch.real_tokens
        if tokens >= accum_tokens:
            return items, wait, False


def batch_shape(batches: Sequence[Batch]) -> dict[str, Any]:
    """What a step's batches cost, for the step-time cost model: rows, longest row (tokens), and the attention
    work in tokens^2 both as dense rows (R * T^2) and per document (sum of doc_len^2, varlen kernels)."""
    rows = sum(int(b.input_ids.shape[0]) for b in batches)
    row_len = max(int(b.input_ids.shape[1]) for b in batches)
    dense = sum(float(b.input_ids.shape[0]) * float(b.input_ids.shape[1]) ** 2 for b in batches)
    varlen = sum(float(((b.cu_seqlens[1:] - b.cu_seqlens[:-1]).double() ** 2).sum()) for b in batches)
    return dict(rows=rows, row_len=row_len, attn_dense=dense, attn_varlen=varlen)


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


class Trainer:
    """One training run over `parts`: the loop, its metrics and its outputs (see `run_training`)."""

    def __init__(self, config: Config, parts: TrainingParts, run_dir: Path, clock: Callable[[], float],
                 setup_s: float) -> None:
        self.config, self.parts, self.run_dir, self.clock, self.setup_s = config, parts, run_dir, clock, setup_s
        self.t_start = clock()
        tc, self.dist = config.train, distributed.info()
        self.main = self.dist.rank == 0
        self.device = parts.targets[0].device
        self.params = [p for p in parts.drafter.parameters() if p.requires_grad]
        self.opt = build_optimizer(self.params, tc, self.device)
        self.total_steps, self.max_batches = plan_steps(tc, len(parts.sampler), int(parts.lengths.sum()),
                                                        self.dist.world_size)
        self.generator = torch.Generator().manual_seed(tc.seed + 7919 * self.dist.rank)  # anchors, per rank
        self.guard = BadStepGuard(tc.max_bad_steps)
        self.full_tokens = full_run_tokens(tc, parts.lengths)
        self.meter = ThroughputMeter(clock=clock)
        self.step = 0
        self.losses: list[float] = []
        self.accs: list[float] = []
        self.last: dict[str, Any] = {}

    def _pipeline(self) -> Pipeline:
        p, cfg = self.parts, self.config
        collate = make_collate(p.store, p.packed, p.pad_id, p.row_len, p.edges)
        workers = make_target_workers(p.targets, cfg.pipeline.target_workers, self.device)
        return Pipeline(epoch_batches(p.sampler, self.max_batches), collate, workers, cfg.pipeline,
                        pin_memory=self.device.type == "cuda", clock=self.clock)

    def _train_one(self, items: list[Item], wait_s: float, pipeline: Pipeline) -> dict[str, Any]:
        """One optimizer step on `items`; returns its metrics record."""
        tc, step = self.config.train, self.step
        lr, noise = lr_at(step, self.total_steps, tc), noise_at(step, tc)
        res = train_step(self.parts.drafter, items, self.params, self.opt, lr, noise, self.generator,
                         tc.grad_clip, self.device.type == "cuda", self.guard, step + 1)
        self.step = step = step + 1
        rate = self.meter.step(step, res.real_tokens, res.padded_tokens, wait_s)
        done = self.meter.real_tokens
        self.losses.append(res.loss)
        self.accs.append(res.acc)
        return dict(
            step=step, epoch=items[-1].epoch, loss=res.loss, acc=res.acc, lr=lr, noise=noise,
            real_tokens=res.real_tokens, padded_tokens=res.padded_tokens, ktok_s=rate.ktok_s,
            data_wait_pct=rate.data_wait_pct_window, data_wait_pct_total=rate.data_wait_pct,
            **pipeline.depths(), bucket=items[0].batch.bucket,
            eta_s=eta_seconds(self.full_tokens - done, rate.eta_tok_s),
            run_eta_s=eta_seconds((self.total_steps - step) * done / step, rate.eta_tok_s),
            steady=rate.steady, acc_per_pos=res.acc_per_pos, eal=res.eal, time=self.clock() - self.t_start,
            grad_norm=res.grad_norm, micro_batches=len(items), skipped=res.skipped, step_s=rate.dt_s, wait_s=wait_s,
            **batch_shape([it.batch for it in items]),
        )

    def run(self) -> dict[str, Any]:
        tc = self.config.train
        sinks = [JsonlSink(self.run_dir / "metrics.jsonl"),
                 WandbSink(self.config.run.wandb_mode, self.config.run.wandb_project, self.run_dir,
                           self.config.to_dict(), self.run_dir.name)] if self.main else [NullSink()]
        from tqdm.auto import tqdm

        bar = tqdm(total=self.total_steps, unit="step", disable=not (self.main and in_notebook()))
        say = bar.write if not bar.disable else distributed.print0
        self.parts.drafter.train()
        try:
            with self._pipeline() as pipeline:
                stream = iter(pipeline)
                self.meter.start()
                while self.step < self.total_steps:
                    items, wait_s, ended = _next_step_items(stream, pipeline, tc.accum_tokens)
                    if self.dist.world_size > 1:  # every rank stops at the same step (a partial one is dropped)
                        ended = all_reduce_floats([float(ended or not items)])[0] > 0
                        items = [] if ended else items
                    if not items:
                        break
                    self.last = self._train_one(items, wait_s, pipeline)
                    for sink in sinks:
                        sink.log(self.last, self.step)
                    bar.update(1)
                    if self.step % tc.log_every == 0 or self.step == self.total_steps or ended:
                        say(format_log_line(self.last))
                    if self.main and tc.ckpt_every > 0 and self.step % tc.ckpt_every == 0:
                        save_drafter(self.parts.drafter, self.run_dir / "checkpoints" / f"step_{self.step:08d}")
                    if ended:
                        break
        finally:
            bar.close()
            for sink in sinks:
                sink.close()
        if self.step == 0:
            raise ConfigError("training ran no step: the sampler produced no batch")
        summary = self.summary()
        if self.main:
            save_drafter(self.parts.drafter, self.run_dir / "drafter")
            write_json(self.run_dir / "summary.json", summary)
        return summary

    def summary(self) -> dict[str, Any]:
        """The run in figures (see `run_training`)."""
        m, last, tc = self.meter, self.last, self.config.train
        steady = m.detector.steady
        tok_s = m.steady_tok_s or last["ktok_s"] * 1000.0  # the last window's rate without a steady state
        full_eta = eta_seconds(self.full_tokens, tok_s)
        return dict(
            run_dir=str(self.run_dir), config_hash=self.config.hash(), strategy=self.config.sampler.strategy,
            world_size=self.dist.world_size, device=str(self.device), steps=self.step,
            planned_steps=self.total_steps, last_epoch=last["epoch"], real_tokens=m.real_tokens,
            padded_tokens=m.padded_tokens, padding_efficiency=m.real_tokens / max(1, m.padded_tokens),
            final_loss=self.losses[-1], mean_loss=_mean(self.losses), final_acc=self.accs[-1],
            mean_acc=_mean(self.accs), final_eal=last["eal"], bad_steps=self.guard.total,
            steady=steady, steady_start_step=m.detector.start_step,
            steady_ktok_s=tok_s / 1000.0 if steady else None, ktok_s_last_window=last["ktok_s"],
            data_wait_pct=last["data_wait_pct_total"], steady_data_wait_pct=m.steady_data_wait_pct,
            full_run_epochs=tc.full_run_epochs, full_run_tokens=self.full_tokens, full_run_eta_s=full_eta,
            full_run_eta=format_duration(full_eta) + ("" if steady else " (provisional: no steady state)"),
            setup_s=self.setup_s, loop_s=m.elapsed_s, wall_s=self.setup_s + self.clock() - self.t_start,
        )


def run_training(config: Config, parts: TrainingParts, run_dir: Path,
                 clock: Callable[[], float] = time.perf_counter, setup_s: float = 0.0) -> dict[str, Any]:
    """Train on `parts`; returns the summary. `clock` (seconds) times steps and data waits; `setup_s` (seconds
    spent building the parts) is recorded.

    Rank 0 writes into `run_dir`: metrics.jsonl, one object per step with step (1-based), epoch, loss (nats,
    globally normalised), acc, acc_per_pos, eal, lr, noise, real_tokens and padded_tokens (all ranks),
    ktok_s (real tokens, rolling window), data_wait_pct (rolling window) and data_wait_pct_total (cumulative),
    q_pre and q_hs (queue depths per target worker), bucket (of the step's first micro-batch; -1 = none),
    eta_s (seconds to the end of a full run of `full_run_epochs`, at the steady throughput or provisionally
    at the rolling one), run_eta_s (to the end of this run), steady, time (seconds since the loop began),
    grad_norm, micro_batches, skipped, step_s and wait_s (this step's wall time and data wait, seconds);
    the same scalars to wandb; drafter checkpoints every `ckpt_every` steps under checkpoints/; and at the
    end drafter/ and summary.json (steps, tokens, padding efficiency, losses, accuracy, steady-state Ktok/s
    and its first step, data-wait %, the full-run ETA, setup/loop/wall seconds, config hash).
    """
    return Trainer(config, parts, run_dir, clock, setup_s).run()


# -- building the parts from a Config ------------------------------------------------------------------------------


def bucket_edges(config: Config, lengths: np.ndarray) -> list[int]:
    """Bucket upper edges (tokens) for the bucketed sampler: `plan` (a plan.json) if set, else `edges`, else
    the optimal edges for these lengths (`buckets.optimal_boundaries` with the buckets section's settings)."""
    from dflash_lib.buckets import BucketPlan, optimal_boundaries

    sc, bc = config.sampler, config.buckets
    if sc.plan:
        path = Path(sc.plan)
        if not path.is_file():
            raise ConfigError(f"plan {str(path)!r}: no such file (a plan.json written by notebook 02)")
        return list(BucketPlan.from_json(path.read_text()).edges)
    if sc.edges:
        return list(sc.edges)
    q = bc.q if bc.cost == "quadratic" else None
    plan = optimal_boundaries(lengths, bc.k, max_len=config.data.max_len, objective=bc.objective, cost=bc.cost,
                              q=q, token_budget=sc.token_budget, multiple=bc.multiple, policy=config.data.policy)
    return list(plan.edges)


def build_sampler(config: Config, lengths: np.ndarray, rank: int, world_size: int,
                  edges: Sequence[int]) -> Any:
    """The batch sampler named by `sampler.strategy`, sharded for (rank, world_size)."""
    from dflash_lib import sampler as samplers

    sc = config.sampler
    q = config.buckets.q if config.buckets.cost == "quadratic" else None
    common = dict(seed=sc.sampler_seed, rank=rank, world_size=world_size)
    if sc.strategy == "sorted":
        return samplers.SortedStaticSampler(lengths, sc.token_budget, q=q, **common)
    if sc.strategy == "random":
        return samplers.RandomShuffleSampler(lengths, sc.token_budget, q=q, **common)
    if sc.strategy == "bucketed":
        return samplers.BucketedShuffleSampler(lengths, list(edges), sc.token_budget, q=q, **common)
    return samplers.PackedSampler(lengths, sc.token_budget, **common)


def build_parts(config: Config, device: torch.device) -> TrainingParts:
    """Token store, sampler, target replica(s) and a fresh drafter for `config` on `device`."""
    from dflash_lib.data import build_token_store_from_config

    dist = distributed.info()
    store = build_token_store_from_config(config.data, progress=dist.rank == 0)
    lengths = np.asarray(store.lengths)
    if len(lengths) == 0:
        raise ConfigError(f"the token store {store.path} holds no sample (source {config.data.source!r})")
    strategy = config.sampler.strategy
    edges = bucket_edges(config, lengths) if strategy == "bucketed" else []
    sampler = build_sampler(config, lengths, dist.rank, dist.world_size, edges)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # frozen target: no fp32 master copy
    if device.type == "cuda" and dist.world_size == 1 and torch.cuda.device_count() > 1:
        devices = [torch.device("cuda", i) for i in range(min(config.pipeline.target_workers,
                                                              torch.cuda.device_count()))]
    else:
        devices = [device]
    # Same seed on every device: the replicas are identical (a local checkpoint is identical anyway).
    targets = [TargetModel.from_model_config(config.model, device=d, dtype=dtype, seed=config.train.seed)
               for d in devices]
    torch.manual_seed(config.train.seed)
    drafter = DFlashDrafter(DrafterConfig.from_model_config(config.model, targets[0]), targets[0])
    pad_id = store.meta.get("tokenizer", {}).get("pad_id")
    if pad_id is None:
        raise ConfigError(f"token store {store.path}: meta.json records no tokenizer pad_id")
    return TrainingParts(store, lengths, sampler, targets, drafter, int(pad_id), strategy == "packed",
                         config.sampler.token_budget, edges)


def train(config: Config, run_dir: Path | None = None) -> dict[str, Any]:
    """Train a drafter with `config`; returns the summary (also in run_dir/summary.json).

    run_dir: the run folder (created if missing; default a new runs/<UTC>_train/). It receives config.json,
    env.json, metrics.jsonl (every step), wandb's offline files, checkpoints/ (ckpt_every), drafter/ and
    summary.json. Under torchrun every rank trains its shard; rank 0 writes.
    """
    if not isinstance(config, Config):
        raise ConfigError(f"train() takes a dflash_lib.config.Config, got {type(config).__name__}")
    t0 = time.perf_counter()
    tc = config.train
    dist = distributed.init_distributed(timeout_s=tc.dist_timeout_s, device=tc.device)
    device = dist.device
    run_dir = Path(run_dir) if run_dir is not None else new_run_dir("train")
    if dist.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json(run_dir / "config.json", {"config": config.to_dict(), "config_hash": config.hash()})
        write_json(run_dir / "env.json", environment())
    parts = build_parts(config, device)
    return run_training(config, parts, run_dir, setup_s=time.perf_counter() - t0)
