"""`train(config, run_dir) -> summary`: the drafter training loop on top of the CSP pipeline.

    store (tokens) -> sampler (index batches) -> pipeline [collate + validate + anchors and drafter layout on the
    host -> target workers] -> accumulate micro-batches to `accum_tokens` real tokens -> global weight sum ->
    loss/backward per micro-batch -> clip -> AdamW -> metrics (log line, metrics.jsonl, wandb) -> checkpoints
    -> summary.json + drafter/

Schedules are pure functions of the optimizer step (`lr_at`, `noise_at`). The loss of a step is normalised by
the weight sum of ALL its micro-batches on ALL ranks, sampled before any forward, so the update does not
depend on how the tokens were split. On CUDA: the target runs in bf16, the drafter under bf16 autocast with
fp32 weights, batches are pinned and copied non-blocking, AdamW is fused.

Crash safety: every `ckpt_every` steps, on SIGTERM/SIGINT (after the current step) and at the end, rank 0
writes an atomic checkpoint (`dflash_lib.checkpoint`) of everything the trajectory depends on: drafter weights,
AdamW state, the step (the lr schedule is a function of it), every rank's data position (epoch, sampler step
CONSUMED), every global RNG (anchors need none: each micro-batch's draw is seeded by its sampler position),
and the guard, skip and token counters. `train()` on a
folder holding a checkpoint of the same config resumes from it and continues with exactly the batches and
anchors an uninterrupted run would have used (`dflash_lib.resume` says when a folder resumes or is refused).

Steps are numbered from 1 in logs (step 1 = the first optimizer step); the schedules take the 0-based index.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from dflash_lib import distributed
from dflash_lib.batch import Batch
from dflash_lib.checkpoint import (CheckpointError, PendingSave, load_into, load_objects, load_rank_state,
                                   resume_config_hash, start_save)
from dflash_lib.config import Config, ConfigError, TrainConfig
from dflash_lib.feed import (Item, Work, bucket_of, epoch_batches, make_collate, make_prepare,  # noqa: F401
                             make_target_workers, next_step_items)  # Work, bucket_of: re-exported for this module's callers
from dflash_lib.heldout import HELDOUT_FILE, EvalSet, HeldOutSplit, SubsetStore, build_eval_set, split_store
from dflash_lib.heldout import evaluate as evaluate_heldout
from dflash_lib.metrics import (JsonlSink, NullSink, ThroughputMeter, WandbSink, eta_seconds, format_duration,
                                format_log_line)
from dflash_lib.models import DFlashDrafter, DrafterConfig, TargetModel, expected_acceptance
from dflash_lib.models.attention import resolve_attention
from dflash_lib.models.loss import stats_size
from dflash_lib.models.export import init_from, run_info
from dflash_lib.pipeline import Pipeline
from dflash_lib.resume import (CHECKPOINTS, CONFIG_FILE, METRICS_FILE, ResumePoint, clear_run_dir,
                               find_resume_point, truncate_metrics)
from dflash_lib.rng import capture_rng, restore_rng
from dflash_lib.runs import environment, new_run_dir, write_json
from dflash_lib.stop import StopRequest
from dflash_lib.validate import BadStepGuard, SkipCounter

TRAIN_STATE_FORMAT = 3  # layout of the trainer's checkpoint state; bump when it changes

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


def noise_at(index: int, cfg: TrainConfig) -> float:
    """Fraction of block positions fed as MASK for the sampler step with 0-based run index `index` (the feed
    stage lays anchors out ahead of the optimizer, so the schedule's clock is the sampler step). Constant
    `cfg.noise` for now; a function of the index so a schedule can replace it without touching the loop."""
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


def any_rank(flag: bool) -> bool:
    """True when `flag` is set on at least one rank (every rank gets the same answer)."""
    return all_reduce_floats([float(flag)])[0] > 0


def gather_states(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's `state` (tensors, numbers, strings, lists, dicts), in rank order; [state] in one process.
    Sent as torch.save bytes and read back with weights_only=True (no object is ever unpickled)."""
    if distributed.info().world_size == 1:
        return [state]
    buf = io.BytesIO()
    torch.save(state, buf)
    return [torch.load(io.BytesIO(b), weights_only=True) for b in distributed.all_gather_bytes(buf.getvalue())]


def rank_shards(rank: int, world_size: int, data_shards: int) -> list[int]:
    """The data shards (0..D-1 of every sampler step) this rank trains on: d % world_size == rank. W == D: its
    own; W < D: several, accumulated in one step (a 2-rank run resumed by one process); W > D: one or none."""
    return list(range(rank, data_shards, world_size))


def plan_steps(cfg: TrainConfig, batches_per_epoch: int, corpus_tokens: int, world: int) -> tuple[int, int | None]:
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
    blocks: int = 0  # anchor blocks the drafter ran on this rank
    head_rows: int = 0  # scored positions this rank ran through the LM head + CE (its work scales with them)
    tau_inbatch: float = math.nan  # EXACT in-batch acceptance length: mean over all ranks' blocks of 1 + the
    # block's own leading run of correct positions (`models.loss.leading_run_stats`); nan with no block


def train_step(engine: Any, items: Sequence[Item], params: list[torch.nn.Parameter], opt: torch.optim.Optimizer,
               lr: float, grad_clip: float, autocast: bool, guard: BadStepGuard, step: int,
               filler: Item | None = None) -> StepResult:
    """One optimizer step over `items`, whose drafter work was laid out on the host in the feed stage
    (`Item.layout`, `Item.device_layout`): the global weight sum first (host floats), then one forward/backward
    per micro-batch normalised by it, then clip and update. Returns the step's statistics (summed over ranks).

    `engine`: a `distributed.Engine` (DDP, FSDP2 or one process), or a plain drafter (one process). Micro-batches
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
    if not isinstance(engine, distributed.Engine):  # a plain drafter: one process
        engine = distributed.Engine(engine, "single", 1, next(engine.parameters()).device)
    drafter = engine.drafter
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
    runs = scored if scored or engine.kind == "single" or not weight_sum > 0 else [filler]
    if runs and runs[0] is None:
        raise ValueError("train_step: this rank has nothing to score in a step other ranks train on; the engine "
                         "needs a `filler` item to join the gradient reduction")
    with distributed.collective_errors(f"{engine.kind} gradient reduction"):
        for i, it in enumerate(runs):
            with engine.grad_sync(i == len(runs) - 1):
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
                    out = engine.loss(it.device_batch, it.features, it.device_layout, weight_sum)
                (out.loss * engine.loss_scale if engine.loss_scale != 1 else out.loss).backward()
            if it is not filler:
                stats = stats + out.stats()
    real = sum(it.batch.real_tokens for it in live)
    padded = sum(it.batch.padded_tokens for it in live)
    head_rows = sum(it.layout.num_scored for it in live)  # this rank's work
    have_grads = any(p.grad is not None for p in params)
    with distributed.collective_errors("gradient norm"):  # FSDP: the norm of sharded gradients is a collective
        norm = (torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf) if have_grads
                else torch.zeros((), device=device))
        if hasattr(norm, "full_tensor"):  # FSDP: a DTensor, the same global norm on every rank
            norm = norm.full_tensor()
    host = torch.cat([stats, norm.double().reshape(1)]).tolist()  # the step's one device-to-host transfer
    sums = all_reduce_floats([*host[:-1], real, padded])
    ce, correct = sums[0], sums[1]
    pos_correct, pos_count = sums[2:2 + n_pos], sums[2 + n_pos:2 + 2 * n_pos]
    real, padded = sums[-2], sums[-1]
    tau_sum, tau_blocks = sums[2 + 2 * n_pos], sums[3 + 2 * n_pos]
    skipped = not weight_sum > 0 or not guard.ok(ce, step)
    grad_norm = math.nan if skipped else host[-1]
    if not skipped:
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    opt.zero_grad(set_to_none=True)
    acc_per_pos = [c / n if n else math.nan for c, n in zip(pos_correct, pos_count)]
    return StepResult(
        loss=ce / weight_sum if weight_sum > 0 else math.nan, acc=correct / weight_sum if weight_sum > 0 else math.nan,
        acc_per_pos=acc_per_pos, eal=expected_acceptance(acc_per_pos), weight_sum=weight_sum,
        real_tokens=int(real), padded_tokens=int(padded), grad_norm=grad_norm, skipped=skipped,
        blocks=sum(it.layout.num_blocks for it in live), head_rows=head_rows,
        tau_inbatch=tau_sum / tau_blocks if tau_blocks > 0 else math.nan)


def filler_item(drafter: Any, target: TargetModel, device: torch.device) -> Item:
    """A one-document item whose loss weights are all zero: what a rank with nothing to score runs so that it
    still joins DDP's/FSDP's gradient reduction (every drafter parameter gets an exactly-zero gradient)."""
    from dataclasses import replace

    from dflash_lib.batch import collate_padded

    tokens = np.arange(1, drafter.cfg.block_size + 3, dtype=np.int64) % max(2, drafter.cfg.vocab_size - 1)  # (L,)
    batch = collate_padded([(tokens, np.ones(len(tokens), dtype=np.uint8))], 0)
    layout = drafter.layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(0)))
    layout = replace(layout, weights=torch.zeros_like(layout.weights), weight_sum=0.0)
    dev_batch = batch.to(device)
    with torch.no_grad():
        features = target.features(dev_batch, target.segments(batch.doc_ids))
    return Item(0, batch, dev_batch, features, layout=layout, device_layout=layout.to(device))


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW on the trainable parameters, fused on CUDA. The lr is set by `lr_at` before every step."""
    if not params:
        raise ConfigError("the drafter has no trainable parameter")
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=device.type == "cuda")


