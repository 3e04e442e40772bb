"""A step-time model calibrated on measured steps: seconds = a + b * padded + c * attention + e * blocks
(+ d * new shape).

The seed predicted throughput from padding efficiency alone and missed by ~10 points, because a step also pays
a fixed cost (kernel launches, optimizer, host sync), a per-token cost on every slot INCLUDING padding, and a
quadratic attention cost that grows with row length. Fitting those three terms on probe steps lets any
strategy, or any set of bucket edges, be priced without running it.

Terms of one step (one forward + backward of one batch of R rows x T token slots):
- a: seconds per step.
- b: seconds per padded token slot (R * T).
- c: seconds per attention unit: the sum over attention blocks of len^2 (tokens^2). Padded rows pay R * T^2;
  packed rows pay sum(doc_len^2) with varlen attention, or T^2 per row when the backend cannot do varlen.
- e: seconds per anchor block the drafter scores (its LM head + cross-entropy over the whole vocabulary): this
  grows with the number of DOCUMENTS in a step (anchors per document are capped), not with its tokens, so a
  strategy that puts many short documents in a step pays more per token. Fitted only when the observations
  carry block counts.
- d (optional): seconds paid the first time a run meets a new (R, T) shape (kernel selection, autotuning,
  allocator growth, recompiles). It is only worth having when it lowers the held-out error
  (`select_cost_model`).

numpy only: the fit is a non-negative least squares over at most four columns, solved exactly by trying every
support set (2^4 small solves) instead of pulling in scipy.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

TERMS = ("a", "b", "c", "e", "d")  # intercept, per padded token, per attention unit, per block, per new shape


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

    @property
    def padded_tokens(self) -> int:
        """Token slots paid for: R * T."""
        return self.rows * self.row_len

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


def describe_padded(lengths: Sequence[int], pad_to: int = 0, anchors_per_doc: int = 0) -> BatchShape:
    """A padded batch: one document per row, right-padded to the longest (or to `pad_to` tokens if larger).

    `pad_to` prices a bucket padded to its upper edge (static shapes) rather than to its longest member.
    `anchors_per_doc` (the drafter's num_anchors) prices the scored blocks; 0 leaves them out.
    """
    lens = _lengths(lengths, "describe_padded")
    R, T = len(lens), max(int(lens.max()), int(pad_to))
    return BatchShape(rows=R, row_len=T, real_tokens=int(lens.sum()), attention=float(R) * T * T,
                      blocks=anchor_blocks(lens, anchors_per_doc))


def describe_packed(rows: Sequence[Sequence[int]], row_len: int, varlen: bool = True,
                    anchors_per_doc: int = 0) -> BatchShape:
    """A packed batch: each inner list holds the document lengths laid end to end in one row of `row_len` slots.

    varlen=True prices attention per document (flash-attn varlen / a block-diagonal kernel); False prices the
    full row (a backend that computes the whole T x T score matrix and masks it).
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
    return BatchShape(rows=len(rows), row_len=int(row_len), real_tokens=real, attention=attn, blocks=blocks)


def describe_batches(batches: Iterable[Sequence[int]], layout: str = "padded", row_len: int = 0,
                     varlen: bool = True, anchors_per_doc: int = 0) -> list[BatchShape]:
    """Shapes of a list of batches given as document lengths (tokens), one list per batch.

    layout="padded": each batch is padded to its longest document (or to `row_len` if larger).
    layout="packed": each batch is ONE row of `row_len` slots holding its documents end to end.
    """
    if layout == "padded":
        return [describe_padded(b, pad_to=row_len, anchors_per_doc=anchors_per_doc) for b in batches]
    if layout == "packed":
        if row_len <= 0:
            raise CostModelError(f"describe_batches: layout='packed' needs row_len > 0, got {row_len}")
        return [describe_packed([b], row_len, varlen, anchors_per_doc) for b in batches]
    raise CostModelError(f"describe_batches: layout must be 'padded' or 'packed', got {layout!r}")


@dataclass(frozen=True)
class CostModel:
    """Fitted step time: a + b * padded_tokens + c * attention + d * [first step of a new shape], seconds."""

    a: float  # seconds per step
    b: float  # seconds per padded token slot
    c: float  # seconds per attention unit (tokens^2)
    d: float  # seconds per new (R, T) shape met in a run (0 when fitted without the shape term)
    shape_overhead: bool  # whether d was fitted
    n_obs: int  # observations in the fit
    rmse_s: float  # in-sample root-mean-square residual, seconds per step
    rel_rmse: float  # in-sample root-mean-square of residual / measured seconds
    e: float = 0.0  # seconds per scored anchor block (0 when the observations carried no block counts)

    def predict_step(self, shape: BatchShape, new_shape: bool = False) -> float:
        """Predicted seconds of one step on `shape` (plus d when it is the run's first step of that shape)."""
        return (self.a + self.b * shape.padded_tokens + self.c * shape.attention + self.e * shape.blocks
                + (self.d if new_shape else 0.0))

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

    A row of T slots costs b*T + c*T^2 = b * (T + T^2 / q), so bucket boundaries optimised with
    cost="quadratic", q=q minimise the fitted time. Returns inf when c == 0 (attention is free: use "linear").
    """
    if model.b <= 0:
        raise CostModelError(f"attention_q_from_fit: b = {model.b} s/token; q = b/c needs a positive per-token cost")
    return math.inf if model.c == 0 else model.b / model.c


def fit_cost_model(observations: Sequence[StepObservation], shape_overhead: bool = False) -> CostModel:
    """Non-negative least squares fit of step seconds on [1, padded_tokens, attention (, new shape)].

    Observations are taken in step order; with `shape_overhead` a step counts as a new shape the first time its
    (R, T) appears within its `run`. Raises CostModelError naming the problem when the observations cannot
    separate the terms (too few, every step the same shape, attention collinear with padding).
    """
    obs = list(observations)
    for i, o in enumerate(obs):
        _check_observation(i, o)
    X, names = _design(obs, shape_overhead)  # (N, P)
    y = np.array([o.seconds for o in obs], dtype=np.float64)  # (N,)
    n, p = X.shape
    if n < p + 1:
        raise CostModelError(f"fit_cost_model: {n} observations for {p} terms; need at least {p + 1}")
    shapes = {o.key for o in obs}
    if len(shapes) < 2:
        raise CostModelError(f"fit_cost_model: all {n} observations have the same (rows, row_len) = "
                             f"{next(iter(shapes))}; steps of several shapes are needed to separate a, b, c")
    scale = np.abs(X).max(axis=0)  # (P,) columns scaled to [0, 1] so the solve is well conditioned
    scale[scale == 0] = 1.0
    Xs = X / scale  # (N, P)
    rank = np.linalg.matrix_rank(Xs, tol=1e-9 * max(Xs.shape))
    if rank < p:
        raise CostModelError(f"fit_cost_model: the {n} observations span only {rank} of the {p} terms "
                             f"({', '.join(names)}): "
                             f"{len(shapes)} distinct shapes whose padded tokens and attention are collinear; "
                             "probe batches with more varied row counts and row lengths")
    coef = _nnls(Xs, y) / scale  # (P,)
    resid = y - X @ coef  # (N,)
    w = dict(zip(names, (float(v) for v in coef)))
    return CostModel(a=w["a"], b=w["b"], c=w["c"], d=w.get("d", 0.0), shape_overhead=shape_overhead, n_obs=n,
                     rmse_s=float(np.sqrt(np.mean(resid**2))), rel_rmse=float(np.sqrt(np.mean((resid / y) ** 2))),
                     e=w.get("e", 0.0))


@dataclass(frozen=True)
class HeldOut:
    """One strategy predicted by a model fitted on the other strategies only."""

    strategy: str  # the held-out strategy
    steps: int  # its measured steps
    realized_tok_s: float  # measured real tokens / measured seconds
    predicted_tok_s: float  # measured real tokens / predicted seconds of the same batches
    rel_error: float  # predicted / realized - 1 (signed)


def leave_one_out(obs_by_strategy: Mapping[str, Sequence[StepObservation]],
                  shape_overhead: bool = False) -> dict[str, HeldOut]:
    """For each strategy: fit on all OTHER strategies, predict its throughput, compare with the measurement."""
    if len(obs_by_strategy) < 2:
        raise CostModelError(f"leave_one_out: needs at least 2 strategies, got {sorted(obs_by_strategy)}")
    out: dict[str, HeldOut] = {}
    for held, steps in obs_by_strategy.items():
        if not steps:
            raise CostModelError(f"leave_one_out: strategy {held!r} has no observations")
        train = [o for name, obs in obs_by_strategy.items() if name != held for o in obs]
        try:
            model = fit_cost_model(train, shape_overhead)
        except CostModelError as e:
            raise CostModelError(f"leave_one_out without {held!r}: {e}") from None
        flags = _new_shape_flags(steps)
        predicted_s = sum(model.predict_step(o, f) for o, f in zip(steps, flags))
        real = sum(o.real_tokens for o in steps)
        realized = real / sum(o.seconds for o in steps)
        predicted = real / predicted_s
        out[held] = HeldOut(held, len(steps), realized, predicted, predicted / realized - 1.0)
    return out


@dataclass(frozen=True)
class CostModelChoice:
    """The model fitted on every strategy, with the shape term kept only if it lowered the held-out error."""

    model: CostModel  # fitted on all observations
    held_out: dict[str, HeldOut]  # leave-one-out of the chosen variant
    held_out_without_shape: dict[str, HeldOut]  # leave-one-out of a, b, c alone
    held_out_with_shape: dict[str, HeldOut] | None  # leave-one-out with d too (None when it could not be fitted)

    @property
    def max_abs_error(self) -> float:
        """Worst |predicted / realized - 1| over held-out strategies."""
        return max(abs(h.rel_error) for h in self.held_out.values())


def select_cost_model(obs_by_strategy: Mapping[str, Sequence[StepObservation]]) -> CostModelChoice:
    """Fit with and without the per-shape term; keep the shape term only if it lowers the mean held-out error."""
    plain = leave_one_out(obs_by_strategy, shape_overhead=False)
    try:
        shaped: dict[str, HeldOut] | None = leave_one_out(obs_by_strategy, shape_overhead=True)
    except CostModelError:
        shaped = None  # e.g. no run ever repeats a shape: d is not identifiable
    use_shape = shaped is not None and _mean_abs(shaped) < _mean_abs(plain)
    every = [o for obs in obs_by_strategy.values() for o in obs]
    model = fit_cost_model(every, shape_overhead=use_shape)
    return CostModelChoice(model, shaped if use_shape else plain, plain, shaped)


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


def _design(obs: Sequence[StepObservation], shape_overhead: bool) -> tuple[np.ndarray, list[str]]:
    """The design matrix (N, P) and its term names: a, b, c, then e when blocks were counted, d when asked."""
    cols = [np.ones(len(obs)), [o.padded_tokens for o in obs], [o.attention for o in obs]]
    names = ["a", "b", "c"]
    if any(o.blocks for o in obs):
        cols.append([o.blocks for o in obs])
        names.append("e")
    if shape_overhead:
        cols.append(_new_shape_flags(obs))
        names.append("d")
    return np.column_stack(cols).astype(np.float64), names


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
