"""Tuning: the fastest settings that fit the device, proven by the dry run (`dryrun`, the measurement).

    python -m dflash_lib tune --preset qwen3-8b --device-gib 80 [--world-size N] [--mfu 0.4] [-p K V]... [--out DIR]

`candidates` (`TOKEN_LADDER` x `BLOCK_FRACTIONS` x checkpointed drafter layers) projected by `FlopModel`, walked
fastest first: pruned (`Candidate.needs_at_least`), checked on one fake memory step, proven by the full dry run;
`TuneReport` is tune.json. docs/scale.md, "Tuning: the fastest settings that fit, proven by the dry run".
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from dflash_lib.config import Config, ConfigError, from_params, preset_file, read_preset_file
from dflash_lib.data import build_token_store_from_config
from dflash_lib.data.stats import store_drafter_queries
from dflash_lib.models.target_config import target_hf_config
from dflash_lib.plan.buckets import SampleCost
from dflash_lib.plan.sampler import resolve_block_budget
from dflash_lib.plan.sampler.budget import derived_block_budget
from dflash_lib.rundir import JsonRecord, load_config, new_run_dir, write_json
from dflash_lib import dryrun
from dflash_lib.train.build import bucket_edges, build_sampler

GIB = dryrun.GIB
TOKEN_LADDER = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)  # candidate token budgets, multiples of the base's
BLOCK_FRACTIONS = (1.0, 0.5, 0.25)  # candidate block budgets, fractions of each token budget's derived one
SHORT_LADDER, SHORT_FRACTIONS = (1.0, 2.0), (1.0,)  # a quick tuning (notebook 02 on tiny models)
TIE = 0.01  # projections closer than this (relative) are one tier: the FLOP model cannot tell them apart (its
# error on batches it was not fitted to is about 2 %, tests/test_tune.py)
STEP_TIE = 0.25  # optimizer steps within 25 % of today's real tokens count as kept (accum_tokens closes a step at
# the first micro-batch that reaches it, so a step overshoots by up to one micro-batch anyway)
TOKEN_MULTIPLE = 64  # token budgets are rounded to a multiple of this (kernel shapes)
HBM_TB_S = 4.8  # H200 HBM3e bandwidth (TB/s), for the optimizer step's memory traffic
OPTIMIZER_BYTES_PER_PARAMETER = 32  # fused AdamW reads fp32 parameter, gradient and 2 moments (16 B) and writes
# parameter and moments (12 B); the gradient norm reads the gradient once more (4 B)


class NothingFitsError(ValueError):
    """No candidate fits the device; the message names the smallest candidate's need."""


@dataclass(frozen=True, order=True)
class Candidate:
    """One setting tuning may choose."""

    token_budget: int  # tokens per micro-batch (sampler.token_budget)
    block_budget: int  # drafter query tokens per micro-batch (sampler.block_budget, resolved)
    checkpointed: int  # drafter layers recomputed in the backward (model.drafter_checkpointing)

    def __str__(self) -> str:
        return f"token_budget {self.token_budget}, block_budget {self.block_budget}, {self.checkpointed} checkpointed"

    def needs_at_least(self, other: "Candidate") -> bool:
        """Whether this candidate needs at least the memory of `other` (more or as many tokens and queries, as
        few or fewer checkpointed layers): if `other` does not fit, neither does this one."""
        return (self.token_budget >= other.token_budget and self.block_budget >= other.block_budget
                and self.checkpointed <= other.checkpointed)

    def params(self) -> dict[str, Any]:
        """The flat config overrides of this candidate (`-p KEY VALUE`)."""
        return dict(token_budget=self.token_budget, block_budget=self.block_budget,
                    drafter_checkpointing=str(self.checkpointed))