def save_drafter(drafter: Any, directory: Path, weights: dict[str, torch.Tensor] | None = None, **info: str) -> Path:
    """The drafter in the serving layout (fp32; `info`: its README's template, source, target_name) into a
    temporary sibling, then rename: a reader never sees half a folder. `weights`: its full trainable weights
    (`Engine.full_weights`: plain tensors whatever engine trained it); None = the drafter's own parameters."""
    from dflash_lib.models import export

    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if weights is None:
        drafter.save(tmp, **info)
    else:
        hf = drafter.target.model.config
        name = info.get("target_name") or drafter.target.name_or_path or "an in-memory model (no path)"
        meta = export._training_info(hf, name, info.get("template", ""), info.get("source", ""))
        export.write_folder(drafter.cfg, weights, tmp, torch.float32,
                            int(getattr(hf, "max_position_embeddings", 0) or 0), meta)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return directory


# -- the loop ----------------------------------------------------------------------------------------------------


@dataclass
class TrainingParts:
    """Everything the loop consumes: built from a Config by `build_parts`, or by a test from small stand-ins."""

    store: Any  # store[i] -> (tokens (L,), loss_mask (L,)) numpy arrays
    lengths: np.ndarray  # (N,) tokens per sample of the store
    sampler: Any  # batch sampler with set_epoch(e) and len() = steps per epoch (this rank); epoch_plan if any
    targets: list[TargetModel]  # one replica per target device; targets[0] is on the training device
    drafter: DFlashDrafter  # on the training device, sharing targets[0]'s embedding and LM head
    pad_id: int  # token id written into padding slots (never scored)
    packed: bool  # collate by packing documents into rows of `row_len` tokens instead of padding
    row_len: int  # packed row length in tokens (the token budget)
    edges: list[int]  # bucket upper edges in tokens, for the bucket id of padded batches ([] = no buckets)
    heldout: HeldOutSplit | None = None  # the held-out split (store, lengths and sampler are its train part)
    full_store: Any = None  # the store the split's indices refer to (None: `store` itself)
    data_shards: int = 1  # D: batches per sampler step (the sampler's plan width), shared by the ranks


def full_run_tokens(cfg: TrainConfig, lengths: np.ndarray) -> float:
    """Real tokens of the full run the ETA is for: full_run_epochs x (the corpus, or `full_run_samples`
    samples of the corpus' mean length)."""
    per_epoch = float(lengths.sum()) if cfg.full_run_samples == 0 else cfg.full_run_samples * float(lengths.mean())
    return cfg.full_run_epochs * per_epoch


