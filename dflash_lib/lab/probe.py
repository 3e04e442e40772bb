"""Throughput probes: every batching strategy trained briefly on the same data, model and token budget, measured
side by side, and the step-time cost model calibrated on (and checked against) those measurements.

Per strategy the probe reports real-token throughput at steady state (warm-up discarded by the trainer's
steady-state detector), its ratio to sorted batches, the padding efficiency PREDICTED before running (bucketed:
the analytic plan, as the reference run did; the others: their epoch plans) and the one REALIZED on the probe's steps,
how full its measured batches were in the token and the block budget and which budget closed them (the trainer's
`token_fill`, `query_fill`, `bound_tokens`, `bound_blocks`), steps per epoch, the ETA of a configurable full run
(`full_run_eta_days`), and the randomness figures of its sampler.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from dflash_lib.config import Config, ConfigError, from_params
from dflash_lib.data import build_token_store_from_config
from dflash_lib.data.stats import store_drafter_queries
from dflash_lib.plan.buckets import SampleCost, bucket_of, plan_for_edges
from dflash_lib.plan.costmodel import (CostModelChoice, CostModelError, StepObservation, attention_q_from_fit,
                                       held_out_noise, select_cost_model, throughput_rel_sd)
from dflash_lib.plan.sampler import packing_efficiency, padding_efficiency, randomness
from dflash_lib.train.build import bucket_edges, build_sampler
from dflash_lib.train.loop import train
from dflash_lib.rundir.reader import load_metrics
from dflash_lib.rundir.records import RunSummary

STRATEGIES = ("sorted", "random", "bucketed", "packed")  # the demo's summary needs these four
# plus bucketed with static shapes (rows padded to the bucket edge): the one strategy whose padding is
# deliberate, so the fit can tell per-slot from per-real-token cost without leaning on random's steps
PROBES = (*STRATEGIES, "static")
RESUME_WARMUP = 2  # steps left out after a probe chunk resumes (pipeline refill, first-step allocations)
FILLS = ("token_fill", "query_fill", "bound_tokens", "bound_blocks")  # the trainer's budget figures, per step


@dataclass
class StrategyProbe:
    """One strategy's probe run and what it measured."""

    strategy: str
    run_dir: Path  # the strategy's training run folder
    summary: RunSummary  # the trainer's summary (its summary.json) of the last invocation
    observations: list[StepObservation]  # steady-state steps (or the last half when never steady)
    steady: bool  # the detector found a steady state (else throughput is the last window's, provisional)
    ktok_s: float  # real Ktok/s over the observed steps
    predicted_efficiency: float  # real / padded tokens predicted before running
    realized_efficiency: float  # real / padded tokens over the observed steps
    steps_per_epoch: int  # batches in one epoch of this sampler
    full_run_eta_days: float | None  # the full run (full_run_epochs over the corpus) at this throughput, days
    co_batch_recurrence: float  # fraction of co-batched pairs batched together again next epoch
    lag1: float  # lag-1 correlation of consecutive batch lengths
    fills: dict[str, float] = field(default_factory=dict)  # FILLS -> mean over the observed steps
    # (token_fill: token cost / token budget; query_fill: drafter queries / block budget; bound_*: share of the
    # batches that budget closed); a figure the trainer did not write is left out


def strategy_config(base: Config, strategy: str, steps: int, stop_at_step: int = 0) -> Config:
    """`base` with the strategy and probe length replaced (everything else, budget included, identical), no
    periodic checkpoint, no held-out evaluation (`eval_samples` 0: none at the end either, whose drafter of a
    few steps nobody reads, and which took longer than the probe's steps on the demo) and no target feature
    cache: a probe measures training throughput, target included; an evaluation inside it would distort it."""
    if strategy not in PROBES:
        raise ConfigError(f"strategy {strategy!r} is not one of {list(PROBES)}")
    sampler = dict(strategy="bucketed", static_shapes=True) if strategy == "static" else dict(strategy=strategy)
    return from_params({**sampler, "steps": steps, "ckpt_every": 0, "eval_every": 0, "eval_samples": 0,
                        "stop_at_step": stop_at_step,
                        "target_cache_gib": 0.0}, base)