def candidates(config: Config, ladder: Sequence[float] = TOKEN_LADDER,
               fractions: Sequence[float] = BLOCK_FRACTIONS) -> list[Candidate]:
    """Every candidate of `config`'s ladder (module docstring), sorted; `config`'s own settings among them."""
    sc, mc, max_len = config.sampler, config.model, config.data.max_len
    q = SampleCost(config.buckets.cost, config.buckets.q).q
    one_doc = min(mc.num_anchors, max(1, max_len - 1)) * mc.block_size  # queries of the costliest document
    out = {base_candidate(config)}
    for x in ladder:
        tokens = max(max_len, int(round(sc.token_budget * x / TOKEN_MULTIPLE)) * TOKEN_MULTIPLE)
        derived = derived_block_budget(tokens, max_len, mc.num_anchors, mc.block_size,
                                       None if sc.strategy == "packed" else q)
        for f in fractions:
            blocks = int(derived * f)
            if blocks >= one_doc:
                out |= {Candidate(tokens, blocks, k) for k in range(mc.drafter_layers + 1)}
    return sorted(out)


def base_candidate(config: Config) -> Candidate:
    """`config`'s own settings as a candidate (checkpointing as `auto` resolves on CUDA)."""
    return Candidate(config.sampler.token_budget,
                     resolve_block_budget(config.sampler, config.buckets, config.model, config.data.max_len),
                     dryrun.for_cuda(config).checkpointing)


def with_candidate(config: Config, c: Candidate, accum_tokens: int | None = None) -> Config:
    """`config` with candidate `c`'s settings (and `accum_tokens` when given)."""
    extra = {} if accum_tokens is None else dict(accum_tokens=int(accum_tokens))
    return from_params({**c.params(), **extra}, config)


# -- the projection ----------------------------------------------------------------------------------------------


@dataclass
class FlopModel(JsonRecord):
    """FLOPs of one micro-batch (module docstring), coefficients from the base's dry run:
    F = target x real + target_square x (sum of squared document lengths)
        + (slot x slots + query x queries) x (1 + k x recompute_layers)
        + attention x (query-context tokens) x (1 + k x recompute_attention) + head x queries,
    k = checkpointed layers."""

    target: float  # target forward FLOPs per real token
    target_square: float  # target forward FLOPs per squared document token (its attention), per document
    slot: float  # drafter layers' FLOPs per context slot (fc and the context's keys and values), none checkpointed
    query: float  # drafter layers' FLOPs per query token, none checkpointed
    attention: float  # drafter attention FLOPs per (query x context token of its document), none checkpointed
    head: float  # LM head + CE FLOPs per query token
    recompute_layers: float  # extra drafter-layer FLOPs per checkpointed layer, a fraction of none checkpointed
    recompute_attention: float  # the same for the drafter attention
    optimizer_s: float  # seconds of one optimizer step (AdamW + gradient norm memory traffic at HBM_TB_S)
    parameters: int  # the drafter's trainable parameters

    def flops(self, work: "EpochWork", k: int) -> np.ndarray:
        """(S, W) FLOPs of every batch of `work` with k checkpointed layers."""
        return (self.target * work.slots + self.target_square * work.squares
                + (self.slot * work.slots + self.query * work.queries)
                * (1 + k * self.recompute_layers) + self.attention * work.context * (1 + k * self.recompute_attention)
                + self.head * work.queries)


def _context(w: dryrun.WorstBatch) -> int:
    """Query x context tokens of a worst batch: each document's queries see (about) the whole document."""
    return sum(a * w.block_size * n for a, n in zip(w.anchors, w.lengths))


def _squares(w: dryrun.WorstBatch) -> int:
    return sum(n * n for n in w.lengths)


def _slots(w: dryrun.WorstBatch) -> int:
    """Context slots the drafter runs for a worst batch: its real tokens (the dry run lays out the real-token
    context, `models.layout.build_layout`)."""
    return sum(w.lengths)