def batch_shape(batches: Sequence[Batch]) -> dict[str, Any]:
    """What a step's batches cost, for the step-time cost model: rows, longest row (tokens), and the attention
    work in tokens^2 both as dense rows (R * T^2) and per document (sum of doc_len^2, varlen kernels)."""
    rows = sum(int(b.input_ids.shape[0]) for b in batches)
    row_len = max(int(b.input_ids.shape[1]) for b in batches)
    dense = sum(float(b.input_ids.shape[0]) * float(b.input_ids.shape[1]) ** 2 for b in batches)
    varlen = sum(float(((b.cu_seqlens[1:] - b.cu_seqlens[:-1]).double() ** 2).sum()) for b in batches)
    return dict(rows=rows, row_len=row_len, attn_dense=dense, attn_varlen=varlen)


@dataclass
class RunningMean:
    """Mean of the finite values added (a skipped step's NaN loss is left out)."""

    total: float = 0.0
    count: int = 0

    def add(self, value: float) -> None:
        if math.isfinite(value):
            self.total += value
            self.count += 1

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


class Trainer:
    """One training run over `parts`: the loop, its metrics, its checkpoints and its outputs (see `run_training`)."""

    def __init__(self, config: Config, parts: TrainingParts, run_dir: Path, clock: Callable[[], float],
                 setup_s: float, resume: Path | None = None, stop: StopRequest | None = None,
                 sinks: Sequence[Any] = ()) -> None:
        self.config, self.parts, self.run_dir, self.clock, self.setup_s = config, parts, run_dir, clock, setup_s
        self.extra_sinks = list(sinks)  # more `log(metrics, step)` / `close()` sinks on rank 0 (e.g. a live figure)
        self.t_start = clock()
        tc, self.dist = config.train, distributed.info()
        self.main = self.dist.rank == 0
        self.device = parts.targets[0].device
        self.engine = distributed.wrap_drafter(parts.drafter, tc.parallel)  # DDP / FSDP2 / one process
        self.params = [p for p in parts.drafter.parameters() if p.requires_grad]  # FSDP: the DTensor shards
        self.opt = build_optimizer(self.params, tc, self.device)
        self.data_shards = parts.data_shards
        self.shards = rank_shards(self.dist.rank, self.dist.world_size, self.data_shards)
        self.total_steps, self.max_batches = plan_steps(tc, len(parts.sampler), int(parts.lengths.sum()),
                                                        self.data_shards)
        self.filler = (filler_item(parts.drafter, parts.targets[0], self.device) if self.engine.kind != "single"
                       else None)
        self.guard = BadStepGuard(tc.max_bad_steps)
        self.skips = SkipCounter()
        self.full_tokens = full_run_tokens(tc, parts.lengths)
        self.meter = ThroughputMeter(clock=clock)
        self.step = 0  # optimizer steps completed
        self.position = (0, 0)  # (epoch, sampler step) of the next batch to consume (the same on every rank)
        self.batches_done = 0  # sampler steps consumed since the run began
        self.skipped_all = 0  # samples skipped by validation since the run began, all ranks
        self.loss_mean, self.acc_mean = RunningMean(), RunningMean()
        self.last: dict[str, Any] = {}  # the latest step's metrics record
        self.stop = stop if stop is not None else StopRequest()
        self.stop_reason: str | None = None  # why the loop ended early (None = it ran to the end)
        self.ckpt_dir = run_dir / CHECKPOINTS
        self.resume_hash = resume_config_hash(config)
        self.resumed_from = 0
        self.saved_step = -1  # step of the newest checkpoint written, started or loaded
        self.checkpoint: Path | None = None
        self.pending: PendingSave | None = None  # an async save not yet committed
        self.eval_set: EvalSet | None = None  # held-out batches with fixed anchors (built in run)
        self.last_eval: dict[str, Any] = {}  # the latest held-out figures (heldout_step + HELDOUT_KEYS)
        if resume is not None:
            self.load(Path(resume))

    # -- checkpoint state -------------------------------------------------------------------------------------

    def trainer_state(self, skips: SkipCounter) -> dict[str, Any]:
        """The loop's own state, the same on every rank: step (the lr schedule is a function of it), the GLOBAL
        data position (epoch, sampler step consumed, sampler steps done) and the sampler's fingerprint, the data
        shards D, the guard, token and skip counters (`skips`: every rank's, merged), running means, the last
        metrics row. (Anchors need no state: each micro-batch's draw is seeded by its sampler position.)"""
        m = self.meter
        epoch, step = self.position
        state = {
            "format": TRAIN_STATE_FORMAT, "step": self.step, "total_steps": self.total_steps,
            "data_shards": self.data_shards, "world_size": self.dist.world_size,
            "position": {"epoch": epoch, "step": step, "done": self.batches_done},
            "guard": self.guard.state_dict(), "skips": skips.state_dict(),
            "tokens": {"steps": m.steps, "real": m.real_tokens, "padded": m.padded_tokens,
                       "skipped_samples": self.skipped_all},
            "means": {"loss": [self.loss_mean.total, self.loss_mean.count],
                      "acc": [self.acc_mean.total, self.acc_mean.count]},
            "last": self.last,
        }
        sampler_state = getattr(self.parts.sampler, "state_dict", None)
        if sampler_state is not None:  # its fingerprint lets a resume refuse other data or sampler settings
            state["sampler"] = {**sampler_state(), "epoch": epoch, "step": step}
        return state

    def model_state(self) -> dict[str, Any]:
        """Drafter weights and AdamW state in torch's distributed layout (`get_state_dict`): parameter names of
        the plain drafter (no `module.` prefix) whatever the engine, DTensor shards under FSDP."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.parts.drafter, self.opt)
        return {"drafter": model, "optimizer": optim}

    def load(self, path: Path) -> None:
        """Continue from the checkpoint at `path` (verified by `prepare_run_dir`), at this run's world size and
        engine: DCP reads each rank's part of the weights and AdamW state, whatever sharding wrote them.
        Refuses one that does not fit this run with CheckpointError."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        trainer = load_objects(path).get("trainer") or {}
        where = f"checkpoint {path}"
        if trainer.get("format") != TRAIN_STATE_FORMAT:
            raise CheckpointError(f"{where}: trainer state format {trainer.get('format')!r} is not "
                                  f"{TRAIN_STATE_FORMAT}; use --fresh or another --run-dir")
        if trainer["total_steps"] != self.total_steps:
            raise CheckpointError(f"{where}: planned {trainer['total_steps']} steps, this run plans "
                                  f"{self.total_steps} (the corpus or sampler changed); use --fresh")
        if trainer["data_shards"] != self.data_shards:
            raise CheckpointError(f"{where}: its batches are cut into {trainer['data_shards']} data shards, this "
                                  f"run into {self.data_shards} (build the parts with data_shards from the "
                                  f"checkpoint)")
        group = distributed.checkpoint_group(self._ckpt_timeout_s())
        template = self.model_state()
        state = load_into(path, template, group)
        set_state_dict(self.parts.drafter, self.opt, model_state_dict=state["drafter"],
                       optim_state_dict=state["optimizer"])
        self.guard.load_state_dict(trainer["guard"])
        self.meter.steps, self.meter.real_tokens, self.meter.padded_tokens, self.skipped_all = (
            int(trainer["tokens"][k]) for k in ("steps", "real", "padded", "skipped_samples"))
        self.loss_mean = RunningMean(*trainer["means"]["loss"])
        self.acc_mean = RunningMean(*trainer["means"]["acc"])
        self.last = dict(trainer["last"])
        self.step = self.resumed_from = self.saved_step = int(trainer["step"])
        pos = trainer["position"]
        self.position, self.batches_done = (int(pos["epoch"]), int(pos["step"])), int(pos["done"])
        if "sampler" in trainer and hasattr(self.parts.sampler, "load_state_dict"):
            self.parts.sampler.load_state_dict(trainer["sampler"])  # SamplerError on other data or settings
        if self.main:  # the merged skip counts live on rank 0; the summary merges every rank's
            self.skips.load_state_dict(trainer["skips"])
        # RNG streams: this rank's own; a rank the writing run did not have takes rank (r mod W)'s
        old_world = int(trainer.get("world_size", 1))
        mine = load_rank_state(path, self.dist.rank % old_world)
        if mine is None:
            raise CheckpointError(f"{where}: no rank state for rank {self.dist.rank % old_world}")
        restore_rng(mine["rng"])

    def _ckpt_timeout_s(self) -> float:
        """The checkpoint collectives' timeout: fp32 weights + two AdamW moments, sized by
        `distributed.checkpoint_timeout_s`."""
        numel = sum(p.numel() for p in self.params)
        return distributed.checkpoint_timeout_s(12.0 * numel, self.dist.world_size, self.config.train.dist_timeout_s)

    def save(self, say: Callable[[str], None]) -> None:
        """Checkpoint the step just finished: every rank writes its part (DCP) and its RNG state, rank 0 the
        loop's state and, once every rank is done, the manifest; a previous async save is committed first. With
        `async_ckpt` the tensors are staged and written in the background (committed at the next save or the
        end). A failed write (full disk) raises CheckpointError on every rank, the previous checkpoint intact."""
        tc, step = self.config.train, self.step
        self.finish_save(say)
        group = distributed.checkpoint_group(self._ckpt_timeout_s())
        skips = self.all_skips()
        state = {"step": step, **self.model_state(), "trainer": self.trainer_state(skips)}
        meta = {"epoch": self.position[0], "resume_hash": self.resume_hash, "config": self.config.to_dict()}
        self._save_t0 = time.perf_counter()
        self.pending = start_save(self.ckpt_dir, state, step, config_hash=self.resume_hash,
                                  keep_last=tc.keep_checkpoints, meta=meta, rank_state={"rng": capture_rng()},
                                  async_save=tc.async_ckpt, group=group)
        self.saved_step = step
        if not tc.async_ckpt:
            self.finish_save(say)

    def finish_save(self, say: Callable[[str], None]) -> None:
        """Commit the pending save, if any (a collective: every rank calls it)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        self.checkpoint = pending.wait()
        say(f"checkpoint step {pending.step}: {self.checkpoint} ({time.perf_counter() - self._save_t0:.2f} s)")

    # -- the loop ------------------------------------------------------------------------------------------------

    def _pipeline(self) -> Pipeline:
        p, cfg = self.parts, self.config
        prepare = make_prepare(p.drafter, cfg.train.seed, lambda index: noise_at(index, cfg.train))
        collate = make_collate(p.store, p.packed, p.pad_id, p.row_len, p.edges, p.drafter.cfg.vocab_size,
                               pad_to_edge=cfg.sampler.static_shapes, prepare=prepare)
        workers = make_target_workers(p.targets, cfg.pipeline.target_workers, self.device,
                                      cfg.pipeline.target_threads)
        source = epoch_batches(p.sampler, self.max_batches, self.position, self.batches_done, self.shards,
                               p.lengths, cfg.train.accum_tokens, self.data_shards)
        return Pipeline(source, collate, workers, cfg.pipeline, pin_memory=self.device.type == "cuda",
                        clock=self.clock)

    def _train_one(self, items: list[Item], wait_s: float, pipeline: Pipeline) -> dict[str, Any]:
        """One optimizer step on `items`; returns its metrics record."""
        tc, step = self.config.train, self.step
        lr = lr_at(step, self.total_steps, tc)
        noise = next((it.layout.noise for it in items if it.layout is not None), noise_at(self.batches_done, tc))
        res = train_step(self.engine, items, self.params, self.opt, lr, tc.grad_clip,
                         self.device.type == "cuda", self.guard, step + 1, self.filler)
        self.step = step = step + 1
        self.position = (items[-1].epoch, items[-1].step + 1)
        self.batches_done += sum(it.last_shard for it in items)
        skipped_tokens = 0
        for it in items:
            for reason, index, tokens in it.skips:
                self.skips.add(reason, self._store_index(index))
                skipped_tokens += tokens
        n_skipped, skipped_tokens = all_reduce_floats([sum(len(it.skips) for it in items), skipped_tokens])
        self.skipped_all += int(n_skipped)
        rate = self.meter.step(step, res.real_tokens, res.padded_tokens, wait_s)
        done = self.meter.real_tokens
        self.loss_mean.add(res.loss)
        self.acc_mean.add(res.acc)
        live = [it.batch for it in items if it.batch is not None]
        return dict(
            step=step, epoch=items[-1].epoch, loss=res.loss, acc=res.acc, lr=lr, noise=noise,
            real_tokens=res.real_tokens, padded_tokens=res.padded_tokens, ktok_s=rate.ktok_s,
            data_wait_pct=rate.data_wait_pct_window, data_wait_pct_total=rate.data_wait_pct,
            **pipeline.depths(), bucket=live[0].bucket if live else -1,
            eta_s=eta_seconds(self.full_tokens - done, rate.eta_tok_s),
            run_eta_s=eta_seconds((self.total_steps - step) * done / step, rate.eta_tok_s),
            steady=rate.steady, acc_per_pos=res.acc_per_pos, eal=res.eal, eal_marginal=res.eal,
            tau_inbatch=res.tau_inbatch, time=self.clock() - self.t_start,
            grad_norm=res.grad_norm, micro_batches=len(items), skipped=res.skipped, step_s=rate.dt_s, wait_s=wait_s,
            blocks=res.blocks, head_rows=res.head_rows,
            bad_steps=self.guard.total, skipped_samples=self.skipped_all, skipped_tokens=int(skipped_tokens),
            **(batch_shape(live) if live else {}),
        )

    def _report_faults(self, items: list[Item], say: Callable[[str], None]) -> None:
        """Log what this step skipped: samples failing validation, or the whole update for a non-finite loss."""
        skipped = [f"{reason} (sample {self._store_index(index)})" for it in items for reason, index, _ in it.skips]
        if skipped:
            say(f"step {self.step}: skipped {len(skipped)} sample(s) failing validation: {', '.join(skipped[:5])}"
                f"{' ...' if len(skipped) > 5 else ''}")
        if self.guard.last_bad_step == self.step:
            say(f"step {self.step}: loss is not finite ({self.last['loss']}): update skipped "
                f"({self.guard.in_a_row} in a row, {self.guard.total} in all; {self.guard.max_in_a_row} in a row "
                f"abort the run)")

    def run(self) -> dict[str, Any]:
        tc = self.config.train
        sinks = [JsonlSink(self.run_dir / METRICS_FILE),
                 WandbSink(self.config.run.wandb_mode, self.config.run.wandb_project, self.run_dir,
                           self.config.to_dict(), self.run_dir.name), *self.extra_sinks] if self.main else [NullSink()]
        from tqdm.auto import tqdm

        bar = tqdm(total=self.total_steps, initial=self.step, unit="step", disable=not (self.main and in_notebook()))
        say = bar.write if not bar.disable else distributed.print0
        if self.resumed_from:
            say(f"resuming at step {self.resumed_from} of {self.total_steps} (epoch {self.position[0]}, "
                f"sampler step {self.position[1]})")
        self.parts.drafter.train()
        self._prepare_heldout()
        try:
            with self._pipeline() as pipeline:
                stream = iter(pipeline)
                self.meter.start()
                while self.step < self.total_steps:
                    if 0 < tc.stop_at_step <= self.step:
                        self.stop_reason = f"stop_at_step={tc.stop_at_step}"
                        break
                    if any_rank(self.stop.requested):  # every rank stops after the same step
                        self.stop_reason = self.stop.reason or "a stop signal on another rank"
                        break
                    # every rank reads the same optimizer step structure (`epoch_batches`): they end together
                    items, wait_s, ended = next_step_items(stream, lambda: pipeline.last_wait_s)
                    if not items:
                        break
                    self.last = self._train_one(items, wait_s, pipeline)
                    if self._eval_due(ended):
                        self.last.update(self.evaluate(say))
                    for sink in sinks:
                        sink.log(self.last, self.step)
                    bar.update(1)
                    if self.step % tc.log_every == 0 or self.step == self.total_steps or ended:
                        say(format_log_line(self.last))
                    self._report_faults(items, say)
                    if tc.ckpt_every > 0 and self.step % tc.ckpt_every == 0:
                        self.save(say)
                    if ended:
                        break
                if self.step > max(self.saved_step, 0):  # the end, a stop signal or stop_at_step
                    self.save(say)
                self.finish_save(say)  # an async save commits before the run reports
        finally:
            bar.close()
            for sink in sinks:
                sink.close()
        if self.step == 0 and self.stop_reason is None:
            raise ConfigError("training ran no step: the sampler produced no batch")
        skips = self.all_skips()
        summary = self.summary(skips)
        weights = self.engine.full_weights() if self.step > 0 else {}  # a collective under FSDP
        if self.main:
            if self.step > 0:
                save_drafter(self.parts.drafter, self.run_dir / "drafter", weights,
                             **run_info(self.config, f"{self.run_dir} (step {self.step})"))
            write_json(self.run_dir / "summary.json", summary)
        if self.stop_reason is not None:
            say(f"stopped ({self.stop_reason}) after step {self.step} of {self.total_steps}; "
                f"{'checkpoint ' + str(self.checkpoint) if self.checkpoint else 'nothing to checkpoint yet'}; "
                f"run the same command again to resume")
        if skips.total:
            say(skips.summary())
        return summary

    def _store_index(self, index: int) -> int:
        """The token store's index of sample `index` of the training view (the same without a held-out split)."""
        source_index = getattr(self.parts.store, "source_index", None)
        return index if source_index is None else source_index(index)

    def _prepare_heldout(self) -> None:
        """Rank 0: record the split in heldout.json and lay out the evaluation batches (rank 0 evaluates ALL the
        held-out samples; the other ranks never evaluate, except under FSDP, where every rank runs the same
        evaluation because each layer's forward all-gathers its shards)."""
        p, tc = self.parts, self.config.train
        if not (self.main or self.engine.kind == "fsdp") or p.heldout is None:
            return
        source = p.full_store if p.full_store is not None else p.store
        if self.main:
            write_json(self.run_dir / HELDOUT_FILE, p.heldout.record(len(source)))
        if tc.eval_samples > 0 and len(p.heldout.heldout):
            self.eval_set = build_eval_set(source, p.heldout.heldout, p.drafter, p.pad_id,
                                           self.config.sampler.token_budget, tc.seed, tc.eval_samples)

    def _eval_due(self, ended: bool) -> bool:
        """Evaluate after this step: every `eval_every` steps and at the end of the run (not on a stop: a resumed
        run then logs exactly the rows of an uninterrupted one)."""
        if self.eval_set is None or not self.eval_set.samples:
            return False
        tc, step = self.config.train, self.step
        last = (step == self.total_steps or ended
                or (self.max_batches is not None and self.batches_done >= self.max_batches))
        return last or (tc.eval_every > 0 and step % tc.eval_every == 0)

    def evaluate(self, say: Callable[[str], None] = distributed.print0) -> dict[str, Any]:
        """The drafter on the held-out evaluation batches now (`heldout.evaluate`): the HELDOUT_KEYS figures
        and heldout_s (seconds), also kept for summary.json."""
        t0 = time.perf_counter()
        with self._full_root():
            figures = evaluate_heldout(self.parts.drafter, self.parts.targets[0], self.eval_set,
                                       self.device.type == "cuda")
        figures["heldout_s"] = time.perf_counter() - t0
        self.last_eval = dict(heldout_step=self.step, **figures)
        say(f"held-out at step {self.step} ({figures['heldout_samples']} samples): loss {figures['heldout_loss']:.3f} | "
            f"acc {figures['heldout_acc']:.3f} | tau {figures['heldout_tau']:.3f} | "
            f"eal_marginal {figures['heldout_eal_marginal']:.3f}")
        return figures

    @contextlib.contextmanager
    def _full_root(self) -> Any:
        """FSDP: the root unit's parameters (fc, norms) unsharded while the drafter is called outside the
        engine's forward (the layers all-gather in their own forward hooks). A no-op for DDP and one process."""
        if self.engine.kind != "fsdp":
            yield
            return
        self.engine.module.unshard()
        try:
            yield
        finally:
            self.engine.module.reshard()

    def all_skips(self) -> SkipCounter:
        """The samples skipped by every rank (a collective under torchrun: every rank calls it)."""
        if self.dist.world_size == 1:
            return self.skips
        merged = SkipCounter()
        for state in gather_states(self.skips.state_dict()):
            rank = SkipCounter()
            rank.load_state_dict(state)
            merged.merge(rank)
        return merged

    def summary(self, skips: SkipCounter | None = None) -> dict[str, Any]:
        """The run in figures (see `run_training`); `skips` = every rank's skipped samples (default: this rank's)."""
        skips = skips if skips is not None else self.skips
        m, last, tc = self.meter, self.last, self.config.train
        steady = m.detector.steady
        tok_s = m.steady_tok_s or (last.get("ktok_s") or 0.0) * 1000.0  # last window's rate without a steady state
        full_eta = eta_seconds(self.full_tokens, tok_s)
        return dict(
            run_dir=str(self.run_dir), config_hash=self.config.hash(), resume_hash=self.resume_hash,
            strategy=self.config.sampler.strategy, world_size=self.dist.world_size,
            data_shards=self.data_shards, parallel=self.engine.kind, device=str(self.device),
            steps=self.step, planned_steps=self.total_steps, complete=self.stop_reason is None,
            stop_reason=self.stop_reason, resumed_from_step=self.resumed_from,
            checkpoint=str(self.checkpoint) if self.checkpoint else None, last_epoch=last.get("epoch"),
            real_tokens=m.real_tokens, padded_tokens=m.padded_tokens,
            padding_efficiency=m.real_tokens / max(1, m.padded_tokens),
            final_loss=last.get("loss"), mean_loss=self.loss_mean.mean, final_acc=last.get("acc"),
            mean_acc=self.acc_mean.mean, final_eal=last.get("eal"), bad_steps=self.guard.total,
            skipped_samples=dict(skips.counts), skipped_sample_examples=dict(skips.examples),
            steady=steady, steady_start_step=m.detector.start_step,
            steady_ktok_s=tok_s / 1000.0 if steady else None, ktok_s_last_window=last.get("ktok_s"),
            data_wait_pct=last.get("data_wait_pct_total"), steady_data_wait_pct=m.steady_data_wait_pct,
            full_run_epochs=tc.full_run_epochs, full_run_tokens=self.full_tokens, full_run_eta_s=full_eta,
            full_run_eta=format_duration(full_eta) + ("" if steady else " (provisional: no steady state)"),
            setup_s=self.setup_s, loop_s=m.elapsed_s, wall_s=self.setup_s + self.clock() - self.t_start,
            final_tau_inbatch=last.get("tau_inbatch"),
            heldout_fraction=self.parts.heldout.fraction if self.parts.heldout is not None else 0.0,
            heldout_count=len(self.parts.heldout.heldout) if self.parts.heldout is not None else 0,
            **self.last_eval,
        )


