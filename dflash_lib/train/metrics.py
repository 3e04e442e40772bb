"""Training metrics: one step's record (`StepMetrics`, a metrics.jsonl row) and one held-out evaluation's
(`HeldoutFigures`, written flat), the console log line, the metrics.jsonl and wandb sinks, throughput, data wait and
ETA (`SteadyStateDetector`, `ThroughputMeter`).

Stdlib only in the loop (wandb is imported lazily, pandas only by `load_metrics`); every timing takes an injected
clock, so tests drive it with a synthetic one. The log line and the ETA: docs/runs.md, "Training outside notebooks".
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import deque
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Self

from dflash_lib.rundir import JsonRecord, omitted

if TYPE_CHECKING:
    import pandas as pd


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


@dataclass
class StepMetrics(WithHeldoutFigures):
    """One optimizer step in figures: a row of metrics.jsonl (`to_json`), the same scalars to wandb, the log line's
    source. Written by rank 0; "all ranks" figures are summed over every rank, "this rank" ones are rank 0's."""

    step: int  # optimizer step, 1-based (1 = the first update)
    epoch: int  # epoch of the step's last micro-batch
    loss: float  # cross-entropy (nats per scored position) normalised by the step's global weight sum; NaN when
    # the loss was not finite (the update skipped)
    acc: float  # top-1 accuracy of the scored positions, weighted as the loss
    lr: float  # learning rate of this step (`schedule.lr_at`)
    noise: float  # fraction of block positions fed as MASK (`schedule.noise_at`)
    real_tokens: int  # document tokens of the step, all ranks
    padded_tokens: int  # token slots paid for, padding included (rows x row length), all ranks
    ktok_s: float  # real-token throughput over the meter's last window of steps (thousand tokens / second)
    data_wait_pct: float  # % of the last window's wall time spent blocked waiting for data
    data_wait_pct_total: float  # the same over all of this invocation's loop so far
    q_pre: list[int]  # batches waiting for each target worker, per worker
    q_hs: list[int]  # batches with target features waiting for the drafter, per worker
    bucket: int  # length bucket of the step's first micro-batch; -1 = none (packed rows, or no batch here)
    eta_s: float | None  # seconds to the end of THIS invocation (the planned steps or `stop_at_step`) at the steady
    # throughput, before steady state provisionally at the rolling one (module docstring); None without a rate
    run_eta_s: float | None  # seconds to the end of the planned steps, same rate
    full_run_eta_s: float | None  # seconds to the end of a full run (`full_run_epochs` over the corpus), same rate
    steady: bool  # the throughput's steady-state detector has fired
    acc_per_pos: list[float]  # (B-1,) top-1 accuracy per draft position after the anchor
    eal: float  # expected acceptance length from acc_per_pos (tokens): the marginal-product ESTIMATE, biased low
    tau_inbatch: float  # EXACT in-batch acceptance length (tokens): mean over the step's blocks of 1 + the block's
    # own leading run of correct positions; NaN with no block
    time: float  # seconds since this invocation's trainer was built
    grad_norm: float  # global gradient norm before clipping; NaN when the update was skipped
    micro_batches: int  # micro-batches accumulated into this step (`accum_tokens`)
    skipped: bool  # no optimizer update (a non-finite loss)
    step_s: float  # wall time of this step, data wait included (seconds)
    wait_s: float  # seconds this step spent blocked waiting for data
    blocks: int  # anchor blocks the drafter ran, this rank
    head_rows: int  # scored positions run through the LM head + CE, this rank
    bad_steps: int  # steps with a non-finite loss since the run began
    skipped_samples: int  # samples left out by validation since the run began, all ranks
    skipped_tokens: int  # tokens of this step's samples left out by validation, all ranks
    # The step's batch shape, for the step-time cost model (`summary.batch_shape`); absent when this rank ran no batch:
    rows: int | None = omitted()  # rows of this rank's micro-batches
    row_len: int | None = omitted()  # longest row (tokens)
    attn_dense: float | None = omitted()  # attention work of whole rows, sum of R x T^2 (tokens^2)
    attn_varlen: float | None = omitted()  # attention work per document, sum of doc_len^2 (tokens^2)
    # How full this rank's micro-batches are in each budget (`plan.sampler.budget.BatchBudget`, `summary.budget_fill`);
    # absent when this rank ran no batch or its sampler fills by no budget:
    token_fill: float | None = omitted()  # mean token cost / token budget (padding counted, as the budget counts it)
    query_fill: float | None = omitted()  # mean drafter query tokens / block budget; absent without a block budget
    bound_tokens: float | None = omitted()  # share of the micro-batches the token budget closed (the next sample
    # would have passed it); absent when the sampler's plan does not say
    bound_blocks: float | None = omitted()  # share of the micro-batches the block budget closed (both: in both)
    heldout: HeldoutFigures | None = omitted()  # the held-out evaluation (`heldout.evaluate`), written flat as
    # HELDOUT_KEYS; on evaluation steps only (every `eval_every` steps and the run's last step)