def flop_model(results: Sequence[dryrun.BatchResult], checkpointed: int, none: dryrun.StepFigures,
               every: dryrun.StepFigures, layers: int, parameters: int) -> FlopModel:
    """The coefficients from the base's measured worst batches (`results`, with `checkpointed` layers) and one
    batch counted with none and with every one of `layers` checkpointed (`none`, `every`)."""
    def recompute(part: str) -> float:
        base = none.flops[part]
        return (every.flops[part] - base) / (layers * base) if base > 0 else 0.0

    rl, ra = recompute("drafter_layers"), recompute("drafter_attention")
    W = [r.worst for r in results]
    F = [r.figures.flops for r in results]
    real = np.array([sum(w.lengths) for w in W], dtype=float)
    T = np.stack([real, np.array([_squares(w) for w in W], dtype=float)], axis=1)  # (n, 2) tokens, squares
    (target, target_square), *_ = np.linalg.lstsq(T, np.array([f["target_forward"] for f in F], dtype=float),
                                                  rcond=None)
    queries = np.array([w.drafter_queries for w in W], dtype=float)
    context = np.array([_context(w) for w in W], dtype=float)
    layers_flops = np.array([f["drafter_layers"] for f in F], dtype=float) / (1 + checkpointed * rl)
    X = np.stack([np.array([_slots(w) for w in W], dtype=float), queries], axis=1)  # (n, 2) slots, queries
    (slot, query), *_ = np.linalg.lstsq(X, layers_flops, rcond=None)
    attn = sum(f["drafter_attention"] for f in F) / (1 + checkpointed * ra) / max(1.0, context.sum())
    opt_s = OPTIMIZER_BYTES_PER_PARAMETER * parameters / (HBM_TB_S * 1e12)
    return FlopModel(target=float(target), target_square=float(target_square), slot=float(slot), query=float(query),
                     attention=float(attn), head=sum(f["head_ce"] for f in F) / queries.sum(), recompute_layers=rl,
                     recompute_attention=ra, optimizer_s=opt_s, parameters=int(parameters))


@dataclass
class EpochWork:
    """What every batch of one epoch plan holds: (S, W) arrays, sampler step x rank (0 where a rank has none)."""

    real: np.ndarray  # real tokens
    squares: np.ndarray  # sum of the squared lengths of its documents (tokens^2): the target's attention
    slots: np.ndarray  # token slots the target and the drafter's context run: the real tokens (static_shapes:
    # every slot, rows x longest or the whole row)
    queries: np.ndarray  # drafter query tokens
    context: np.ndarray  # query x context tokens (each query's document length)
    edges: list[int]  # the bucket edges the plan was made with ([] = another strategy)


def epoch_work(config: Config, lengths: np.ndarray, queries: np.ndarray, store_key: str | None,
               world_size: int) -> EpochWork:
    """Epoch 0 of `config`'s sampler (its strategy, budgets and bucket edges recomputed for them) on
    `world_size` ranks, batch by batch."""
    sc = config.sampler
    edges = bucket_edges(config, lengths, store_key, queries) if sc.strategy == "bucketed" else []
    plan = build_sampler(config, lengths, 0, world_size, edges, queries).epoch_plan(0)
    S, W = plan.steps.shape
    out = {k: np.zeros(S * W) for k in ("real", "squares", "slots", "queries", "context")}
    order, offsets = plan.csr()
    for b, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
        ids = order[lo:hi]
        n, q = lengths[ids].astype(np.int64), queries[ids].astype(np.int64)
        out["real"][b], out["squares"][b], out["queries"][b], out["context"][b] = n.sum(), (n * n).sum(), q.sum(), \
            (q * n).sum()
        if not sc.static_shapes:  # the drafter's context is the real tokens (`models.layout.build_layout`)
            out["slots"][b] = n.sum()
        elif sc.strategy == "packed":  # static shapes: every slot, rows of exactly token_budget
            out["slots"][b] = sc.token_budget
        else:
            out["slots"][b] = len(n) * int(n.max())
    return EpochWork(**{k: v.reshape(S, W) for k, v in out.items()}, edges=list(edges))


def work_of(config: Config, lengths: np.ndarray, queries: np.ndarray, store_key: str | None,
            world_size: int) -> Callable[[Candidate], EpochWork]:
    """`epoch_work` of a candidate's settings, computed once per (token budget, block budget)."""
    works: dict[tuple[int, int], EpochWork] = {}

    def work(c: Candidate) -> EpochWork:
        if (c.token_budget, c.block_budget) not in works:
            works[c.token_budget, c.block_budget] = epoch_work(with_candidate(config, c), lengths, queries,
                                                               store_key, world_size)
        return works[c.token_budget, c.block_budget]

    return work


