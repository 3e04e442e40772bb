"""The records of a trainer run folder's JSON files, read by any stage without importing train/: one held-out
evaluation's figures (`HeldoutFigures`, held flat as `heldout_<field>` by `WithHeldoutFigures`) and the run's
summary.json (`RunSummary`). Written by train/ (`train.metrics`, `train.summary`); the file names: `rundir.reader`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Self

from dflash_lib.rundir import JsonRecord, omitted


@dataclass
class HeldoutFigures(JsonRecord):
    """One held-out evaluation in figures (`heldout.evaluate`): the first `eval_samples` held-out samples
    (`dflash_lib.data.split`) in fixed batches with fixed anchors, every block fed MASK. The files hold it flat, each
    field as `heldout_<field>` (`HELDOUT_KEYS`), in a metrics.jsonl row and in summary.json."""

    loss: float  # cross-entropy (nats per scored position), weighted as in training; NaN with nothing scored
    acc: float  # top-1 accuracy, weighted as in training
    acc_per_pos: list[float]  # (B-1,) top-1 accuracy per draft position after the anchor, unweighted
    tau: float  # acceptance length (tokens per cycle) of greedy speculative decoding along the stored answers:
    # cycles laid as `evaluate` lays them, from each answer's first token over its first max_new_tokens
    # (`heldout.decoding_walk`); what `evaluate` measures on these prompts when the answers are the target's greedy
    # ones at the evaluation's precision; NaN with no cycle. Older run folders hold tau_anchors here (docs/runs.md)
    eal: float  # marginal-product ESTIMATE of tau_anchors from acc_per_pos (tokens, `expected_acceptance`): it
    # misses how errors correlate within a block
    blocks: int  # random anchor blocks scored
    samples: int  # held-out samples evaluated
    s: float  # seconds the evaluation took
    tau_anchors: float = math.nan  # EXACT mean over the random anchor blocks of 1 + the block's own leading run of
    # correct positions (the in-batch figure, as `tau_inbatch`): each anchor counted once (a stretch the drafter
    # gets right holds many anchors, decoding crosses it in few cycles) and anywhere in the answer (decoding reads
    # its first max_new_tokens), so it strays from decoding either way, answer by answer (docs/runs.md); NaN
    # with no block
    cycles: int = 0  # decoding cycles `tau` averages over


HELDOUT_KEYS = tuple(f"heldout_{f.name}" for f in fields(HeldoutFigures))  # its keys in the files
# keys of files an older trainer wrote (summary.json, a checkpoint's last row), read under today's name; None: a
# copy of another key, dropped
RENAMED_KEYS = {"heldout_eal_marginal": "heldout_eal", "eal_marginal": None}


class WithHeldoutFigures(JsonRecord):
    """A JsonRecord whose `heldout: HeldoutFigures | None` field the JSON object holds flat: the HELDOUT_KEYS in
    its place (none while it is None), so the files keep one flat object per row."""

    @classmethod
    def json_keys(cls) -> list[str]:
        """Every key the JSON object can hold, in order: the fields, `heldout` as the HELDOUT_KEYS."""
        return [k for f in fields(cls) for k in (HELDOUT_KEYS if f.name == "heldout" else (f.name,))]

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        for key, value in super().to_json().items():
            doc.update({f"heldout_{k}": v for k, v in value.items()} if key == "heldout" else {key: value})
        return doc

    @classmethod
    def from_json(cls, source: str | Path | Mapping[str, Any]) -> Self:
        if isinstance(source, (str, Path)):
            try:
                return cls.from_json(json.loads(Path(source).read_text()))
            except ValueError as e:
                raise ValueError(f"{source}: {e}") from None
        if isinstance(source, Mapping) and any(k in source for k in RENAMED_KEYS):
            source = {RENAMED_KEYS.get(k, k): v for k, v in source.items() if RENAMED_KEYS.get(k, k) is not None}
        if isinstance(source, Mapping) and any(k in source for k in HELDOUT_KEYS):
            held = {k.removeprefix("heldout_"): source[k] for k in HELDOUT_KEYS if k in source}
            source = {**{k: v for k, v in source.items() if k not in HELDOUT_KEYS}, "heldout": held}
        return super().from_json(source)


BUDGET_FIGURES = ("token_fill", "query_fill", "bound_tokens", "bound_blocks")  # StepMetrics' budget figures, whose
# run means the summary keeps (`RunSummary`)


@dataclass
class RunSummary(WithHeldoutFigures):
    """A training run in figures, as this invocation leaves it: its summary.json (`to_json`), what `train` returns.
    Throughput and time figures are this invocation's; step, token, loss and skip figures the whole run's."""

    run_dir: str  # the trainer's run folder
    config_hash: str  # `Config.hash()` of the run's config (config.json records the same)
    resume_hash: str  # the hash a checkpoint must carry for this config to resume from it
    strategy: str  # sampler strategy: sorted | random | bucketed | packed
    world_size: int  # ranks of this invocation
    data_shards: int  # batches per sampler step, shared by the ranks (fixed by the run's first invocation)
    parallel: str  # the drafter's wrapper: single | ddp | fsdp
    device: str  # rank 0's torch device
    steps: int  # optimizer steps done
    planned_steps: int  # optimizer steps the lr schedule is planned for
    empty_batches: int  # sampler steps read with nothing to score on any rank (no update, not a step)
    complete: bool  # the run reached its end (False: stopped by `stop_at_step` or a signal)
    stop_reason: str | None  # why it stopped early; None when complete
    resumed_from_step: int  # the step this invocation resumed from; 0 when it started the run
    checkpoint: str | None  # the newest checkpoint folder; None when none was written
    last_epoch: int | None  # epoch of the last step; None without a step
    real_tokens: int  # document tokens trained on, all ranks
    padded_tokens: int  # token slots paid for, padding included, all ranks
    padding_efficiency: float  # real_tokens / padded_tokens
    final_loss: float | None  # the last step's training loss (nats); None without a step
    mean_loss: float | None  # mean of the steps' finite losses (nats)
    final_acc: float | None  # the last step's top-1 accuracy
    mean_acc: float | None  # mean of the steps' accuracies
    final_eal: float | None  # the last step's expected acceptance length (tokens, the marginal-product estimate)
    bad_steps: int  # steps whose loss was not finite (update skipped)
    # How full the batches were in each budget over the whole run: the means of rank 0's metrics rows (`StepMetrics`
    # fields of the same names); None when no step had the figure (no budget, no block budget, a plan that did not
    # say which budget closed its batches):
    token_fill: float | None  # token cost / token budget (padding counted, as the budget counts it)
    query_fill: float | None  # drafter query tokens / block budget
    bound_tokens: float | None  # share of the micro-batches the token budget closed
    bound_blocks: float | None  # share of the micro-batches the block budget closed (a batch both closed: in both)
    skipped_samples: dict[str, int]  # reason -> samples left out by validation, every rank
    skipped_sample_examples: dict[str, list[str]]  # reason -> the first such samples' store indices (as text)
    data_records: dict[str, Any] | None  # the token store's records read, kept and skipped by reason with their
    # first locations (`LoadReport.counts`, the line printed at the start); None for a store without a report
    steady: bool  # the throughput's steady-state detector fired
    steady_start_step: int | None  # first step of the steady window; None before steady state
    steady_ktok_s: float | None  # real-token throughput since steady_start_step (thousand tokens / second)
    ktok_s_last_window: float | None  # the last step's rolling-window throughput (thousand tokens / second)
    data_wait_pct: float | None  # % of this invocation's loop wall time spent waiting for data, at the last step
    steady_data_wait_pct: float | None  # the same over the steady window
    full_run_epochs: float  # epochs of the full run the ETA is for
    full_run_tokens: float  # real tokens of that full run
    full_run_eta_s: float | None  # seconds the full run takes at the steady (else the last window's) throughput
    full_run_eta: str  # the same in words ("5.1d"), " (provisional: no steady state)" appended before steady state
    setup_s: float  # seconds before the trainer: data, run folder, models and sampler built
    loop_s: float  # seconds of the training loop
    wall_s: float  # seconds of the invocation: setup, then the trainer up to this summary
    final_tau_inbatch: float | None  # the last step's EXACT in-batch acceptance length (tokens)
    heldout_fraction: float  # share of the corpus held out of training (`dflash_lib.data.split`); 0 without a split
    heldout_count: int  # samples held out
    # The latest held-out evaluation; absent when the run evaluated none:
    heldout_step: int | None = omitted()  # the optimizer step it followed
    heldout: HeldoutFigures | None = omitted()  # its figures (as a metrics row holds them: flat, HELDOUT_KEYS)
    target_cache: dict[str, int] | None = omitted()  # this rank's `feature_cache.CacheStats` (pipeline.target_cache_gib)
    loop_cpu_s: float | None = omitted()  # this process's CPU seconds (every thread) from the trainer's start to this
    # summary: real_tokens / loop_cpu_s is what a token costs in work, whatever else the machine ran (rank 0's)
