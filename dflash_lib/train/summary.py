"""What a training run reports: `RunLog` (the metric sinks, a notebook's progress bar, the log lines on rank 0),
`run_summary` (summary.json, the last word of a run, read off the trainer; its record: `rundir.records.RunSummary`),
and the per-step figures of a step's batches (`batch_shape`, `budget_fill`). docs/runs.md."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from dflash_lib.config import Config, TrainConfig
from dflash_lib.data.batch import Batch
from dflash_lib.data.validation import SkipCounter
from dflash_lib.plan.sampler.budget import BatchBudget, Bound
from dflash_lib.rundir.reader import METRICS_FILE
from dflash_lib.rundir.records import RunSummary
from dflash_lib.train import distributed
from dflash_lib.train.feed import Item
from dflash_lib.train.metrics import (JsonlSink, NullSink, StepMetrics, WandbSink, eta_seconds, format_duration,
                                     format_log_line)


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


def budget_fill(items: Sequence[Item], budget: BatchBudget | None) -> dict[str, float]:
    """How full a step's micro-batches (this rank's `items`) are in each budget of `budget` (their sampler's rule),
    for the metrics row: token_fill, query_fill (means of `BatchBudget.fill`; a batch's queries are its drafter
    blocks x block size), and bound_tokens, bound_blocks (the share of the batches whose plan says that budget
    closed them; left out when the plan does not say). {} without a budget or a batch."""
    live = [it for it in items if it.batch is not None]
    if budget is None or not live:
        return {}
    tokens, queries = [], []
    for it in live:
        b = it.batch
        lengths = (b.cu_seqlens[1:] - b.cu_seqlens[:-1]).numpy()  # (D,) document tokens
        n_queries = None if it.layout is None else int(it.layout.block_ids.numel())  # blocks x block size
        t, q = budget.fill(lengths, None if n_queries is None else [n_queries], int(b.input_ids.shape[1]))
        tokens.append(t)
        queries.append(q)
    out = {"token_fill": float(np.mean(tokens))}
    if all(q is not None for q in queries):
        out["query_fill"] = float(np.mean(queries))
    known = [Bound(it.bound) for it in live if it.bound >= 0]
    if known:
        out["bound_tokens"] = float(np.mean([Bound.TOKENS in w for w in known]))
        if budget.blocks is not None:
            out["bound_blocks"] = float(np.mean([Bound.BLOCKS in w for w in known]))
    return out


class RunLog:
    """Where the loop reports, on rank 0: the metric sinks (metrics.jsonl, wandb, the caller's), a progress bar
    in a notebook, and `say` for log lines (the bar's write, else `print0`). Other ranks write nothing."""

    def __init__(self, config: Config, run_dir: Path, main: bool, total_steps: int, done_steps: int,
                 extra_sinks: Sequence[Any] = ()) -> None:
        from tqdm.auto import tqdm  # only the progress bar needs it

        r = config.run
        self.sinks = [JsonlSink(run_dir / METRICS_FILE), WandbSink(r.wandb_mode, r.wandb_project, run_dir,
                      config.to_dict(), run_dir.name), *extra_sinks] if main else [NullSink()]
        self.bar = tqdm(total=total_steps, initial=done_steps, unit="step", disable=not (main and in_notebook()))
        self.say: Callable[[str], None] = self.bar.write if not self.bar.disable else distributed.print0

    def log(self, metrics: StepMetrics, step: int, line: bool) -> None:
        """One step's `metrics` to every sink (as its metrics.jsonl row) and the bar; `line`: also as a log line."""
        row = metrics.to_json()
        for sink in self.sinks:
            sink.log(row, step)
        self.bar.update(1)
        if line:
            self.say(format_log_line(row))

    def close(self) -> None:
        self.bar.close()
        for sink in self.sinks:
            sink.close()


def run_summary(trainer: Any, skips: SkipCounter) -> RunSummary:
    """The run in figures as `trainer` (a `loop.Trainer`: not imported, loop imports this module) leaves it now;
    `skips` = every rank's skipped samples (`Trainer.all_skips`)."""
    t = trainer
    m, p, tc = t.meter, t.progress, t.config.train
    last, steady = p.last, m.detector.steady
    ktok_s = last.ktok_s if last is not None else None
    tok_s = m.steady_tok_s or (ktok_s or 0.0) * 1000.0  # last window's rate without a steady state
    full_eta = eta_seconds(t.full_tokens, tok_s)
    heldout, data = t.parts.heldout, t.data_report()
    return RunSummary(
        run_dir=str(t.run_dir), config_hash=t.config.hash(), resume_hash=t.ckpts.resume_hash,
        strategy=t.config.sampler.strategy, world_size=t.dist.world_size,
        data_shards=p.data_shards, parallel=t.parallel.kind, device=str(t.device),
        steps=p.step, planned_steps=p.total_steps, empty_batches=p.empty_batches,
        complete=t.stop_reason is None,
        stop_reason=t.stop_reason, resumed_from_step=p.resumed_from,
        checkpoint=str(t.ckpts.latest) if t.ckpts.latest else None,
        last_epoch=last.epoch if last is not None else None,
        real_tokens=m.real_tokens, padded_tokens=m.padded_tokens,
        padding_efficiency=m.real_tokens / max(1, m.padded_tokens),
        final_loss=last.loss if last is not None else None, mean_loss=p.loss_mean.mean,
        final_acc=last.acc if last is not None else None, mean_acc=p.acc_mean.mean,
        final_eal=last.eal if last is not None else None, bad_steps=t.guard.total,
        **{k: mean.mean for k, mean in p.budget_means.items()},
        skipped_samples=dict(skips.counts), skipped_sample_examples=dict(skips.examples),
        data_records=data.counts() if data is not None else None,
        steady=steady, steady_start_step=m.detector.start_step,
        steady_ktok_s=tok_s / 1000.0 if steady else None, ktok_s_last_window=ktok_s,
        data_wait_pct=last.data_wait_pct_total if last is not None else None,
        steady_data_wait_pct=m.steady_data_wait_pct,
        full_run_epochs=tc.full_run_epochs, full_run_tokens=t.full_tokens, full_run_eta_s=full_eta,
        full_run_eta=format_duration(full_eta) + ("" if steady else " (provisional: no steady state)"),
        setup_s=t.setup_s, loop_s=m.elapsed_s, wall_s=t.setup_s + t.clock() - t.t_start,
        final_tau_inbatch=last.tau_inbatch if last is not None else None,
        heldout_fraction=heldout.fraction if heldout is not None else 0.0,
        heldout_count=len(heldout.heldout) if heldout is not None else 0,
        heldout_step=t.heldout.latest_step, heldout=t.heldout.latest,
        **({} if t.cache is None else {"target_cache": asdict(t.cache.stats)}),
        loop_cpu_s=time.process_time() - t.cpu_start,
    )