def optimizer_steps(step_tokens: np.ndarray, accum_tokens: int, world_size: int) -> int:
    """Optimizer steps of an epoch whose sampler steps hold `step_tokens` (S,) real tokens (all ranks): with
    accum_tokens, a step spans whole sampler steps until it holds accum_tokens x world_size (as `feed` cuts)."""
    if accum_tokens <= 0:
        return len(step_tokens)
    steps, held = 0, 0.0
    for t in step_tokens:
        held += t
        if held >= accum_tokens * world_size:
            steps, held = steps + 1, 0.0
    return steps + (held > 0)


@dataclass
class Projection:
    """A candidate's projected epoch on the device(s)."""

    seconds: float  # one epoch (seconds)
    step_s: float  # mean sampler step: its slowest rank's batch (seconds)
    ktok_s_gpu: float  # real tokens per second per GPU (thousands)
    ktok_s: float  # real tokens per second on all GPUs (thousands)
    tokens_per_step: float  # mean real tokens per optimizer step, all ranks
    accum_tokens: int  # the accum_tokens the candidate runs with


def step_accum(config: Config, c: Candidate, base_batch_tokens: float) -> int:
    """accum_tokens candidate `c` runs with (module docstring): the base's when it has one or when `c`'s token
    budget is at least the base's; else the base micro-batch's mean real tokens `base_batch_tokens`."""
    if config.train.accum_tokens > 0 or c.token_budget >= config.sampler.token_budget:
        return config.train.accum_tokens
    return int(round(base_batch_tokens))


def projections(config: Config, model: FlopModel, work: Callable[[Candidate], "EpochWork"], world_size: int,
                mfu: float, peak_tflops: float, ladder: Sequence[float] = TOKEN_LADDER,
                fractions: Sequence[float] = BLOCK_FRACTIONS) -> dict[Candidate, "Projection"]:
    """Every candidate of `config`'s ladder projected (`work(c)`: its epoch plan's batches)."""
    base = work(base_candidate(config)).real
    base_tokens = float(base.sum() / max(1, np.count_nonzero(base)))  # real tokens per micro-batch
    return {c: project(model, work(c), c.checkpointed, step_accum(config, c, base_tokens), world_size, mfu,
                       peak_tflops) for c in candidates(config, ladder, fractions)}


def project(model: FlopModel, work: EpochWork, k: int, accum_tokens: int, world_size: int, mfu: float,
            peak_tflops: float) -> Projection:
    flops = model.flops(work, k)  # (S, W)
    step_s = flops.max(axis=1) / (mfu * peak_tflops * 1e12)  # (S,) the slowest rank
    step_tokens = work.real.sum(axis=1)
    opt_steps = optimizer_steps(step_tokens, accum_tokens, world_size)
    seconds = float(step_s.sum() + opt_steps * model.optimizer_s)
    total = float(step_tokens.sum())
    return Projection(seconds, float(step_s.mean()), total / seconds / 1000 / world_size, total / seconds / 1000,
                      total / max(1, opt_steps), int(accum_tokens))


def preference(c: Candidate, p: Projection, base_step_tokens: float) -> tuple:
    """Among candidates whose projections are within TIE of each other (the FLOP model cannot tell them apart):
    first the optimizer step closest to today's `base_step_tokens` (real tokens per optimizer step, in tiers of
    STEP_TIE: tuning should change the speed, not the optimization), then the larger micro-batch (more tokens,
    more queries: real kernels run closer to the stated MFU on larger batches, which the FLOP model does not
    price), then fewer checkpointed layers."""
    change = abs(math.log(max(p.tokens_per_step, 1.0) / max(base_step_tokens, 1.0)))
    return math.floor(change / math.log1p(STEP_TIE)), -c.token_budget, -c.block_budget, c.checkpointed