BUDGET_FIGURES = ("token_fill", "query_fill", "bound_tokens", "bound_blocks")  # StepMetrics' budget figures, whose
# run means the summary keeps (`RunSummary`)

LOG_LINE_KEYS = ("step", "loss", "acc", "lr", "noise", "ktok_s", "data_wait_pct", "bucket", "eta_s", "steady",
                 "q_pre", "q_hs")


def format_duration(seconds: float | None) -> str:
    """Seconds as a short human figure: `42s`, `12.5m`, `5.1h`, `5.1d`; `--` for None/inf/NaN."""
    if seconds is None or not math.isfinite(seconds):
        return "--"
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    if seconds < 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _queue_list(depths: Any) -> str:
    return "[" + ",".join(str(int(d)) for d in depths) + "]"


def format_log_line(m: Mapping[str, Any]) -> str:
    """One console line per step, in the reference run's format (docs/dflash.md), e.g.

    `step 58 | loss 1.42 | acc 0.61 | lr 1.2e-05 | noise 1.00 | 25.1 Ktok/s | wait 0.4% | bucket 3 | ETA 5.1d |
    q_pre=[50,50] q_hs=[0]` (one line). `m` needs the keys in `LOG_LINE_KEYS`. With the budget figures
    (`StepMetrics.token_fill` ...) it goes on: `| fill tok 0.70 blk 1.00 | bound tok 0.00 blk 1.00` (how full
    the batches are in the token and block budgets, and the share of them each budget closed).
    """
    missing = [k for k in LOG_LINE_KEYS if k not in m]
    if missing:
        raise KeyError(f"format_log_line: metrics lack {missing}")
    eta = format_duration(m["eta_s"])
    eta = eta if m["steady"] or eta == "--" else "~" + eta
    line = (f"step {m['step']} | loss {m['loss']:.2f} | acc {m['acc']:.2f} | lr {m['lr']:.1e} | "
            f"noise {m['noise']:.2f} | {m['ktok_s']:.1f} Ktok/s | wait {m['data_wait_pct']:.1f}% | "
            f"bucket {m['bucket']} | ETA {eta} | q_pre={_queue_list(m['q_pre'])} q_hs={_queue_list(m['q_hs'])}")
    for label, tokens, blocks in (("fill", "token_fill", "query_fill"), ("bound", "bound_tokens", "bound_blocks")):
        if m.get(tokens) is not None:
            line += f" | {label} tok {m[tokens]:.2f}" + (f" blk {m[blocks]:.2f}" if m.get(blocks) is not None else "")
    return line


def _json_safe(value: Any) -> Any:
    """Non-finite floats become null (JSON has no NaN); containers are converted recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


class NullSink:
    """The no-op stand-in: same interface as every sink, does nothing."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlSink:
    """Appends one JSON object per `log` call to `path` (created with its folder) and flushes every line."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        record = _json_safe({"step": step, **metrics})
        self._f.write(json.dumps(record, allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def _wandb_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """wandb plots scalars: lists become `key/i` entries; strings and None are left out."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, bool):
            out[k] = float(v)
        elif isinstance(v, (int, float)):
            out[k] = v
        elif isinstance(v, (list, tuple)):
            out.update({f"{k}/{i}": x for i, x in enumerate(v) if isinstance(x, (int, float))})
    return out