def run_training(config: Config, parts: TrainingParts, run_dir: Path,
                 clock: Callable[[], float] = time.perf_counter, setup_s: float = 0.0,
                 resume: Path | None = None, stop: StopRequest | None = None,
                 sinks: Sequence[Any] = ()) -> dict[str, Any]:
    """Train on `parts`; returns the summary. `sinks`: more metric sinks on rank 0 (`log(metrics, step)`,
    `close()`), e.g. `report.training.LiveFigure` in a notebook. `clock` (seconds) times steps and data waits; `setup_s` (seconds
    spent building the parts) is recorded. `resume`: a checkpoint directory to continue from (see `train`);
    `stop`: an entered StopRequest whose signal ends the loop after the current step (default: none).

    Rank 0 writes into `run_dir`: metrics.jsonl, one object per step with step (1-based), epoch, loss (nats,
    globally normalised), acc, acc_per_pos, eal, lr, noise, real_tokens and padded_tokens (all ranks),
    ktok_s (real tokens, rolling window), data_wait_pct (rolling window) and data_wait_pct_total (cumulative),
    q_pre and q_hs (queue depths per target worker), bucket (of the step's first micro-batch; -1 = none),
    eta_s (seconds to the end of a full run of `full_run_epochs`, at the steady throughput or provisionally
    at the rolling one), run_eta_s (to the end of this run), steady, time (seconds since this invocation's
    loop began), grad_norm, micro_batches, skipped (no update), bad_steps and skipped_samples (run totals),
    skipped_tokens (tokens of this step's samples left out by validation), blocks (anchor blocks run here),
    head_rows (scored positions run through the LM head + CE here), eal_marginal (= eal: the marginal-product
    ESTIMATE of the acceptance length, biased low) and tau_inbatch (the EXACT in-batch acceptance length: mean
    over the step's blocks of 1 + the block's own leading run of correct positions),
    step_s and wait_s (this step's wall time and data wait, seconds), and the step's batch shape (rows,
    row_len, attn_dense, attn_varlen); on evaluation steps (every `eval_every` steps and the last step of the
    run; rank 0 evaluates all of `eval_samples` held-out samples, `dflash_lib.heldout`) the
    same row also holds heldout_loss, heldout_acc, heldout_acc_per_pos, heldout_tau (exact), heldout_eal_marginal
    (estimate), heldout_blocks, heldout_samples and heldout_s; the same scalars to wandb; heldout.json (the
    split: fraction, hash rule, counts, held-out store indices and hashes); checkpoints/ckpt-<step>/ every `ckpt_every`
    steps, on a stop and at the end (the newest `keep_checkpoints` kept); and at the end drafter/ and
    summary.json (steps, complete / stop_reason / resumed_from_step, tokens, padding efficiency, losses,
    accuracy, bad steps, skipped samples by reason, steady-state Ktok/s and its first step, data-wait %, the
    full-run ETA, setup/loop/wall seconds of this invocation, config and resume hashes, final_tau_inbatch,
    heldout_fraction and heldout_count, and the latest evaluation's heldout_step and heldout_* figures).
    """
    return Trainer(config, parts, run_dir, clock, setup_s, resume, stop, sinks).run()


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