# -- the search --------------------------------------------------------------------------------------------------


@dataclass
class CandidateRecord(JsonRecord):
    """One row of the tuning table."""

    token_budget: int  # tokens per micro-batch
    block_budget: int  # drafter query tokens per micro-batch
    checkpointed: int  # drafter layers recomputed in the backward
    docs: int | None  # documents of the memory-worst batch measured (None: pruned unmeasured)
    peak_gib: float | None  # its measured peak (GiB); proven: the largest of every batch's
    need_gib: float | None  # the peak with the dry run's reserve (GiB, `dryrun.Reserve`)
    fits: bool  # fits the device (pruned: known not to)
    step_s: float  # projected mean sampler step (seconds)
    ktok_s_gpu: float  # projected real tokens per second per GPU (thousands)
    ktok_s: float  # projected real tokens per second on all GPUs (thousands)
    speedup: float  # ktok_s / today's defaults' ktok_s
    tokens_per_step: float  # mean real tokens per optimizer step, all ranks
    accum_tokens: int  # accum_tokens the candidate runs with
    decided: str  # defaults (the base, dry-run in full) | measured (one memory step) | pruned (needs at least
    # what a misfit needed) | proven (the full dry run fits) | rejected (a batch of the full dry run does not fit) |
    # fits (one memory step fits, projected within TIE of the choice, not preferred: `preference`)


@dataclass
class TuneReport(JsonRecord):
    """The tuning of a configuration (`tune`): tune.json and the JSON line of `python -m dflash_lib tune`."""

    preset: str  # the named preset tuned from (a preset file: its preset)
    base_params: dict[str, Any]  # the overrides on top of it (a preset file's, then -p)
    device_gib: float  # device memory tuned for (GiB)
    world_size: int  # GPUs the projection is for (data parallel, each holding one micro-batch per step)
    mfu: float  # model FLOPs utilisation assumed, a fraction of peak_tflops
    peak_tflops: float  # the device's dense bf16 peak (TFLOP/s)
    drafter_layers: int  # L: candidates checkpoint 0..L layers
    strategy: str  # the sampler strategy whose epoch plan is priced
    worst_kind: str  # the base's memory-worst batch kind, the one each candidate is checked on
    flop_model: FlopModel  # the projection's coefficients
    rows: list[CandidateRecord]  # every candidate tried, today's defaults first
    chosen: CandidateRecord  # the fastest candidate that fits, proven by the full dry run
    params: dict[str, Any]  # the chosen settings as flat overrides (`-p KEY VALUE`, also in the preset file)
    recompute_share: float  # share of today's defaults' projected FLOPs that is recomputation (checkpointing)
    step_change: str  # how the chosen optimizer step compares with today's, in words
    ignores: str  # what the projection ignores, in words (module docstring)
    seconds: float  # wall time of the tuning on this machine (seconds)


REPORT_FILE = "tune.json"  # the report in the output folder, beside preset.json
IGNORES = ("MFU independent of batch size and shape; anchors at the end of their documents (an upper bound); "
           "host pipeline, data loading and communication free")


def _record(c: Candidate, p: Projection, base: Projection, decided: str, fits: bool,
            measured: Sequence[dryrun.BatchResult] = ()) -> CandidateRecord:
    worst = max(measured, key=lambda r: r.required_bytes) if measured else None
    return CandidateRecord(
        token_budget=c.token_budget, block_budget=c.block_budget, checkpointed=c.checkpointed,
        docs=worst.worst.docs if worst else None,
        peak_gib=round(worst.figures.peak_bytes / GIB, 2) if worst else None,
        need_gib=round(worst.required_bytes / GIB, 2) if worst else None, fits=fits, step_s=float(f"{p.step_s:.4g}"),
        ktok_s_gpu=p.ktok_s_gpu, ktok_s=p.ktok_s, speedup=round(p.ktok_s / base.ktok_s, 4),
        tokens_per_step=round(p.tokens_per_step, 1), accum_tokens=p.accum_tokens, decided=decided)