def predicted_efficiency(config: Config, sampler: Any, lengths: np.ndarray, edges: Sequence[int]) -> float:
    """Padding efficiency known before training. bucketed: the plan's analytic prediction (the objective of the
    buckets section under the sampler's budgets, the reference run's kind of estimate); sorted / random / packed /
    static shapes: exact, from the epoch-0 plan."""
    s = config.sampler
    batches = sampler.epoch_plan(0).csr()
    if s.strategy == "packed":  # rows as `collate_packed` makes them: their tokens rounded up, or full (static)
        return float(packing_efficiency(batches, lengths, s.token_budget, 0 if s.static_shapes else s.pack_multiple))
    if s.static_shapes:  # every row padded to its bucket's upper edge
        idx, off = batches
        longest = np.maximum.reduceat(lengths[idx], off[:-1])  # (S,) longest sample of each batch
        edge = np.asarray(edges)[bucket_of(longest, edges)]  # (S,) the edge each batch is padded to
        return float(lengths[idx].sum() / (edge * np.diff(off)).sum())
    if s.strategy == "bucketed":
        q = SampleCost(config.buckets.cost, config.buckets.q).q
        plan = plan_for_edges(lengths, edges, max_len=config.data.max_len, objective=config.buckets.objective,
                              cost=config.buckets.cost, q=q, token_budget=s.token_budget,
                              policy=config.data.policy, queries=sampler.queries, block_budget=sampler.block_budget)
        return float(plan.efficiency)
    return float(padding_efficiency(batches, lengths))


def observations(metrics: pd.DataFrame, start_step: int, attention: str = "attn_varlen",
                 run: str = "probe", padded_kernel: bool = False) -> list[StepObservation]:
    """Cost-model observations from a run's metrics: the steps from `start_step` on (warm-up left out), less the
    steps that ran no batch (every sample failed validation: no shape, nothing to price).

    attention: "attn_varlen" (sum of doc_len^2: what the target pays with either backend, flash-attn varlen or
    per-document SDPA) or "attn_dense" (R * T^2: a backend that computes whole rows under a mask).
    padded_kernel: the run computed every slot (`static_shapes`); else its padding is not priced.
    """
    if attention not in ("attn_dense", "attn_varlen"):
        raise ConfigError(f"attention must be 'attn_dense' or 'attn_varlen', got {attention!r}")
    missing = {"rows", "row_len", "real_tokens", "blocks", "step_s", attention} - set(metrics.columns)
    if missing:
        raise ConfigError(f"metrics lack {sorted(missing)}: written by an older trainer?")
    part = metrics[(metrics["step"] >= start_step) & (metrics["step_s"] > 0) & metrics["rows"].notna()]
    return [StepObservation(rows=int(r.rows), row_len=int(r.row_len), real_tokens=int(r.real_tokens),
                            attention=float(getattr(r, attention)), blocks=int(r.blocks), seconds=float(r.step_s),
                            run=run, padded_kernel=padded_kernel)
            for r in part.itertuples()]


def budget_figures(metrics: pd.DataFrame) -> dict[str, float]:
    """FILLS -> their mean over the steps of `metrics` that have them (how full the batches were in each budget,
    and the share of them each budget closed); a figure no step has is left out."""
    return {k: float(metrics[k].mean()) for k in FILLS if k in metrics.columns and metrics[k].notna().any()}