class WandbSink:
    """Logs to Weights & Biases, offline by default. `mode` is "offline" | "online" | "disabled".

    The environment variable WANDB_MODE=disabled wins over `mode` (tests and CI set it), and wandb is not
    even imported when disabled, so the sink then behaves like `NullSink`.
    """

    def __init__(self, mode: str, project: str, run_dir: str | Path, config: Mapping[str, Any] | None = None,
                 name: str | None = None) -> None:
        if mode not in ("offline", "online", "disabled"):
            raise ValueError(f"WandbSink: mode must be offline|online|disabled, got {mode!r}")
        self.mode = "disabled" if os.environ.get("WANDB_MODE") == "disabled" else mode
        self._run = None
        if self.mode != "disabled":
            import wandb  # deferred: heavy, and unnecessary when disabled

            Path(run_dir).mkdir(parents=True, exist_ok=True)
            self._run = wandb.init(project=project, dir=str(run_dir), mode=self.mode, config=dict(config or {}),
                                   name=name)

    @property
    def active(self) -> bool:
        return self._run is not None

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if self._run is not None:
            self._run.log(_wandb_scalars(metrics), step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


class SteadyStateDetector:
    """Declares a per-step series (e.g. tokens/s) steady once its last `window` values neither drift nor scatter.

    Drift: least-squares slope over the window times its span, relative to the window mean (a warm-up ramp
    shows as a large drift). Scatter: coefficient of variation (std / mean). Steady when |drift| <= max_drift
    and cv <= max_cv. The decision latches: warm-up is a one-time transient, and later fluctuations belong to
    the steady mean. `start_step` is the first step of the first steady window; `mean` averages every value
    from it on.
    """

    def __init__(self, window: int = 20, max_drift: float = 0.10, max_cv: float = 0.25) -> None:
        if window < 3:
            raise ValueError(f"SteadyStateDetector: window must be >= 3, got {window}")
        self.window, self.max_drift, self.max_cv = window, max_drift, max_cv
        self._recent: deque[tuple[int, float]] = deque(maxlen=window)
        self.steady = False
        self.start_step: int | None = None
        self._sum = 0.0
        self._count = 0
        self.last_drift = math.nan
        self.last_cv = math.nan

    @staticmethod
    def window_stats(values: list[float]) -> tuple[float, float, float]:
        """(mean, relative drift, coefficient of variation) of `values` (at least two)."""
        n = len(values)
        mean = sum(values) / n
        if mean <= 0:
            return mean, math.inf, math.inf
        xm = (n - 1) / 2
        sxx = sum((i - xm) ** 2 for i in range(n))
        slope = sum((i - xm) * (v - mean) for i, v in enumerate(values)) / sxx
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
        return mean, slope * (n - 1) / mean, std / mean

    def update(self, step: int, value: float) -> bool:
        """Feed the value of `step`; returns whether the series is (now) steady."""
        if self.steady:
            self._sum += value
            self._count += 1
            return True
        self._recent.append((step, value))
        if len(self._recent) < self.window:
            return False
        values = [v for _, v in self._recent]
        _, self.last_drift, self.last_cv = self.window_stats(values)
        if abs(self.last_drift) <= self.max_drift and self.last_cv <= self.max_cv:
            self.steady = True
            self.start_step = self._recent[0][0]
            self._sum, self._count = sum(values), len(values)
        return self.steady

    @property
    def mean(self) -> float | None:
        """Mean of the values since `start_step` (None before steady state)."""
        return self._sum / self._count if self.steady else None


@dataclass
class StepRate:
    """Throughput and data-wait figures after one optimizer step."""

    dt_s: float  # wall time of this step (seconds), data wait included
    tok_s: float  # this step's real tokens / dt_s
    ktok_s: float  # real-token throughput of the last `window` steps (thousand tokens / second)
    data_wait_pct: float  # % of all wall time so far spent blocked waiting for data
    data_wait_pct_window: float  # same over the last `window` steps
    steady: bool  # the steady-state detector has fired
    steady_start_step: int | None  # first step of the steady window
    steady_tok_s: float | None  # real tokens / second since steady_start_step (None before steady state)

    @property
    def eta_tok_s(self) -> float:
        """The throughput an ETA should use: steady if known, else the recent window (provisional)."""
        return self.steady_tok_s if self.steady_tok_s is not None else self.ktok_s * 1000.0


def eta_seconds(remaining_tokens: float, tok_s: float) -> float | None:
    """Seconds to process `remaining_tokens` at `tok_s` tokens/second; None without a positive rate."""
    if tok_s <= 0 or not math.isfinite(tok_s):
        return None
    return max(0.0, remaining_tokens) / tok_s


class ThroughputMeter:
    """Times optimizer steps with an injected clock: throughput of REAL tokens, data-wait %, steady state.

    Call `start()` right before the first `next()` of the data stream, then `step(...)` after each optimizer
    step with that step's real tokens and the seconds it spent blocked on data.

    One step's throughput swings with its batch (bucketed batches differ in documents, anchors and padding per
    token), so the detector watches the ROLLING throughput of the last `window` steps (their tokens / their
    time), fed once that window is full: steady state is declared at step 2 * window - 1 at the earliest. The
    steady figures (`steady_tok_s`, `steady_data_wait_pct`) sum every step from the detector's `start_step` on.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, window: int = 10,
                 detector: SteadyStateDetector | None = None) -> None:
        if window < 1:
            raise ValueError(f"ThroughputMeter: window must be >= 1 step, got {window}")
        self.clock, self.window = clock, window
        self.detector = detector or SteadyStateDetector(window=max(3, window))
        self._recent: deque[tuple[float, int, float]] = deque(maxlen=window)  # (dt, tokens, wait)
        self._t0: float | None = None
        self._last: float | None = None
        self.steps = 0
        self.real_tokens = 0
        self.padded_tokens = 0
        self.wait_s = 0.0
        self._steady_tokens = 0
        self._steady_time = 0.0
        self._steady_wait = 0.0
        # (step, dt, tokens, wait) of the detector's current window, folded into the steady sums when it fires
        self._history: deque[tuple[int, float, int, float]] = deque(maxlen=self.detector.window)

    def start(self) -> None:
        self._t0 = self._last = self.clock()

    @property
    def elapsed_s(self) -> float:
        return 0.0 if self._t0 is None else self.clock() - self._t0

    def step(self, step: int, real_tokens: int, padded_tokens: int, wait_s: float) -> StepRate:
        if self._last is None or self._t0 is None:
            raise RuntimeError("ThroughputMeter.step called before start()")
        now = self.clock()
        dt = max(now - self._last, 1e-12)
        self._last = now
        self.steps += 1
        self.real_tokens += real_tokens
        self.padded_tokens += padded_tokens
        self.wait_s += wait_s
        self._recent.append((dt, real_tokens, wait_s))
        win_dt = sum(d for d, _, _ in self._recent)
        win_tok = sum(t for _, t, _ in self._recent)
        win_wait = sum(w for _, _, w in self._recent)
        was_steady = self.detector.steady
        if not was_steady:
            self._history.append((step, dt, real_tokens, wait_s))
        steady = self.detector.steady
        if len(self._recent) == self.window:
            steady = self.detector.update(step, win_tok / win_dt)
        if steady and was_steady:
            self._steady_time += dt
            self._steady_tokens += real_tokens
            self._steady_wait += wait_s
        elif steady:  # fired now: the steady window's steps are in the history
            for s, d, tok, w in self._history:
                if s >= self.detector.start_step:
                    self._steady_time += d
                    self._steady_tokens += tok
                    self._steady_wait += w
            self._history.clear()
        return StepRate(
            dt_s=dt, tok_s=real_tokens / dt, ktok_s=win_tok / win_dt / 1000.0,
            data_wait_pct=100.0 * self.wait_s / max(now - self._t0, 1e-12),
            data_wait_pct_window=100.0 * win_wait / win_dt, steady=steady,
            steady_start_step=self.detector.start_step,
            steady_tok_s=self.steady_tok_s,
        )

    @property
    def steady_data_wait_pct(self) -> float | None:
        """% of the steady window's wall time spent waiting for data (None before steady state)."""
        return 100.0 * self._steady_wait / self._steady_time if self.detector.steady else None

    @property
    def steady_time_s(self) -> float:
        """Wall time (seconds) of the steps since the steady window began."""
        return self._steady_time

    @property
    def steady_tok_s(self) -> float | None:
        """Real tokens / second since the steady window began (None before steady state)."""
        return self._steady_tokens / self._steady_time if self.detector.steady else None


def load_metrics(path: str | Path) -> pd.DataFrame:
    """metrics.jsonl (or a run folder holding it) as a frame, one row per step, sorted by step.

    A torn last line (a run killed mid-write) is ignored; any other bad line is an error naming the line.
    """
    import pandas as pd  # heavy to import; the training loop never reads a frame

    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    lines = path.read_text().splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if n == len(lines):
                break
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
    if not rows:
        raise ValueError(f"{path}: no steps logged")
    return pd.DataFrame(rows).sort_values("step").reset_index(drop=True)