def tune(config: Config, device_gib: float = 80.0, world_size: int = 1, mfu: float = 0.4,
         peak_tflops: float = dryrun.H200_BF16_TFLOPS, reserve: dryrun.Reserve = dryrun.Reserve(),
         ladder: Sequence[float] = TOKEN_LADDER, fractions: Sequence[float] = BLOCK_FRACTIONS, preset: str = "",
         base_params: dict[str, Any] | None = None, say: Callable[[str], None] = lambda line: None) -> TuneReport:
    """The fastest candidate of `config`'s ladder that fits `device_gib` (module docstring). `config` is named
    preset `preset` overlaid by `base_params` (the report and the preset file say so); "" and None: the
    defaults overlaid by every field `config` changes. Raises NothingFitsError when none does."""
    if not preset:
        defaults = Config().to_params()
        preset, base_params = "default", {k: v for k, v in config.to_params().items()
                                          if v != defaults[k] and k != "out_dir"}  # (a run's folder: not carried)
    t0 = time.perf_counter()
    mc, L = config.model, config.model.drafter_layers
    store = build_token_store_from_config(config.data, progress=False)
    lengths = np.asarray(store.lengths)
    queries = store_drafter_queries(store, mc.num_anchors, mc.block_size)
    key = store.meta.get("key")
    base = base_candidate(config)
    settings = dryrun.for_cuda(config)

    def worst_of(c: Candidate, edges: Sequence[int]) -> list[dryrun.WorstBatch]:
        return dryrun.worst_batches(with_candidate(config, c), edges, c.block_budget)

    # 1. today's defaults, in full: the memory-worst batch kind and the FLOP counts the projection is made of
    work = work_of(config, lengths, queries, key, world_size)
    say(f"today's defaults: token_budget {base.token_budget}, block_budget {base.block_budget}, "
        f"{base.checkpointed}/{L} layers checkpointed: the full dry run")
    base_results = dryrun.measure_batches(config, worst_of(base, work(base).edges), settings, device_gib, mfu,
                                          peak_tflops, reserve, say=say)
    kind = int(np.argmax([r.required_bytes for r in base_results]))  # index into worst_batches' list
    kind_name = base_results[kind].worst.label
    models = {}

    def step_models(k: int) -> dryrun.StepModels:
        if k not in models:
            models.clear()  # one set of fake models at a time
            models[k] = dryrun.build_step_models(config, target_hf_config(mc), dataclasses.replace(settings,
                                                 checkpointing=k), True, config.train.seed)
        return models[k]

    def step(c: Candidate, worst: dryrun.WorstBatch, count_flops: bool) -> dryrun.BatchResult:
        m = step_models(c.checkpointed)
        batch = dryrun.host_batch(worst, m.drafter.cfg.vocab_size, mc.mask_id, seed=config.train.seed)
        fig = dryrun.measure_step(m, batch, config.train.seed, count_flops)
        need = reserve.required_bytes(fig.peak_bytes, fig.kernel_allowance)
        return dryrun.BatchResult(worst, fig, need, need <= device_gib * GIB,
                                  fig.flops_total / (mfu * peak_tflops * 1e12))

    worst_base = base_results[kind].worst
    figs = {base.checkpointed: base_results[kind].figures}
    for k in (0, L):  # the recomputation, counted
        if k not in figs:
            figs[k] = step(dataclasses.replace(base, checkpointed=k), worst_base, True).figures
    parameters = sum(p.numel() for p in step_models(base.checkpointed).params)
    model = flop_model(base_results, base.checkpointed, figs[0], figs[L], L, parameters)

    # 2. the projection of every candidate; the optimizer step kept (module docstring)
    proj = projections(config, model, work, world_size, mfu, peak_tflops, ladder, fractions)
    cands = sorted(proj)
    p0 = proj[base]
    base_fits = all(r.fits for r in base_results)
    rows = [_record(base, p0, p0, "defaults", base_fits, base_results)]

    # 3. the walk, fastest first: one fake step per candidate until one fits; then every candidate within TIE of
    # that one is checked too, and those that fit are proven by the full dry run in order of `preference`
    misfits = [] if base_fits else [base]
    order = sorted(cands, key=lambda c: (-proj[c].ktok_s, preference(c, proj[c], p0.tokens_per_step)))
    chosen, i, passed = None, 0, {}

    def one_step(c: Candidate) -> bool | None:
        """Whether c fits on one step of the memory-worst batch kind (None: pruned); its row appended unless it
        fits (`passed` keeps that step: the proof, or the row of a fit not chosen, comes later)."""
        if c == base:
            if not base_fits:
                rows.append(_record(c, proj[c], p0, "measured", False, base_results))
            return base_fits
        if any(c.needs_at_least(m) for m in misfits):
            rows.append(_record(c, proj[c], p0, "pruned", False))
            return None
        one = step(c, worst_of(c, work(c).edges)[kind], False)
        say(f"  {c}: {kind_name} {one.worst.docs} docs -> need {one.required_bytes / GIB:.1f} GiB")
        if not one.fits:
            misfits.append(c)
            rows.append(_record(c, proj[c], p0, "measured", False, [one]))
        else:
            passed[c] = one
        return one.fits

    while chosen is None and i < len(order):
        pool: list[Candidate] = []
        while i < len(order) and not (pool and proj[order[i]].ktok_s < proj[pool[0]].ktok_s * (1 - TIE)):
            c, i = order[i], i + 1
            if one_step(c):
                pool.append(c)
        for c in sorted(pool, key=lambda c: preference(c, proj[c], p0.tokens_per_step)):
            if c == base:  # dry-run in full already
                chosen = dataclasses.replace(rows[0], decided="proven")
                rows.append(chosen)
                break
            say(f"  {c}: the full dry run")
            full = dryrun.measure_batches(with_candidate(config, c), worst_of(c, work(c).edges), dataclasses.replace(
                settings, checkpointing=c.checkpointed), device_gib, mfu, peak_tflops, reserve, say=say)
            fits = all(r.fits for r in full)
            rows.append(_record(c, proj[c], p0, "proven" if fits else "rejected", fits, full))
            if fits:
                chosen = rows[-1]
                break
            misfits.append(c)
        tried = {(r.token_budget, r.block_budget, r.checkpointed) for r in rows[1:]}
        for c in pool:  # fits one step, as fast, not preferred: its row goes before the choice
            if (c.token_budget, c.block_budget, c.checkpointed) not in tried and c != base:
                rows.insert(len(rows) - (chosen is not None), _record(c, proj[c], p0, "fits", True, [passed[c]]))
    if chosen is None:
        smallest = min(cands, key=lambda c: (c.token_budget, c.block_budget, -c.checkpointed))
        need = max((r.need_gib or 0.0) for r in rows if (r.token_budget, r.block_budget, r.checkpointed) ==
                   (smallest.token_budget, smallest.block_budget, smallest.checkpointed))
        raise NothingFitsError(f"nothing fits {device_gib:g} GiB: the smallest candidate (token_budget "
                               f"{smallest.token_budget}, block_budget {smallest.block_budget}, all {L} drafter "
                               f"layers checkpointed) needs {need:.2f} GiB")
    params = {**Candidate(chosen.token_budget, chosen.block_budget, chosen.checkpointed).params(),
              "accum_tokens": chosen.accum_tokens}
    ratio = chosen.tokens_per_step / rows[0].tokens_per_step
    step_change = (f"an optimizer step holds {chosen.tokens_per_step:,.0f} real tokens on average, {ratio:.2f}x "
                   f"today's {rows[0].tokens_per_step:,.0f}" + (
                       f" (accum_tokens {chosen.accum_tokens}: a step closes at the first micro-batch that reaches "
                       f"it)" if chosen.accum_tokens else "") + (
                       "" if abs(ratio - 1) <= 0.1 else ": the global batch changes, scale the learning rate to it"))
    recompute = float((model.flops(work(base), base.checkpointed) - model.flops(work(base), 0)).sum()
                      / model.flops(work(base), base.checkpointed).sum())
    return TuneReport(
        preset=preset, base_params=dict(base_params or {}), device_gib=device_gib, world_size=world_size, mfu=mfu,
        peak_tflops=peak_tflops, drafter_layers=L, strategy=config.sampler.strategy, worst_kind=kind_name,
        flop_model=model, rows=rows, chosen=chosen, params=params, recompute_share=round(recompute, 4),
        step_change=step_change, ignores=IGNORES, seconds=round(time.perf_counter() - t0, 1))


