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
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from dflash_lib import distributed
from dflash_lib.batch import Batch
from dflash_lib.checkpoint import CheckpointError, TrainingCheckpoints, load_objects
from dflash_lib.config import Config, ConfigError, TrainConfig
from dflash_lib.distributed import all_reduce_floats, any_rank, gather_states, rank_shards
from dflash_lib.feed import Item, epoch_batches, make_collate, make_prepare, make_target_workers, next_step_items
from dflash_lib.heldout import HELDOUT_FILE, EvalSet, build_eval_set
from dflash_lib.heldout import evaluate as evaluate_heldout
from dflash_lib.metrics import (JsonlSink, NullSink, ThroughputMeter, WandbSink, eta_seconds, format_duration,
                                format_log_line)
from dflash_lib.models.export import run_info, save_drafter
from dflash_lib.parts import TrainingParts, build_parts, load_training_data
from dflash_lib.pipeline import Pipeline
from dflash_lib.resume import CHECKPOINTS, METRICS_FILE, prepare_run_dir, shared_new_run_dir
from dflash_lib.runs import write_json
from dflash_lib.schedule import lr_at, noise_at, plan_steps
from dflash_lib.step import build_optimizer, filler_item, train_step
from dflash_lib.stop import StopRequest
from dflash_lib.validate import BadStepGuard, SkipCounter

TRAIN_STATE_FORMAT = 3  # layout of the trainer's checkpoint state; bump when it changes


def in_notebook() -> bool:
    """True inside a Jupyter kernel (including papermill), where a tqdm bar replaces scrolling lines."""
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return type(shell).__name__ == "ZMQInteractiveShell"


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


