"""A step-time model calibrated on measured steps:
seconds = a + b * computed slots + r * real + c * attention + e * blocks (+ d * new shape).

`BatchShape` describes a batch (real tokens, drafter blocks, padding slots only for a padded kernel), `fit_cost_model`
fits the terms (non-negative least squares, numpy only), `select_cost_model` chooses them by nested leave-one-out
error across strategies, and `held_out_noise` gives the part of that error probe noise alone makes. What each term
stands for and how to read the errors: docs/batching.md, "The step-time cost model".
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

TERMS = ("a", "b", "r", "c", "e", "d")  # per step, per padded slot, per real token, per attention unit, per block,
# per new shape; "a" is always fitted
DEFAULT_TERMS = ("a", "b", "c", "e")
OPTIONAL_TERMS = ("b", "r", "c", "e", "d")  # what select_cost_model chooses among
TIE = 1e-4  # mean held-out errors closer than this (0.01 points) count as equal when choosing terms


class CostModelError(ValueError):
    """Observations cannot support the fit (too few, degenerate shapes, invalid values)."""


@dataclass(frozen=True)
class BatchShape:
    """What one step costs depends only on this description of its batch."""

    rows: int  # R: rows in the batch
    row_len: int  # T: token slots per row (padding included)
    real_tokens: int  # tokens that belong to a document
    attention: float  # sum over attention blocks of len^2, in tokens^2
    blocks: int = field(default=0, kw_only=True)  # anchor blocks the drafter scores in the step (0 = unknown)
    padded_kernel: bool = field(default=False, kw_only=True)  # its kernels compute every slot (static shapes);
    # False: the real tokens only (the target and the drafter's context), padding costs nothing

    @property
    def padded_tokens(self) -> int:
        """Token slots the batch holds: R * T."""
        return self.rows * self.row_len

    @property
    def computed_slots(self) -> int:
        """Token slots its kernels compute: R * T with a padded kernel, else the real tokens."""
        return self.padded_tokens if self.padded_kernel else self.real_tokens

    @property
    def key(self) -> tuple[int, int]:
        """The (R, T) shape a kernel sees."""
        return (self.rows, self.row_len)


@dataclass(frozen=True)
class StepObservation(BatchShape):
    """One measured step: its batch description and its wall time."""

    seconds: float  # wall time of the step (forward + backward + optimizer), seconds
    run: str = ""  # which process the step ran in; a shape is "new" the first time it appears in its run


def anchor_blocks(lengths: np.ndarray, anchors_per_doc: int) -> int:
    """Blocks scored for documents of `lengths` tokens with at most `anchors_per_doc` anchors each (an anchor
    needs a next token: at most len - 1 per document; assistant-only anchors make the real count lower)."""
    return int(np.minimum(np.maximum(lengths - 1, 0), anchors_per_doc).sum()) if anchors_per_doc > 0 else 0


def describe_padded(lengths: Sequence[int], pad_to: int = 0, anchors_per_doc: int = 0,
                    padded_kernel: bool = False) -> BatchShape:
    """A padded batch: one document per row, right-padded to the longest (or to `pad_to` tokens if larger).

    `pad_to` prices a bucket padded to its upper edge (static shapes) rather than to its longest member.
    `anchors_per_doc` (the drafter's num_anchors) prices the scored blocks; 0 leaves them out. padded_kernel:
    every slot is computed and attention runs over whole rows (R * T^2); else the documents only (sum of len^2).
    """
    lens = _lengths(lengths, "describe_padded")
    R, T = len(lens), max(int(lens.max()), int(pad_to))
    attention = float(R) * T * T if padded_kernel else float((lens.astype(np.float64) ** 2).sum())
    return BatchShape(rows=R, row_len=T, real_tokens=int(lens.sum()), attention=attention,
                      blocks=anchor_blocks(lens, anchors_per_doc), padded_kernel=padded_kernel)


def describe_packed(rows: Sequence[Sequence[int]], row_len: int, varlen: bool = True,
                    anchors_per_doc: int = 0, padded_kernel: bool = False) -> BatchShape:
    """A packed batch: each inner list holds the document lengths laid end to end in one row of `row_len` slots.

    varlen=True prices attention per document (flash-attn varlen / a block-diagonal kernel); False prices the
    full row (a backend that computes the whole T x T score matrix and masks it). padded_kernel: the row's tail
    slots are computed too (static shapes).
    """
    if not rows:
        raise CostModelError("describe_packed: a packed batch needs at least one row")
    real, attn = 0, 0.0
    for r, docs in enumerate(rows):
        lens = _lengths(docs, f"describe_packed row {r}")
        if int(lens.sum()) > row_len:
            raise CostModelError(f"describe_packed row {r}: {int(lens.sum())} tokens do not fit row_len={row_len}")
        real += int(lens.sum())
        attn += float((lens.astype(np.float64) ** 2).sum()) if varlen else float(row_len) ** 2
    blocks = sum(anchor_blocks(_lengths(r, "describe_packed"), anchors_per_doc) for r in rows)
    return BatchShape(rows=len(rows), row_len=int(row_len), real_tokens=real, attention=attn, blocks=blocks,
                      padded_kernel=padded_kernel)


def describe_batches(batches: Iterable[Sequence[int]], layout: str = "padded", row_len: int = 0,
                     varlen: bool = True, anchors_per_doc: int = 0, padded_kernel: bool = False) -> list[BatchShape]:
    """Shapes of a list of batches given as document lengths (tokens), one list per batch.

    layout="padded": each batch is padded to its longest document (or to `row_len` if larger).
    layout="packed": each batch is ONE row of `row_len` slots holding its documents end to end.
    padded_kernel: as in `describe_padded` / `describe_packed`.
    """
    if layout == "padded":
        return [describe_padded(b, pad_to=row_len, anchors_per_doc=anchors_per_doc, padded_kernel=padded_kernel)
                for b in batches]
    if layout == "packed":
        if row_len <= 0:
            raise CostModelError(f"describe_batches: layout='packed' needs row_len > 0, got {row_len}")
        return [describe_packed([b], row_len, varlen, anchors_per_doc, padded_kernel) for b in batches]
    raise CostModelError(f"describe_batches: layout must be 'padded' or 'packed', got {layout!r}")


@dataclass(frozen=True)
class CostModel:
    """Fitted step time, seconds: a + b * computed_slots + r * real_tokens + c * attention + e * blocks
    + d * [first step of a new shape]. A term left out of `terms` is 0."""

    a: float  # seconds per step
    b: float = 0.0  # seconds per computed token slot (padding only with a padded kernel)
    c: float = 0.0  # seconds per attention unit (tokens^2)
    d: float = 0.0  # seconds per new (R, T) shape met in a run
    e: float = 0.0  # seconds per scored anchor block
    r: float = 0.0  # seconds per real (document) token
    terms: tuple[str, ...] = DEFAULT_TERMS  # the terms that were fitted
    n_obs: int = 0  # observations in the fit
    rmse_s: float = 0.0  # in-sample root-mean-square residual, seconds per step
    rel_rmse: float = 0.0  # in-sample root-mean-square of residual / measured seconds

    @property
    def shape_overhead(self) -> bool:
        """Whether the per-new-shape term d was fitted."""
        return "d" in self.terms

    def predict_step(self, shape: BatchShape, new_shape: bool = False) -> float:
        """Predicted seconds of one step on `shape` (plus d when it is the run's first step of that shape)."""
        return (self.a + self.b * shape.computed_slots + self.r * shape.real_tokens + self.c * shape.attention
                + self.e * shape.blocks + (self.d if new_shape else 0.0))

    def predict_seconds(self, batches: Sequence[BatchShape], warm_shapes: Iterable[tuple[int, int]] = ()) -> float:
        """Predicted seconds for running `batches` in order in one run; `warm_shapes` were met before."""
        seen = set(warm_shapes)
        total = 0.0
        for shape in batches:
            total += self.predict_step(shape, new_shape=shape.key not in seen)
            seen.add(shape.key)
        return total

    def predict_throughput(self, batches: Sequence[BatchShape], warm_shapes: Iterable[tuple[int, int]] = ()) -> float:
        """Predicted real tokens per second over `batches` (an epoch of a strategy, or any sample of it)."""
        if not batches:
            raise CostModelError("predict_throughput: no batches given")
        return sum(s.real_tokens for s in batches) / self.predict_seconds(batches, warm_shapes)


def attention_q_from_fit(model: CostModel) -> float:
    """The q (tokens) of the per-sample cost g(l) = l + l^2 / q implied by the fit: q = b / c.

    A row of T computed slots costs b*T + c*T^2 = b * (T + T^2 / q), so bucket boundaries optimised with
    cost="quadratic", q=q minimise the fitted time. Returns inf when c == 0 (attention is free: use "linear").
    """
    if model.b <= 0:
        raise CostModelError(f"attention_q_from_fit: b = {model.b} s/token; q = b/c needs a positive per-token cost")
    return math.inf if model.c == 0 else model.b / model.c


def fit_cost_model(observations: Sequence[StepObservation], terms: Sequence[str] = DEFAULT_TERMS) -> CostModel:
    """Non-negative least squares fit of step seconds on the columns of `terms` (see the module docstring).

    "a" is always fitted; "e" only when the observations carry block counts. Observations are taken in step
    order; with "d" a step counts as a new shape the first time its (R, T) appears within its `run`. Raises
    CostModelError naming the problem when the observations cannot separate the terms (too few, every step the
    same shape, columns collinear).
    """
    obs = list(observations)
    for i, o in enumerate(obs):
        _check_observation(i, o)
    X, names = _design(obs, terms)  # (N, P)
    y = np.array([o.seconds for o in obs], dtype=np.float64)  # (N,)
    n, p = X.shape
    if n < p + 1:
        raise CostModelError(f"fit_cost_model: {n} observations for {p} terms; need at least {p + 1}")
    shapes = {o.key for o in obs}
    if len(shapes) < 2:
        raise CostModelError(f"fit_cost_model: all {n} observations have the same (rows, row_len) = "
                             f"{next(iter(shapes))}; steps of several shapes are needed to separate the terms")
    scale = np.abs(X).max(axis=0)  # (P,) columns scaled to [0, 1] so the solve is well conditioned
    scale[scale == 0] = 1.0
    Xs = X / scale  # (N, P)
    rank = np.linalg.matrix_rank(Xs, tol=1e-9 * max(Xs.shape))
    if rank < p:
        raise CostModelError(f"fit_cost_model: the {n} observations span only {rank} of the {p} terms "
                             f"({', '.join(names)}): {len(shapes)} distinct shapes whose columns are collinear; "
                             "probe batches with more varied row counts and row lengths")
    coef = _nnls(Xs, y) / scale  # (P,)
    resid = y - X @ coef  # (N,)
    return CostModel(**{k: float(v) for k, v in zip(names, coef)}, terms=tuple(names), n_obs=n,
                     rmse_s=float(np.sqrt(np.mean(resid**2))), rel_rmse=float(np.sqrt(np.mean((resid / y) ** 2))))


@dataclass(frozen=True)
class HeldOut:
    """One strategy predicted by a model fitted on the other strategies only."""

    strategy: str  # the held-out strategy
    steps: int  # its measured steps
    realized_tok_s: float  # measured real tokens / measured seconds
    predicted_tok_s: float  # measured real tokens / predicted seconds of the same batches
    rel_error: float  # predicted / realized - 1 (signed)
    terms: tuple[str, ...] = DEFAULT_TERMS  # the terms of the model that predicted it


def predict_held_out(model: CostModel, strategy: str, steps: Sequence[StepObservation]) -> HeldOut:
    """`model`'s prediction of the measured steps of `strategy`, as throughput against the measurement."""
    flags = _new_shape_flags(steps)
    predicted_s = sum(model.predict_step(o, f) for o, f in zip(steps, flags))
    real = sum(o.real_tokens for o in steps)
    realized, predicted = real / sum(o.seconds for o in steps), real / predicted_s
    return HeldOut(strategy, len(steps), realized, predicted, predicted / realized - 1.0, model.terms)


def leave_one_out(obs_by_strategy: Mapping[str, Sequence[StepObservation]],
                  terms: Sequence[str] = DEFAULT_TERMS) -> dict[str, HeldOut]:
    """For each strategy: fit `terms` on all OTHER strategies, predict its throughput, compare with the measurement."""
    if len(obs_by_strategy) < 2:
        raise CostModelError(f"leave_one_out: needs at least 2 strategies, got {sorted(obs_by_strategy)}")
    out: dict[str, HeldOut] = {}
    for held, steps in obs_by_strategy.items():
        if not steps:
            raise CostModelError(f"leave_one_out: strategy {held!r} has no observations")
        train = [o for name, obs in obs_by_strategy.items() if name != held for o in obs]
        try:
            model = fit_cost_model(train, terms)
        except CostModelError as e:
            raise CostModelError(f"leave_one_out without {held!r}: {e}") from None
        out[held] = predict_held_out(model, held, steps)
    return out


@dataclass(frozen=True)
class CostModelChoice:
    """The term set with the lowest mean held-out error, its model fitted on every strategy, and how well it
    predicts strategies it never saw."""

    model: CostModel  # the chosen terms, fitted on all observations
    held_out: dict[str, HeldOut]  # leave-one-out of the chosen terms
    nested: dict[str, HeldOut]  # the term choice made again without each strategy, then that strategy predicted
    candidates: dict[tuple[str, ...], float]  # every term set that could be fitted -> its mean |held-out error|

    @property
    def max_abs_error(self) -> float:
        """Worst |predicted / realized - 1| over held-out strategies (chosen terms)."""
        return max(abs(h.rel_error) for h in self.held_out.values())

    @property
    def nested_max_abs_error(self) -> float:
        """Worst held-out error when the term choice never saw the predicted strategy (the honest figure)."""
        return max(abs(h.rel_error) for h in self.nested.values())


def candidate_terms(optional: Sequence[str] = OPTIONAL_TERMS) -> list[tuple[str, ...]]:
    """Every term set: "a" plus any subset of `optional`, fewest terms first."""
    bad = set(optional) - set(OPTIONAL_TERMS)
    if bad:
        raise CostModelError(f"candidate_terms: unknown terms {sorted(bad)}; optional terms are {OPTIONAL_TERMS}")
    opts = [t for t in OPTIONAL_TERMS if t in optional]
    return [("a", *sub) for k in range(len(opts) + 1) for sub in itertools.combinations(opts, k)]


def choose_terms(obs_by_strategy: Mapping[str, Sequence[StepObservation]],
                 optional: Sequence[str] = OPTIONAL_TERMS) -> tuple[tuple[str, ...], dict[tuple[str, ...], float]]:
    """The term set with the lowest mean |leave-one-out error| (within TIE of it: the fewest terms, so a term the
    fit zeroes anyway is not kept), and every candidate's error. Term sets the data cannot separate are skipped;
    none fitting at all raises CostModelError."""
    scores: dict[tuple[str, ...], float] = {}
    for terms in candidate_terms(optional):
        try:
            scores[terms] = _mean_abs(leave_one_out(obs_by_strategy, terms))
        except CostModelError:
            continue
    if not scores:
        raise CostModelError(f"choose_terms: no term set can be fitted leaving one of {sorted(obs_by_strategy)} out")
    low = min(scores.values())
    best = min((t for t in scores if scores[t] <= low + TIE), key=lambda t: (len(t), scores[t]))
    return best, scores


def select_cost_model(obs_by_strategy: Mapping[str, Sequence[StepObservation]],
                      optional: Sequence[str] = OPTIONAL_TERMS) -> CostModelChoice:
    """Choose the terms by leave-one-out error, fit them on every strategy, and estimate the error on an unseen
    strategy by nested leave-one-out (needs at least 3 strategies)."""
    if len(obs_by_strategy) < 3:
        raise CostModelError(f"select_cost_model: needs at least 3 strategies (nested leave-one-out), got "
                             f"{sorted(obs_by_strategy)}")
    terms, scores = choose_terms(obs_by_strategy, optional)
    nested = {}
    for held, steps in obs_by_strategy.items():
        rest = {k: v for k, v in obs_by_strategy.items() if k != held}
        inner, _ = choose_terms(rest, optional)
        nested[held] = predict_held_out(fit_cost_model([o for v in rest.values() for o in v], inner), held, steps)
    model = fit_cost_model([o for obs in obs_by_strategy.values() for o in obs], terms)
    return CostModelChoice(model, leave_one_out(obs_by_strategy, terms), nested, scores)


def throughput_rel_sd(steps: Sequence[StepObservation], rng: np.random.Generator | None = None,
                      draws: int = 500) -> float:
    """Relative standard deviation of measured tokens/s (sum real / sum seconds) over bootstrap resamples of the
    steps: the noise floor below which a held-out error means nothing. `rng` defaults to a fixed seed."""
    if not steps:
        raise CostModelError("throughput_rel_sd: no steps given")
    rng = rng if rng is not None else np.random.default_rng(0)
    real = np.array([o.real_tokens for o in steps], dtype=np.float64)  # (S,)
    sec = np.array([o.seconds for o in steps], dtype=np.float64)  # (S,)
    idx = rng.integers(0, len(steps), (draws, len(steps)))  # (draws, S)
    tok_s = real[idx].sum(axis=1) / sec[idx].sum(axis=1)  # (draws,)
    return float(tok_s.std() / (real.sum() / sec.sum()))


def held_out_noise(obs_by_strategy: Mapping[str, Sequence[StepObservation]], held: Mapping[str, HeldOut],
                   draws: int = 200, rng: np.random.Generator | None = None) -> dict[str, float]:
    """Standard deviation of each held-out relative error (`held[s].rel_error`, e.g. `CostModelChoice.nested`)
    that probe noise alone makes. Per draw, every strategy's steps are resampled with replacement (which steps
    were measured: their mix of shapes and their timing scatter), the held-out strategy's terms (`held[s].terms`,
    kept: the term choice is not redone) are refitted on the other strategies' resampled steps, and its resampled
    steps are predicted. An error within twice this spread is consistent with noise; beyond it, it is model error.
    Slow drift of the machine between strategies is not in it (the probe's rounds spread drift over all of them).
    Draws whose resample cannot be fitted are skipped; NaN with fewer than two draws left."""
    rng = rng if rng is not None else np.random.default_rng(0)
    out: dict[str, float] = {}
    for name, h in held.items():
        errors = []
        for _ in range(draws):
            sample = {k: [v[i] for i in rng.integers(0, len(v), len(v))] for k, v in obs_by_strategy.items()}
            try:
                model = fit_cost_model([o for k, v in sample.items() if k != name for o in v], h.terms)
            except CostModelError:
                continue
            errors.append(predict_held_out(model, name, sample[name]).rel_error)
        out[name] = float(np.std(errors, ddof=1)) if len(errors) > 1 else math.nan
    return out


def _mean_abs(held: Mapping[str, HeldOut]) -> float:
    return float(np.mean([abs(h.rel_error) for h in held.values()]))


def _lengths(lengths: Sequence[int], where: str) -> np.ndarray:
    lens = np.asarray(lengths, dtype=np.int64)  # (n,)
    if lens.ndim != 1 or lens.size == 0:
        raise CostModelError(f"{where}: expected a non-empty list of document lengths, got shape {lens.shape}")
    if (lens <= 0).any():
        raise CostModelError(f"{where}: document lengths must be > 0 tokens, got {lens[lens <= 0][:5].tolist()}")
    return lens


def _check_observation(i: int, o: StepObservation) -> None:
    problems = []
    if o.rows <= 0 or o.row_len <= 0:
        problems.append(f"rows={o.rows}, row_len={o.row_len} must be > 0")
    if not 0 < o.real_tokens <= o.padded_tokens:
        problems.append(f"real_tokens={o.real_tokens} must be in (0, padded_tokens={o.padded_tokens}]")
    if not (math.isfinite(o.attention) and o.attention > 0):
        problems.append(f"attention={o.attention} must be finite and > 0")
    if not (math.isfinite(o.seconds) and o.seconds > 0):
        problems.append(f"seconds={o.seconds} must be finite and > 0")
    if problems:
        raise CostModelError(f"observation {i} (run {o.run!r}): " + "; ".join(problems))


def _new_shape_flags(obs: Sequence[StepObservation]) -> list[bool]:
    """True where a step is the first of its (R, T) shape within its run (in the given order)."""
    seen: set[tuple[str, int, int]] = set()
    flags = []
    for o in obs:
        k = (o.run, *o.key)
        flags.append(k not in seen)
        seen.add(k)
    return flags


def _design(obs: Sequence[StepObservation], terms: Sequence[str]) -> tuple[np.ndarray, list[str]]:
    """The design matrix (N, P) and its term names, in TERMS order ("a" always; "e" only when blocks were
    counted)."""
    bad = set(terms) - set(TERMS)
    if bad:
        raise CostModelError(f"unknown cost-model terms {sorted(bad)}; known: {TERMS}")
    column = {"a": lambda: np.ones(len(obs)), "b": lambda: [o.computed_slots for o in obs],
              "r": lambda: [o.real_tokens for o in obs], "c": lambda: [o.attention for o in obs],
              "e": lambda: [o.blocks for o in obs], "d": lambda: _new_shape_flags(obs)}
    names = [t for t in TERMS if t == "a" or (t in terms and (t != "e" or any(o.blocks for o in obs)))]
    return np.column_stack([column[t]() for t in names]).astype(np.float64), names


def _nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min ||X w - y|| subject to w >= 0, exact for a few columns.

    The optimum is the unconstrained least squares solution on its own support, and every feasible support
    solution is a candidate, so the best feasible one over all 2^P supports is the optimum.
    """
    p = X.shape[1]
    best, best_err = np.zeros(p), float(y @ y)
    for k in range(1, p + 1):
        for support in itertools.combinations(range(p), k):
            cols = list(support)
            w_s, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)  # (k,)
            if (w_s < 0).any():
                continue
            w = np.zeros(p)
            w[cols] = w_s
            err = float(np.sum((X @ w - y) ** 2))
            if err < best_err:
                best, best_err = w, err
    return best