def static_batch_sizes(edges: Sequence[int], token_budget: int, q: float | None = None,
                       block_budget: int | None = None, bucket_queries: Sequence[int] | None = None) -> list[int]:
    """Rows per batch of each bucket when every row is padded to its bucket's upper edge: the most rows whose
    cost (edge tokens, + edge^2 / q with a quadratic cost) fits the token budget and, given block_budget and
    bucket_queries (K,) (drafter query tokens of each bucket's costliest sample), whose drafter queries fit
    it even when every row is that costliest sample: block_budget // bucket_queries[k] rows at most."""
    from dflash_lib.sampler.budget import TokenBudget

    cost = TokenBudget(token_budget, q).cost(np.asarray(edges, dtype=np.float64))  # (K,)
    sizes = [max(1, int(token_budget // c)) for c in cost]
    if block_budget is not None and bucket_queries is not None:
        sizes = [min(b, max(1, block_budget // int(mq))) if mq > 0 else b for b, mq in zip(sizes, bucket_queries)]
    return sizes


def build_sampler(config: Config, lengths: np.ndarray, rank: int, world_size: int,
                  edges: Sequence[int], queries: np.ndarray | None = None) -> Any:
    """The batch sampler named by `sampler.strategy`, sharded for (rank, world_size). Given `queries` (N,),
    drafter query tokens per sample (`data.analysis.store_drafter_queries`), every batch also stays within
    `sampler.resolve_block_budget(config)` query tokens; None bounds target tokens only."""
    from dflash_lib import sampler as samplers

    sc = config.sampler
    q = config.buckets.q if config.buckets.cost == "quadratic" else None
    common = dict(seed=sc.sampler_seed, rank=rank, world_size=world_size)
    if queries is not None:
        common |= dict(queries=queries, block_budget=samplers.resolve_block_budget(config))
    if sc.strategy == "sorted":
        return samplers.SortedStaticSampler(lengths, sc.token_budget, q=q, **common)
    if sc.strategy == "random":
        return samplers.RandomShuffleSampler(lengths, sc.token_budget, q=q, **common)
    if sc.strategy == "bucketed":
        sizes = None
        if sc.static_shapes:
            bucket_max = None
            if queries is not None:  # (K,) the costliest sample of each bucket, drafter query tokens
                bucket_max = np.zeros(len(edges), dtype=np.int64)
                np.maximum.at(bucket_max, samplers.bucket_of(np.asarray(lengths), edges), queries)
            sizes = static_batch_sizes(edges, sc.token_budget, q, common.get("block_budget"), bucket_max)
        return samplers.BucketedShuffleSampler(lengths, list(edges), sc.token_budget, q=q, batch_sizes=sizes,
                                               **common)
    return samplers.PackedSampler(lengths, sc.token_budget, window=sc.pack_window, **common)


def drafter_checkpointing(setting: str, device: torch.device) -> bool:
    """`drafter_checkpointing` resolved: "auto" = on for CUDA (memory is the limit there), off on CPU."""
    return setting == "true" or (setting == "auto" and torch.device(device).type == "cuda")


def build_parts(config: Config, device: torch.device, data_shards: int = 0) -> TrainingParts:
    """Token store, sampler, target replica(s) and a fresh drafter for `config` on `device`. The sampler is
    planned for `data_shards` = D shards (0 = the world size; a resume passes the checkpoint's D): every
    sampler step is D batches whatever the number of ranks that share them."""
    from dflash_lib.data import build_token_store_from_config
    from dflash_lib.data.analysis import store_drafter_queries

    if resolve_attention(config.model.drafter_attention, device) == "flex" and torch.device(device).type != "cuda":
        raise ConfigError(f"drafter_attention 'flex' trains only on CUDA (FlexAttention has no backward on "
                          f"{torch.device(device).type}); use 'blocks' (exact, any device) or 'auto'")
    dist = distributed.info()
    store = build_token_store_from_config(config.data, progress=dist.rank == 0)
    lengths = np.asarray(store.lengths)
    if len(lengths) == 0:
        raise ConfigError(f"the token store {store.path} holds no sample (source {config.data.source!r})")
    full_store, split = store, split_store(store, config.data.heldout_fraction)
    if len(split.train) == 0:
        raise ConfigError(f"heldout_fraction {config.data.heldout_fraction} holds out every one of the "
                          f"{len(lengths)} samples")
    if len(split.heldout):  # the sampler and its bucket plan see the training part only
        store, lengths = SubsetStore(full_store, split.train), lengths[split.train]
    strategy = config.sampler.strategy
    edges = bucket_edges(config, lengths) if strategy == "bucketed" else []
    shards = data_shards if data_shards > 0 else dist.world_size
    queries = store_drafter_queries(full_store, config.model.num_anchors,
                                    config.model.block_size)[split.train]  # (N,) query tokens
    sampler = build_sampler(config, lengths, 0, shards, edges, queries)  # the global plan: rank r reads its shards
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
    drafter = DFlashDrafter(DrafterConfig.from_model_config(config.model, targets[0]), targets[0],
                            attention=config.model.drafter_attention,
                            checkpointing=drafter_checkpointing(config.model.drafter_checkpointing, device))
    if config.model.init_from:  # fine-tune a saved or exported drafter instead of the random init
        init_from(drafter, config.model.init_from)
    pad_id = store.meta.get("tokenizer", {}).get("pad_id")
    if pad_id is None:
        raise ConfigError(f"token store {store.path}: meta.json records no tokenizer pad_id")
    return TrainingParts(store, lengths, sampler, targets, drafter, int(pad_id), strategy == "packed",
                         config.sampler.token_budget, edges, split, full_store, shards)


def shared_new_run_dir(tag: str = "") -> Path:
    """A new runs/<UTC>_train[_tag]/ folder created by rank 0; every rank gets rank 0's path."""
    path = str(new_run_dir("train", tag)) if distributed.is_main() else ""
    return Path(distributed.all_gather_bytes(path.encode())[0].decode())


def prepare_run_dir(config: Config, run_dir: Path) -> ResumePoint:
    """Decide whether the run resumes, starts, or is refused (`dflash_lib.resume`): rank 0 looks (verifying the
    newest checkpoint's checksums) and every rank gets its verdict; `fresh` first clears the folder (rank 0).
    Then rank 0 trims metrics.jsonl to the checkpoint's step and writes config.json and env.json."""
    import json

    from dflash_lib.checkpoint import CheckpointMismatchError

    dist = distributed.info()
    resume_hash = resume_config_hash(config)
    verdict: dict[str, Any] = {}
    if dist.rank == 0:
        try:
            if config.train.fresh:
                removed = clear_run_dir(run_dir)
                if removed:
                    distributed.print0(f"fresh start in {run_dir}: removed {', '.join(removed)}")
                point = ResumePoint(None, 0)  # files the trainer did not write stay, as the user asked to start here
            else:
                point = find_resume_point(run_dir, resume_hash)
            verdict = {"path": None if point.path is None else str(point.path), "step": point.step,
                       "data_shards": point.data_shards}
        except (CheckpointError, ConfigError) as e:
            if dist.world_size == 1:
                raise
            verdict = {"error": type(e).__name__, "message": str(e)}
    verdict = json.loads(distributed.all_gather_bytes(json.dumps(verdict).encode())[0])
    if "error" in verdict:
        kind = {"CheckpointMismatchError": CheckpointMismatchError, "CheckpointError": CheckpointError}
        raise kind.get(verdict["error"], ConfigError)(verdict["message"])
    point = ResumePoint(None if verdict["path"] is None else Path(verdict["path"]), verdict["step"],
                        verdict["data_shards"])
    if dist.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        dropped = truncate_metrics(run_dir / METRICS_FILE, point.step)
        write_json(run_dir / CONFIG_FILE, {"config": config.to_dict(), "config_hash": config.hash(),
                                           "resume_hash": resume_hash})
        write_json(run_dir / "env.json", environment())
        if point.path is not None:
            distributed.print0(f"resuming from {point.path}" + (f" (dropped {dropped} metrics rows logged past "
                                                                 f"it)" if dropped else ""))
    return point


def train(config: Config, run_dir: Path | None = None, tag: str = "", sinks: Sequence[Any] = ()) -> dict[str, Any]:
    """Train a drafter with `config`; returns the summary (also in run_dir/summary.json).

    run_dir: the run folder (created if missing; default a new runs/<UTC>_train[_tag]/). It receives
    config.json, env.json, metrics.jsonl (every step), wandb's offline files, checkpoints/ (see run_training),
    drafter/ and summary.json. A folder holding a checkpoint of the same config (resume hash) RESUMES from its
    newest good checkpoint, at any world size and with either engine (the global batches stay those of the run's
    first invocation: its data shards); another config's checkpoints or other content without a checkpoint are
    refused with an error unless `fresh=True`, which clears it first.
    SIGTERM/SIGINT during the loop: the current step finishes, a checkpoint is saved, and train() returns
    (summary["complete"] is False; before the loop they keep their default effect: nothing to save yet).
    Under torchrun every rank trains its data shards (DDP by default, `parallel="fsdp"` for FSDP2); rank 0
    writes the logs, every rank its part of each checkpoint.
    """
    if not isinstance(config, Config):
        raise ConfigError(f"train() takes a dflash_lib.config.Config, got {type(config).__name__}")
    t0 = time.perf_counter()
    tc = config.train
    owned = not distributed.initialized()
    dist = distributed.init_distributed(timeout_s=tc.dist_timeout_s, device=tc.device)
    try:
        run_dir = Path(run_dir) if run_dir is not None else shared_new_run_dir(tag)
        point = prepare_run_dir(config, run_dir)
        parts = build_parts(config, dist.device, point.data_shards)
        with StopRequest() as stop:
            return run_training(config, parts, run_dir, setup_s=time.perf_counter() - t0, resume=point.path,
                                stop=stop, sinks=sinks)
    finally:
        if owned:
            distributed.destroy()