def measure_probe(cfg: Config, strategy: str, run_dir: Path, first: RunSummary, last: RunSummary,
                  resumed_at: Sequence[int] = (), attention: str = "attn_varlen") -> StrategyProbe:
    """Measure the probe run of `strategy` in `run_dir` (config `cfg`): `first` and `last` are the trainer
    summaries of its first and last invocations; `resumed_at` the steps after which it was stopped and resumed.

    Warm-up left out: the steps before the steady state the first invocation's detector found (without one:
    the first half of the first invocation's steps), and the first RESUME_WARMUP steps after every resume."""
    metrics = load_metrics(run_dir)
    steady = first.steady
    first_steps = metrics[metrics["step"] <= first.steps]
    start = (int(first.steady_start_step) if steady
             else int(first_steps["step"].iloc[len(first_steps) // 2]) if len(first_steps) else 1)
    resumed = np.zeros(len(metrics), dtype=bool)
    for step in resumed_at:
        resumed |= metrics["step"].between(step + 1, step + RESUME_WARMUP).to_numpy()
    measured = metrics[~resumed]
    obs = observations(measured, start, attention, "probe", padded_kernel=cfg.sampler.static_shapes)
    if not obs:
        raise ConfigError(f"probe {strategy}: no step to measure in {run_dir}; raise probe_steps")
    lengths, queries = _lengths_and_queries(cfg)
    edges = bucket_edges(cfg, lengths, queries=queries) if cfg.sampler.strategy == "bucketed" else []
    sampler = build_sampler(cfg, lengths, 0, 1, edges, queries)  # the block budget too, as training's sampler
    stats = randomness(sampler, edges or [int(lengths.max())])
    real = sum(o.real_tokens for o in obs)
    tok_s = real / sum(o.seconds for o in obs)
    part = measured[measured["step"] >= start]
    realized = float(part["real_tokens"].sum() / part["padded_tokens"].sum())
    full_tokens = float(last.full_run_tokens)
    return StrategyProbe(strategy, run_dir, last, obs, steady, tok_s / 1000.0,
                         predicted_efficiency(cfg, sampler, lengths, edges), realized, len(sampler),
                         full_tokens / tok_s / 86400.0, float(stats.recurrence), float(stats.lag1),
                         budget_figures(part))


def _lengths_and_queries(cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """(N,) tokens and (N,) drafter query tokens per sample of the store, as `build.build_parts` reads them."""
    store = build_token_store_from_config(cfg.data, progress=False)
    queries = store_drafter_queries(store, cfg.model.num_anchors, cfg.model.block_size)
    return np.asarray(store.lengths), queries


def run_probes(base: Config, out_dir: Path, steps: int, strategies: Sequence[str] = PROBES,
               attention: str = "attn_varlen", rounds: int = 1) -> list[StrategyProbe]:
    """Train every strategy for `steps` steps, each into out_dir/<strategy>/, then measure them.

    rounds > 1: each run is trained in `rounds` chunks and the strategies take turns (every strategy's chunk 1,
    then every strategy's chunk 2, ...), each chunk resuming its run from the checkpoint the previous one left.
    A slow drift of the machine's speed (other jobs, heat) then falls on every strategy alike instead of on
    whichever ran last; the steps right after each resume are left out (`measure_probe`)."""
    if not 1 <= rounds <= steps:
        raise ConfigError(f"probe_rounds must be in [1, probe_steps={steps}], got {rounds}")
    ends = [round(steps * (r + 1) / rounds) for r in range(rounds)]  # last step of each chunk
    first: dict[str, RunSummary] = {}
    last: dict[str, RunSummary] = {}
    for end in ends:
        for s in strategies:
            cfg = strategy_config(base, s, steps, stop_at_step=end if end < steps else 0)
            last[s] = train(cfg, Path(out_dir) / s)
            first.setdefault(s, last[s])
    return [measure_probe(strategy_config(base, s, steps), s, Path(out_dir) / s, first[s], last[s], ends[:-1],
                          attention) for s in strategies]


def calibrate(probes: Sequence[StrategyProbe]) -> CostModelChoice:
    """Fit the step-time model on every strategy's steady steps; its leave-one-out says how well it predicts a
    strategy it never saw."""
    return select_cost_model({p.strategy: p.observations for p in probes})


def probe_table(probes: Sequence[StrategyProbe], choice: CostModelChoice | None = None,
                noise_draws: int = 200) -> pd.DataFrame:
    """One row per strategy, side by side (see the module docstring); `ktok_s_noise_pct`: two bootstrap standard
    deviations of the measured throughput, in %. With `choice`: the cost model's held-out prediction and its
    error, next to the padding-only prediction the reference run used (sorted throughput scaled by predicted
    efficiency). `nested_*`: the same prediction with the choice of terms also made without the strategy (the
    honest estimate for a strategy nobody has run yet); `nested_noise_pct`: two standard deviations of that error
    from probe noise alone (`costmodel.held_out_noise`, `noise_draws` resamples): within it, the error is noise;
    beyond it, model error."""
    by = {p.strategy: p for p in probes}
    if "sorted" not in by:
        raise ConfigError("the probe needs the 'sorted' strategy as the reference")
    ref = by["sorted"]
    noise = (held_out_noise({p.strategy: p.observations for p in probes}, choice.nested, noise_draws)
             if choice is not None else {})
    rows = []
    for p in probes:
        padding_only = ref.ktok_s * p.predicted_efficiency / ref.realized_efficiency
        row = dict(strategy=p.strategy, ktok_s=p.ktok_s, ktok_s_noise_pct=200 * throughput_rel_sd(p.observations),
                   ratio_to_sorted=p.ktok_s / ref.ktok_s, steady=p.steady,
                   predicted_efficiency=p.predicted_efficiency, realized_efficiency=p.realized_efficiency,
                   efficiency_gap_pts=100 * (p.predicted_efficiency - p.realized_efficiency),
                   steps_per_epoch=p.steps_per_epoch, full_run_eta_days=p.full_run_eta_days,
                   co_batch_recurrence=p.co_batch_recurrence, lag1=p.lag1, **p.fills,
                   padding_only_ktok_s=padding_only, padding_only_error_pct=100 * (padding_only / p.ktok_s - 1))
        if choice is not None:
            held, nested = choice.held_out[p.strategy], choice.nested[p.strategy]
            row.update(cost_model_ktok_s=held.predicted_tok_s / 1000.0, cost_model_error_pct=100 * held.rel_error,
                       nested_error_pct=100 * nested.rel_error, nested_noise_pct=200 * noise[p.strategy],
                       nested_terms="+".join(nested.terms))
        rows.append(row)
    return pd.DataFrame(rows).set_index("strategy")


def demo_summary(table: pd.DataFrame) -> dict[str, dict[str, float]]:
    """The per-strategy figures `runs/<id>_demo/summary.json` holds."""
    keys = ("ktok_s", "ratio_to_sorted", "predicted_efficiency", "realized_efficiency", "co_batch_recurrence")
    extra = [c for c in ("full_run_eta_days", "cost_model_error_pct", "nested_error_pct", "nested_noise_pct",
                         "padding_only_error_pct", *FILLS) if c in table.columns]
    return {s: {k: float(table.loc[s, k]) for k in (*keys, *extra) if pd.notna(table.loc[s, k])}
            for s in table.index}


def cost_model_json(choice: CostModelChoice) -> dict[str, Any]:
    """The fitted model and its held-out errors, as plain JSON (written by notebook 03, read by notebook 02)."""
    try:
        q, why = attention_q_from_fit(choice.model), ""
    except CostModelError as e:  # no per-token term fitted: the cost is not of the form l + l^2/q
        q, why = math.nan, str(e)
    return dict(model=dataclasses.asdict(choice.model), q=None if not np.isfinite(q) else float(q),
                q_note=why or ("attention cost not measurable: use cost='linear'" if not np.isfinite(q) else ""),
                held_out={k: dataclasses.asdict(v) for k, v in choice.held_out.items()},
                nested={k: dataclasses.asdict(v) for k, v in choice.nested.items()},
                candidates={"+".join(t): err for t, err in sorted(choice.candidates.items(), key=lambda kv: kv[1])},
                max_abs_error=choice.max_abs_error, nested_max_abs_error=choice.nested_max_abs_error)
