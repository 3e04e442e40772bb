"""`train(config, run_dir) -> summary`: the drafter training loop. `Trainer.run` reads top to bottom: batch in
(`feed`, `pipeline`), drafter step (`step.train_step`), metrics and held-out evaluations (`metrics`, `heldout`),
checkpoint (`checkpoint.TrainingCheckpoints`), stop (planned steps, `stop_at_step`, SIGTERM/SIGINT on any rank),
then drafter/ and summary.json (`RunSummary`). What it runs on is built by `build.build_parts`,
`resume.prepare_run_dir` and `distributed.wrap_drafter`. Exact resume, precision, empty reads and stops:
docs/runs.md, "Training outside notebooks" and "Runs that survive: resume, stop, torchrun".
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

from dflash_lib.config import Config, ConfigError, uses_bf16
from dflash_lib.data.validation import SkipCounter
from dflash_lib.models.export import run_info, save_drafter
from dflash_lib.models.loss import subnormals_flushed
from dflash_lib.rundir import write_json
from dflash_lib.rundir.checkpoints import load_objects
from dflash_lib.rundir.reader import CHECKPOINTS, DRAFTER_DIR, SUMMARY_FILE
from dflash_lib.rundir.records import RunSummary
from dflash_lib.target.feature_cache import FeatureCache
from dflash_lib.target.open import check_target, engine_url
from dflash_lib.target.sharded import per_step_passes
from dflash_lib.train import distributed
from dflash_lib.train.build import TrainingParts, build_parts, load_training_data
from dflash_lib.train.checkpoint import TrainingCheckpoints
from dflash_lib.train.distributed import all_reduce_floats, any_rank, gather_states, rank_shards
from dflash_lib.train.feed import (Item, NothingTrainedError, epoch_batches, make_collate, make_prepare,
                                   make_target_workers, next_step_items)
from dflash_lib.train.heldout import HeldOutEvaluator
from dflash_lib.train.metrics import StepMetrics, ThroughputMeter, eta_seconds
from dflash_lib.train.pipeline import Pipeline
from dflash_lib.train.resume import prepare_run_dir, resume_config_hash, shared_new_run_dir
from dflash_lib.train.schedule import lr_at, noise_at, count_steps
from dflash_lib.train.state import BadStepGuard, Progress, StopRequest
from dflash_lib.train.step import build_optimizer, filler_item, train_step
from dflash_lib.train.summary import RunLog, batch_shape, budget_fill, full_run_tokens, run_summary


class Trainer:
    """One training run over `parts`: the loop, its metrics, its checkpoints and its outputs (see `run_training`)."""

    def __init__(self, config: Config, parts: TrainingParts, run_dir: Path, clock: Callable[[], float],
                 setup_s: float, resume: Path | None = None, stop: StopRequest | None = None,
                 sinks: Sequence[Any] = ()) -> None:
        self.config, self.parts, self.run_dir, self.clock, self.setup_s = config, parts, run_dir, clock, setup_s
        self.extra_sinks = list(sinks)  # more `log(metrics, step)` / `close()` sinks on rank 0 (e.g. a live figure)
        self.t_start = clock()
        self.cpu_start = time.process_time()  # this process's CPU seconds, every thread (the summary's loop_cpu_s)
        tc, self.dist = config.train, distributed.info()
        self.main = self.dist.rank == 0
        self.device = parts.targets[0].device
        self.parallel = distributed.wrap_drafter(parts.drafter, tc.parallel)  # DDP / FSDP2 / one process
        self.params = [p for p in parts.drafter.parameters() if p.requires_grad]  # FSDP: the DTensor shards
        self.opt = build_optimizer(self.params, tc, self.device)
        self.ckpts = TrainingCheckpoints(run_dir / CHECKPOINTS, parts.drafter, self.opt, tc, resume_config_hash(config),
                                         config.to_dict())
        self.shards = rank_shards(self.dist.rank, self.dist.world_size, parts.data_shards)
        total_steps, self.max_batches = count_steps(tc, len(parts.sampler), int(parts.lengths.sum()),
                                                   parts.data_shards)
        self.progress = Progress(total_steps, parts.data_shards)
        self.filler = (filler_item(parts.drafter, self.device) if self.parallel.kind != "single"
                       else None)
        self.guard = BadStepGuard(tc.max_bad_steps, checkpoints=run_dir / CHECKPOINTS)
        self.skips = SkipCounter()  # this rank's skipped samples
        self.empty_in_a_row = 0  # sampler steps read in a row with nothing scored (a whole epoch: nothing to learn)
        self.empty_wait_s = 0.0  # data wait of those reads, added to the next step's (its wall time holds them)
        self.full_tokens = full_run_tokens(tc, parts.lengths)
        self.meter = ThroughputMeter(clock=clock)
        self.stop = stop if stop is not None else StopRequest()
        self.stop_reason: str | None = None  # why the loop ended early (None = it ran to the end)
        self.given_up: Exception | None = None  # the next step's failure a stop ended the loop on (`_gave_up`)
        self.heldout = HeldOutEvaluator(tc, config.sampler.token_budget, parts, self.parallel, self.main,
                                        config.regenerate.max_new_tokens, config.evaluate.stop_at_eos)
        gib = config.pipeline.target_cache_gib
        self.cache = FeatureCache(int(gib * 2**30)) if gib > 0 else None  # the target's features per sample
        if resume is not None:
            self.load(Path(resume))

    # -- the loop -----------------------------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        """Batch in (target features computed in the pipeline), drafter step and optimizer, metrics, checkpoint,
        stop; then the drafter and summary.json. Returns the summary."""
        tc, p = self.config.train, self.progress
        log = RunLog(self.config, self.run_dir, self.main, p.total_steps, p.step, self.extra_sinks)
        if self.data_report() is not None:  # what the token store read, kept and skipped
            log.say(self.data_report().summary_line())
        if p.resumed_from:
            log.say(f"resuming at step {p.resumed_from} of {p.total_steps} (epoch {p.position[0]}, "
                    f"sampler step {p.position[1]})")
        self.parts.drafter.train()
        self.heldout.prepare(self.run_dir)
        try:
            with self._pipeline() as pipeline, subnormals_flushed(self.device, self.config.model.loss):
                stream = iter(pipeline)
                self.meter.start()
                while p.step < p.total_steps and not self._stopping():
                    # every rank reads the same optimizer step structure (`epoch_batches`): they end together
                    try:
                        items, wait_s, ended = next_step_items(stream, lambda: pipeline.last_wait_s)
                    except Exception as e:  # noqa: BLE001 - re-raised unless a stop gave up on the next step
                        if not self._gave_up(e, log.say):
                            raise
                        break
                    if not items:
                        break
                    record = self._train_one(items, wait_s, pipeline)
                    if record is None:  # nothing scored on any rank: not a training step
                        self._report_empty(items, log.say)
                        if ended:
                            break
                        continue
                    p.last = record
                    if self.heldout.due(p.step, final=self._final_step(ended)):
                        p.last = replace(p.last, heldout=self.heldout.run(p.step, log.say))
                    log.log(p.last, p.step, line=p.step % tc.log_every == 0 or p.step == p.total_steps or ended)
                    self._report_faults(items, log.say)
                    if tc.ckpt_every > 0 and p.step % tc.ckpt_every == 0:
                        self.save(log.say)
                    if ended:
                        break
                self.heldout.after_loop(p.step, self.stop_reason is not None, log.say)
                if p.step > max(self.ckpts.saved_step, 0):  # the end, a stop signal or stop_at_step
                    self.save(log.say)
                self.ckpts.finish(log.say)  # an async save commits before the run reports
                if self.stop_reason is not None:
                    self._close_after_stop(pipeline, log.say)
        finally:
            log.close()
        return self._finish(log.say)

    def _stopping(self) -> bool:
        """Stop before the next step (`stop_at_step` reached, or a stop signal on any rank: every rank stops after
        the same step); records why in `stop_reason`."""
        tc = self.config.train
        if 0 < tc.stop_at_step <= self.progress.step:
            self.stop_reason = f"stop_at_step={tc.stop_at_step}"
        elif any_rank(self.stop.requested):
            self.stop_reason = self.stop.reason or "a stop signal on another rank"
        return self.stop_reason is not None

    def _gave_up(self, error: Exception, say: Callable[[str], None]) -> bool:
        """Whether the loop ends as on a stop when the next step's inputs failed with `error`: a stop was asked
        (a served target's engine then gives up its requests after `STOP_WAIT_S`, `stop_waiting`) and this is
        the only process; the model and optimizer are those of the last finished step, checkpointed next. Under
        torchrun the other ranks may be inside that step's collectives: the error stands (resume from the
        previous checkpoint)."""
        if not self.stop.requested or self.dist.world_size > 1:
            return False
        self.stop_reason = self.stop.reason
        self.given_up = error
        say(f"the step after step {self.progress.step} is given up on the stop: {' '.join(str(error).split())}")
        return True

    def _close_after_stop(self, pipeline: Pipeline, say: Callable[[str], None]) -> None:
        """Close the pipeline after a stop without raising the failure of a stage that was reading past the last
        step (its items are never trained on: a served target's engine given up on the stop); said in one line."""
        pipeline.close(raise_failure=False)
        failure = pipeline.failure
        if failure is not None and failure.error is not getattr(self.given_up, "__cause__", None):
            say(f"after the stop, stage {failure.stage!r} failed reading past step {self.progress.step} (nothing "
                f"trained on it): {type(failure.error).__name__}: {' '.join(str(failure.error).split())}")

    def _final_step(self, ended: bool) -> bool:
        """The step just taken is the run's last: the planned steps are done or the sampler's batches used up."""
        p = self.progress
        return (p.step == p.total_steps or ended
                or (self.max_batches is not None and p.batches_done >= self.max_batches))

    def _pipeline(self) -> Pipeline:
        parts, cfg, p = self.parts, self.config, self.progress
        prepare = make_prepare(parts.drafter, cfg.train.seed, lambda index: noise_at(index, cfg.train))
        static = cfg.sampler.static_shapes
        collate = make_collate(parts.store, parts.packed, parts.pad_id, parts.row_len, parts.edges,
                               parts.drafter.cfg.vocab_size, pad_to_edge=static and not parts.packed, prepare=prepare,
                               pack_multiple=0 if static else cfg.sampler.pack_multiple)
        sharded = parts.target_parallel == "fsdp"  # its passes are collectives: one worker, as many on every rank
        workers = make_target_workers(parts.targets, 1 if sharded else cfg.pipeline.target_workers, self.device,
                                      cfg.pipeline.target_threads, passes_per_step=per_step_passes(
                                          parts.data_shards, self.dist.world_size) if sharded else 0,
                                      cache=self.cache)
        source = epoch_batches(parts.sampler, self.max_batches, p.position, p.batches_done, self.shards,
                               parts.lengths, cfg.train.accum_tokens, parts.data_shards)
        return Pipeline(source, collate, workers, cfg.pipeline, pin_memory=self.device.type == "cuda",
                        clock=self.clock)

    def _train_one(self, items: list[Item], wait_s: float, pipeline: Pipeline) -> StepMetrics | None:
        """One optimizer step on `items`; advances the progress and returns the step's metrics record. None when
        no rank scored a token (the step's global weight sum is 0, the same on every rank): no update was made
        and no step is counted, only the data consumed; NothingTrainedError after a whole epoch of those."""
        tc, p = self.config.train, self.progress
        # steps are numbered from 1 in logs (this one is p.step + 1); the schedules take the 0-based index
        lr = lr_at(p.step, p.total_steps, tc)
        noise = next((it.layout.noise for it in items if it.layout is not None), noise_at(p.batches_done, tc))
        res = train_step(self.parallel, items, self.params, self.opt, lr, tc.grad_clip,
                         uses_bf16(tc.precision, self.device), self.guard, p.step + 1, self.filler)
        p.position = (items[-1].epoch, items[-1].step + 1)
        read = sum(it.last_shard for it in items)  # sampler steps
        p.batches_done += read
        skipped_tokens = 0
        for it in items:
            for reason, index, tokens in it.skips:
                self.skips.add(reason, self._store_index(index))
                skipped_tokens += tokens
        n_skipped, skipped_tokens = all_reduce_floats([sum(len(it.skips) for it in items), skipped_tokens])
        p.skipped_samples += int(n_skipped)
        if not res.weight_sum > 0:
            p.empty_batches += read
            self.empty_in_a_row += read
            self.empty_wait_s += wait_s
            if self.empty_in_a_row >= len(self.parts.sampler):  # every later epoch reads the same samples
                raise NothingTrainedError(
                    f"nothing to train on in a whole epoch ({self.empty_in_a_row} sampler step(s) in a row without a "
                    f"token to score) after {p.step} training steps: {self.all_skips().summary()}")
            return None
        self.empty_in_a_row = 0
        wait_s, self.empty_wait_s = wait_s + self.empty_wait_s, 0.0
        p.step += 1
        rate = self.meter.step(p.step, res.real_tokens, res.padded_tokens, wait_s)
        done = self.meter.real_tokens
        per_step = done / p.step  # real tokens per step so far (a resumed run's steps included)
        end = min(p.total_steps, tc.stop_at_step) if tc.stop_at_step > 0 else p.total_steps  # this invocation's
        p.loss_mean.add(res.loss)
        p.acc_mean.add(res.acc)
        fill = budget_fill(items, getattr(self.parts.sampler, "batch_budget", None))
        for k, value in fill.items():
            p.budget_means[k].add(value)
        live = [it.batch for it in items if it.batch is not None]
        return StepMetrics(
            step=p.step, epoch=items[-1].epoch, loss=res.loss, acc=res.acc, lr=lr, noise=noise,
            real_tokens=res.real_tokens, padded_tokens=res.padded_tokens, ktok_s=rate.ktok_s,
            data_wait_pct=rate.data_wait_pct_window, data_wait_pct_total=rate.data_wait_pct,
            **pipeline.depths(), bucket=live[0].bucket if live else -1,
            eta_s=eta_seconds((end - p.step) * per_step, rate.eta_tok_s),
            run_eta_s=eta_seconds((p.total_steps - p.step) * per_step, rate.eta_tok_s),
            full_run_eta_s=eta_seconds(self.full_tokens - done, rate.eta_tok_s),
            steady=rate.steady, acc_per_pos=res.acc_per_pos, eal=res.eal,
            tau_inbatch=res.tau_inbatch, time=self.clock() - self.t_start,
            grad_norm=res.grad_norm, micro_batches=len(items), skipped=res.skipped, step_s=rate.dt_s, wait_s=wait_s,
            blocks=res.blocks, head_rows=res.head_rows,
            bad_steps=self.guard.total, skipped_samples=p.skipped_samples, skipped_tokens=int(skipped_tokens),
            **(batch_shape(live) if live else {}),
            **fill,
        )

    def _report_faults(self, items: list[Item], say: Callable[[str], None]) -> None:
        """Log what this step skipped: samples failing validation, or the whole update for a non-finite loss."""
        step = self.progress.step
        skipped = [f"{reason} (sample {self._store_index(index)})" for it in items for reason, index, _ in it.skips]
        if skipped:
            say(f"step {step}: skipped {len(skipped)} sample(s) failing validation: {', '.join(skipped[:5])}"
                f"{' ...' if len(skipped) > 5 else ''}")
        if self.guard.last_bad_step == step:
            say(f"step {step}: loss is not finite ({self.progress.last.loss}): update skipped "
                f"({self.guard.in_a_row} in a row, {self.guard.total} in all; {self.guard.max_in_a_row} in a row "
                f"abort the run)")

    def _report_empty(self, items: list[Item], say: Callable[[str], None]) -> None:
        """Log a read that trained nothing (`_train_one` returned None) and why: the samples failing validation."""
        skipped = [f"{reason} (sample {self._store_index(index)})" for it in items for reason, index, _ in it.skips]
        why = (f"samples failing validation: {', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}" if skipped
               else "no anchor block with a position to score")
        say(f"epoch {items[-1].epoch}, sampler step {items[-1].step}: nothing to score ({why}); not a training step "
            f"(no update, {self.progress.step} steps so far)")

    def _finish(self, say: Callable[[str], None]) -> RunSummary:
        """After the loop: rank 0 writes drafter/ (every rank joins the weights' gather) and summary.json; a stop
        says how to resume. Returns the summary. A run that read batches but trained on none of them raises
        NothingTrainedError and writes neither."""
        p = self.progress
        skips = self.all_skips()
        if p.step == 0 and self.stop_reason is None:
            if p.empty_batches:
                raise NothingTrainedError(f"trained on nothing: none of the {p.empty_batches} sampler steps read "
                                          f"had a token to score ({skips.summary()}); no drafter written")
            raise ConfigError("training ran no step: the sampler produced no batch")
        summary = run_summary(self, skips)
        weights = self.parallel.full_weights() if p.step > 0 else {}  # a collective under FSDP
        if self.main:
            if p.step > 0:
                save_drafter(self.parts.drafter, self.run_dir / DRAFTER_DIR, weights,
                             **run_info(self.config.model, self.config.train.seed, self.config.data.template,
                                        f"{self.run_dir} (step {p.step})", self.config.data))
            write_json(self.run_dir / SUMMARY_FILE, summary.to_json())
        if self.stop_reason is not None:
            say(f"stopped ({self.stop_reason}) after step {p.step} of {p.total_steps}; "
                f"{'checkpoint ' + str(self.ckpts.latest) if self.ckpts.latest else 'nothing to checkpoint yet'}; "
                f"run the same command again to resume")
        if skips.total:
            say(skips.summary())
        if self.cache is not None:
            c = self.cache.stats
            say(f"target feature cache: {c.hit_batches} of {c.hit_batches + c.miss_batches} batches without a target "
                f"forward; {c.samples} samples held ({c.bytes / 2**30:.2f} GiB), {c.refused} refused (budget full)")
        return summary

    # -- checkpoints --------------------------------------------------------------------------------------------------

    def save(self, say: Callable[[str], None]) -> None:
        """Checkpoint the step just finished (a collective: every rank calls it)."""
        self.ckpts.save(self.progress.step, self.progress.position[0], self._trainer_state, say)

    def _trainer_state(self) -> dict[str, Any]:
        """`Progress.state_dict` of this step, every rank's skipped samples merged (a collective)."""
        return self.progress.state_dict(self.dist.world_size, self.guard, self.meter, self.all_skips(),
                                        self.parts.sampler)

    def load(self, path: Path) -> None:
        """Continue from the checkpoint at `path` (verified by `prepare_run_dir`), at this run's world size and
        wrapper. Refuses one that does not fit this run with CheckpointError."""
        state = load_objects(path).get("trainer") or {}
        self.progress.check(state, f"checkpoint {path}")
        self.ckpts.load(path, int(state["step"]))
        self.progress.load_state_dict(state, self.guard, self.meter, self.parts.sampler)
        if self.main:  # the merged skip counts live on rank 0; the summary merges every rank's
            self.skips.load_state_dict(state["skips"])
        self.ckpts.load_rng(path, int(state.get("world_size", 1)))

    # -- skips, the data report ---------------------------------------------------------------------------------------

    def _store_index(self, index: int) -> int:
        """The token store's index of sample `index` of the training view (the same without a held-out split)."""
        source_index = getattr(self.parts.store, "source_index", None)
        return index if source_index is None else source_index(index)

    def data_report(self) -> Any:
        """The token store's LoadReport (records read, kept, skipped by reason with examples); None for a
        store that has none (a stand-in)."""
        store = self.parts.full_store if self.parts.full_store is not None else self.parts.store
        return getattr(store, "report", None)

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


def run_training(config: Config, parts: TrainingParts, run_dir: Path,
                 clock: Callable[[], float] = time.perf_counter, setup_s: float = 0.0,
                 resume: Path | None = None, stop: StopRequest | None = None,
                 sinks: Sequence[Any] = ()) -> RunSummary:
    """Train on `parts`; returns the summary. `sinks`: more metric sinks on rank 0 (`log(metrics, step)`,
    `close()`), e.g. `report.training.LiveFigure` in a notebook. `clock` (seconds) times steps and data waits;
    `setup_s` (seconds spent building the parts) is recorded. `resume`: a checkpoint directory to continue from
    (see `train`); `stop`: an entered StopRequest whose signal ends the loop after the current step (default:
    none).

    Rank 0 writes into `run_dir`: metrics.jsonl, one `StepMetrics` row per step (held-out figures on evaluation
    steps), the same scalars to wandb; heldout.json (the split: fraction, hash rule, counts, held-out store
    indices and hashes); checkpoints/ckpt-<step>/ every `ckpt_every` steps, on a stop and at the end (the newest
    `keep_checkpoints` kept); and at the end drafter/ and summary.json (`RunSummary`).
    """
    return Trainer(config, parts, run_dir, clock, setup_s, resume, stop, sinks).run()


def train(config: Config, run_dir: Path | None = None, tag: str = "", sinks: Sequence[Any] = ()) -> RunSummary:
    """Train a drafter with `config`; returns the summary (also in run_dir/summary.json).

    run_dir: the run folder (created if missing; default a new runs/<UTC>_train[_tag]/). It receives
    config.json, env.json, metrics.jsonl (every step), wandb's offline files, checkpoints/ (see run_training),
    drafter/ and summary.json. A folder holding a checkpoint of the same config (resume hash) RESUMES from its
    newest good checkpoint, at any world size and with either wrapper (the global batches stay those of the run's
    first invocation: its data shards); another config's checkpoints or other content without a checkpoint are
    refused with an error unless `fresh=True`, which clears it first.
    SIGTERM/SIGINT during the loop: the current step finishes, a checkpoint is saved, and train() returns
    (summary.complete is False; before the loop they keep their default effect: nothing to save yet); a step
    whose inputs a hung engine holds is given up instead (one process: `Trainer._gave_up`).
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
        source = check_target(config, dist.world_size, dist.device, data.full_store.meta["key"])  # and a bad target
        run_dir = Path(run_dir) if run_dir is not None else shared_new_run_dir(tag)
        point = prepare_run_dir(config, run_dir)
        with contextlib.ExitStack() as on:
            source = on.enter_context(engine_url(config, source, run_dir, dist.device, dist.rank))
            parts = build_parts(config, dist.device, point.data_shards, data, source)
            for target in parts.targets:
                on.callback(target.close)
            with StopRequest() as stop:
                stop.on_request += [t.stop_waiting for t in parts.targets if hasattr(t, "stop_waiting")]
                return run_training(config, parts, run_dir, setup_s=time.perf_counter() - t0, resume=point.path,
                                    stop=stop, sinks=sinks)
    finally:
        if owned:
            distributed.destroy()