def format_tuning(report: TuneReport) -> str:
    """The table of candidates tried, then the chosen settings as a `-p` line."""
    r = report
    cols = ("token_budget", "block_budget", "ckpt", "docs", "peak", "need", "fits", "step s", "Ktok/s/GPU",
            f"Ktok/s x{r.world_size}", "x today", "tok/step", "decided")
    body = []
    for row in r.rows:
        body.append((row.token_budget, row.block_budget, f"{row.checkpointed}/{r.drafter_layers}",
                     "-" if row.docs is None else row.docs, "-" if row.peak_gib is None else f"{row.peak_gib:.1f}",
                     "-" if row.need_gib is None else f"{row.need_gib:.1f}", "yes" if row.fits else "no",
                     f"{row.step_s:.3g}", f"{row.ktok_s_gpu:.1f}", f"{row.ktok_s:.1f}", f"{row.speedup:.3f}",
                     f"{row.tokens_per_step:,.0f}", row.decided))
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *body)]
    lines = [f"tune: {r.preset or 'defaults'} on {r.world_size} x {r.device_gib:g} GiB, {r.strategy}, "
             f"{r.mfu:.0%} MFU of {r.peak_tflops:g} TFLOP/s; each candidate checked on {r.worst_kind}",
             "  ".join(str(c).rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in body]
    c = r.chosen
    lines.append(f"chosen: {c.ktok_s_gpu:.1f} Ktok/s per GPU, {c.speedup:.3f}x today's defaults; recomputation is "
                 f"{r.recompute_share:.1%} of today's FLOPs; {r.step_change}")
    lines.append("  " + " ".join(f"-p {k} {v}" for k, v in r.params.items()))
    lines.append(f"the projection ignores: {r.ignores}")
    return "\n".join(lines)


def write_tuning(report: TuneReport, out: Path) -> tuple[Path, Path]:
    """tune.json (the report) and preset.json (`config.preset_file`: `--preset FILE` anywhere a preset name
    goes) in folder `out`; the preset file is the report's preset, its overrides and the chosen settings."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / REPORT_FILE, report.to_json())
    path = out / "preset.json"
    path.write_text(json.dumps(preset_file(report.preset, {**report.base_params, **report.params}), indent=1)
                    + "\n")
    return out / REPORT_FILE, path


def run_cli(args: Any, params: dict[str, str]) -> int:
    """`python -m dflash_lib tune` (alias `plan`): the table, the `-p` line, the files' paths, then ONE JSON line
    (the report); 0 when a candidate fits, 1 when nothing does (a bad parameter raises ConfigError: exit 2)."""
    if args.device_gib <= 0 or not 0 < args.mfu <= 1 or args.world_size < 1:
        raise ConfigError("--device-gib must be > 0, --mfu in (0, 1], --world-size >= 1")
    config = load_config(params, args.preset)
    base, given = args.preset, {}
    if base.endswith(".json"):  # a preset file tuned again: its preset, its overrides under the new ones
        base, given = read_preset_file(base)
    base_params = preset_file(base, {**given, **params})["params"]  # typed
    say = lambda line: print(line, flush=True)  # noqa: E731
    try:
        report = tune(config, args.device_gib, args.world_size, args.mfu, preset=base, base_params=base_params,
                      say=say)
    except NothingFitsError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    print(format_tuning(report), flush=True)
    for path in write_tuning(report, Path(args.out) if args.out else new_run_dir("tune")):
        print(path, flush=True)
    print(json.dumps(report.to_json()), flush=True)
    return 0