class RunLog:
    """Where the loop reports, on rank 0: the metric sinks (metrics.jsonl, wandb, the caller's), a progress bar
    in a notebook, and `say` for log lines (the bar's write, else `print0`). Other ranks write nothing."""

    def __init__(self, config: Config, run_dir: Path, main: bool, total_steps: int, done_steps: int,
                 extra_sinks: Sequence[Any] = ()) -> None:
        from tqdm.auto import tqdm

        r = config.run
        self.sinks = [JsonlSink(run_dir / METRICS_FILE), WandbSink(r.wandb_mode, r.wandb_project, run_dir,
                      config.to_dict(), run_dir.name), *extra_sinks] if main else [NullSink()]
        self.bar = tqdm(total=total_steps, initial=done_steps, unit="step", disable=not (main and in_notebook()))
        self.say: Callable[[str], None] = self.bar.write if not self.bar.disable else distributed.print0

    def log(self, record: dict[str, Any], step: int, line: bool) -> None:
        """One step's metrics `record` to every sink and the bar; `line`: also as a log line."""
        for sink in self.sinks:
            sink.log(record, step)
        self.bar.update(1)
        if line:
            self.say(format_log_line(record))

    def close(self) -> None:
        self.bar.close()
        for sink in self.sinks:
            sink.close()


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
        self.ckpts = TrainingCheckpoints(run_dir / CHECKPOINTS, parts.drafter, self.opt, config)
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
        self.resumed_from = 0
        self.eval_set: EvalSet | None = None  # held-out batches with fixed anchors (built in run)
        self.last_eval: dict[str, Any] = {}  # the latest held-out figures (heldout_step + HELDOUT_KEYS)
        if resume is not None:
            self.load(Path(resume))

    # -- the loop ------------------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Batch in (target features computed in the pipeline), drafter step and optimizer, metrics, checkpoint,
        stop; then the drafter and summary.json. Returns the summary."""
        tc = self.config.train
        log = RunLog(self.config, self.run_dir, self.main, self.total_steps, self.step, self.extra_sinks)
        if self.resumed_from:
            log.say(f"resuming at step {self.resumed_from} of {self.total_steps} (epoch {self.position[0]}, "
                    f"sampler step {self.position[1]})")
        self.parts.drafter.train()
        self._prepare_heldout()
        try:
            with self._pipeline() as pipeline:
                stream = iter(pipeline)
                self.meter.start()
                while self.step < self.total_steps and not self._stopping():
                    # every rank reads the same optimizer step structure (`epoch_batches`): they end together
                    items, wait_s, ended = next_step_items(stream, lambda: pipeline.last_wait_s)
                    if not items:
                        break
                    self.last = self._train_one(items, wait_s, pipeline)
                    if self._eval_due(ended):
                        self.last.update(self.evaluate(log.say))
                    log.log(self.last, self.step,
                            line=self.step % tc.log_every == 0 or self.step == self.total_steps or ended)
                    self._report_faults(items, log.say)
                    if tc.ckpt_every > 0 and self.step % tc.ckpt_every == 0:
                        self.save(log.say)
                    if ended:
                        break
                if self.step > max(self.ckpts.saved_step, 0):  # the end, a stop signal or stop_at_step
                    self.save(log.say)
                self.ckpts.finish(log.say)  # an async save commits before the run reports
        finally:
            log.close()
        return self._finish(log.say)

    def _stopping(self) -> bool:
        """Stop before the next step (`stop_at_step` reached, or a stop signal on any rank: every rank stops after
        the same step); records why in `stop_reason`."""
        tc = self.config.train
        if 0 < tc.stop_at_step <= self.step:
            self.stop_reason = f"stop_at_step={tc.stop_at_step}"
        elif any_rank(self.stop.requested):
            self.stop_reason = self.stop.reason or "a stop signal on another rank"
        return self.stop_reason is not None

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

    def _finish(self, say: Callable[[str], None]) -> dict[str, Any]:
        """After the loop: rank 0 writes drafter/ (every rank joins the weights' gather) and summary.json; a stop
        says how to resume. Returns the summary."""
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
                f"{'checkpoint ' + str(self.ckpts.latest) if self.ckpts.latest else 'nothing to checkpoint yet'}; "
                f"run the same command again to resume")
        if skips.total:
            say(skips.summary())
        return summary

    # -- checkpoint state -------------------------------------------------------------------------------------

    def save(self, say: Callable[[str], None]) -> None:
        """Checkpoint the step just finished (`TrainingCheckpoints.save`: a collective, every rank calls it)."""
        self.ckpts.save(self.step, self.position[0], self.trainer_state, say)

    def trainer_state(self) -> dict[str, Any]:
        """The loop's own state, the same on every rank: step (the lr schedule is a function of it), the GLOBAL
        data position (epoch, sampler step consumed, sampler steps done) and the sampler's fingerprint, the data
        shards D, the guard, token and skip counters (every rank's skips, merged: a collective), running means,
        the last metrics row. (Anchors need no state: each micro-batch's draw is seeded by its sampler position.)"""
        m, (epoch, step) = self.meter, self.position
        state = {
            "format": TRAIN_STATE_FORMAT, "step": self.step, "total_steps": self.total_steps,
            "data_shards": self.data_shards, "world_size": self.dist.world_size,
            "position": {"epoch": epoch, "step": step, "done": self.batches_done},
            "guard": self.guard.state_dict(), "skips": self.all_skips().state_dict(),
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

    def load(self, path: Path) -> None:
        """Continue from the checkpoint at `path` (verified by `prepare_run_dir`), at this run's world size and
        engine. Refuses one that does not fit this run with CheckpointError."""
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
        self.ckpts.load(path, int(trainer["step"]))
        self.guard.load_state_dict(trainer["guard"])
        self.meter.steps, self.meter.real_tokens, self.meter.padded_tokens, self.skipped_all = (
            int(trainer["tokens"][k]) for k in ("steps", "real", "padded", "skipped_samples"))
        self.loss_mean = RunningMean(*trainer["means"]["loss"])
        self.acc_mean = RunningMean(*trainer["means"]["acc"])
        self.last = dict(trainer["last"])
        self.step = self.resumed_from = int(trainer["step"])
        pos = trainer["position"]
        self.position, self.batches_done = (int(pos["epoch"]), int(pos["step"])), int(pos["done"])
        if "sampler" in trainer and hasattr(self.parts.sampler, "load_state_dict"):
            self.parts.sampler.load_state_dict(trainer["sampler"])  # SamplerError on other data or settings
        if self.main:  # the merged skip counts live on rank 0; the summary merges every rank's
            self.skips.load_state_dict(trainer["skips"])
        self.ckpts.load_rng(path, int(trainer.get("world_size", 1)))

    # -- held-out evaluation, skips, summary ----------------------------------------------------------------------

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
            run_dir=str(self.run_dir), config_hash=self.config.hash(), resume_hash=self.ckpts.resume_hash,
            strategy=self.config.sampler.strategy, world_size=self.dist.world_size,
            data_shards=self.data_shards, parallel=self.engine.kind, device=str(self.device),
            steps=self.step, planned_steps=self.total_steps, complete=self.stop_reason is None,
            stop_reason=self.stop_reason, resumed_from_step=self.resumed_from,
            checkpoint=str(self.ckpts.latest) if self.ckpts.latest else None, last_epoch=last.get("epoch"),
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
        data = load_training_data(config)  # a bad source fails here, before any run folder is made
        run_dir = Path(run_dir) if run_dir is not None else shared_new_run_dir(tag)
        point = prepare_run_dir(config, run_dir)
        parts = build_parts(config, dist.device, point.data_shards, data)
        with StopRequest() as stop:
            return run_training(config, parts, run_dir, setup_s=time.perf_counter() - t0, resume=point.path,
                                stop=stop, sinks=sinks)
    finally:
        if owned:
            distributed.destroy()
