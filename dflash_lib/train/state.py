"""Where a training run stands: the counters its loop advances every step (the same on every rank) and the
trainer state a checkpoint records of them, so that a resumed run continues exactly where it stood.

`Progress` (step, GLOBAL data position, sampler fingerprint, counters), `BadStepGuard` (a non-finite loss skips its
step, too many in a row abort) and `StopRequest` (SIGTERM/SIGINT: finish the step, checkpoint, exit 0; a second
signal aborts; inert off the main thread); the skipped samples' `SkipCounter` is `data/validation.py`'s. What a stop
and a resume do: docs/runs.md, "Runs that survive: resume, stop, torchrun".
"""

from __future__ import annotations

import math
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Sequence

import torch

from dflash_lib.rundir.checkpoints import CheckpointError, list_checkpoints
from dflash_lib.rundir.records import BUDGET_FIGURES
from dflash_lib.data.validation import SkipCounter
from dflash_lib.train.metrics import StepMetrics, ThroughputMeter

TRAIN_STATE_FORMAT = 3  # layout of the trainer's checkpoint state; bump when it changes

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # what a scheduler (preemption) or a user (Ctrl-C) sends


class NonFiniteLossError(RuntimeError):
    """Too many optimizer steps in a row had a NaN or infinite loss: the run is aborted."""


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


@dataclass
class Progress:
    """Where the run stands after `step` optimizer steps, the same on every rank."""

    total_steps: int  # optimizer steps the lr schedule is planned for
    data_shards: int  # D: batches per sampler step, shared by the ranks
    step: int = 0  # optimizer steps completed
    position: tuple[int, int] = (0, 0)  # (epoch, sampler step) of the next batch to consume
    batches_done: int = 0  # sampler steps consumed since the run began
    skipped_samples: int = 0  # samples skipped by validation since the run began, all ranks
    empty_batches: int = 0  # sampler steps read since the run began in which no rank had a token to score:
    # they advance `position` and `batches_done`, not `step`
    loss_mean: RunningMean = field(default_factory=RunningMean)  # of the steps' global losses (nats)
    acc_mean: RunningMean = field(default_factory=RunningMean)  # of the steps' top-1 accuracies
    budget_means: dict[str, RunningMean] = field(default_factory=lambda: {k: RunningMean() for k in BUDGET_FIGURES})
    # BUDGET_FIGURES -> mean of this rank's step figures (the summary is rank 0's; a step without one, e.g. no
    # budget, is left out)
    last: StepMetrics | None = None  # the latest step's metrics (None before the first step)
    resumed_from: int = 0  # the step this invocation resumed from (0: it started the run)

    def state_dict(self, world_size: int, guard: BadStepGuard, meter: ThroughputMeter, skips: SkipCounter,
                   sampler: Any) -> dict[str, Any]:
        """The trainer state of a checkpoint: this progress, the data shards and `world_size` that wrote it,
        `guard`'s and `skips`' counts (every rank's skips, merged), `meter`'s token counts and, when `sampler`
        has a `state_dict`, its fingerprint at this position."""
        epoch, step = self.position
        state = {
            "format": TRAIN_STATE_FORMAT, "step": self.step, "total_steps": self.total_steps,
            "data_shards": self.data_shards, "world_size": world_size,
            "position": {"epoch": epoch, "step": step, "done": self.batches_done, "empty": self.empty_batches},
            "guard": guard.state_dict(), "skips": skips.state_dict(),
            "tokens": {"steps": meter.steps, "real": meter.real_tokens, "padded": meter.padded_tokens,
                       "skipped_samples": self.skipped_samples},
            "means": {"loss": [self.loss_mean.total, self.loss_mean.count],
                      "acc": [self.acc_mean.total, self.acc_mean.count],
                      **{k: [m.total, m.count] for k, m in self.budget_means.items()}},
            "last": self.last.to_json() if self.last is not None else {},  # its metrics.jsonl row
        }
        sampler_state = getattr(sampler, "state_dict", None)
        if sampler_state is not None:  # its fingerprint lets a resume refuse other data or sampler settings
            state["sampler"] = {**sampler_state(), "epoch": epoch, "step": step}
        return state

    def check(self, state: dict[str, Any], where: str) -> None:
        """Refuse (CheckpointError) the trainer state of another format, schedule length or data shards."""
        if state.get("format") != TRAIN_STATE_FORMAT:
            raise CheckpointError(f"{where}: trainer state format {state.get('format')!r} is not "
                                  f"{TRAIN_STATE_FORMAT}; use --fresh or another --run-dir")
        if state["total_steps"] != self.total_steps:
            raise CheckpointError(f"{where}: planned {state['total_steps']} steps, this run plans "
                                  f"{self.total_steps} (the corpus or sampler changed); use --fresh")
        if state["data_shards"] != self.data_shards:
            raise CheckpointError(f"{where}: its batches are cut into {state['data_shards']} data shards, this "
                                  f"run into {self.data_shards} (build the parts with data_shards from the "
                                  f"checkpoint)")

    def load_state_dict(self, state: dict[str, Any], guard: BadStepGuard, meter: ThroughputMeter,
                        sampler: Any) -> None:
        """Continue from a checkpoint's trainer state (`check`ed first): this progress, `guard`, `meter`'s
        token counts and `sampler`'s position (SamplerError on other data or settings). The merged skip counts
        are the caller's to restore (rank 0 keeps them)."""
        guard.load_state_dict(state["guard"])
        meter.steps, meter.real_tokens, meter.padded_tokens, self.skipped_samples = (
            int(state["tokens"][k]) for k in ("steps", "real", "padded", "skipped_samples"))
        self.loss_mean = RunningMean(*state["means"]["loss"])
        self.acc_mean = RunningMean(*state["means"]["acc"])
        # absent from checkpoints written before the summary kept them: the means then cover this invocation only
        self.budget_means = {k: RunningMean(*state["means"].get(k, (0.0, 0))) for k in BUDGET_FIGURES}
        try:
            self.last = StepMetrics.from_json(state["last"]) if state["last"] else None
        except ValueError as e:  # a row of another trainer version
            raise CheckpointError(f"trainer state: its last metrics row: {e}; use --fresh") from None
        self.step = self.resumed_from = int(state["step"])
        pos = state["position"]
        self.position, self.batches_done = (int(pos["epoch"]), int(pos["step"])), int(pos["done"])
        self.empty_batches = int(pos.get("empty", 0))  # absent from checkpoints written before it was counted
        if "sampler" in state and hasattr(sampler, "load_state_dict"):
            sampler.load_state_dict(state["sampler"])


class StopRequest:
    """Context manager: while entered, STOP_SIGNALS set `requested` instead of killing the process.

    Outside the context (or when not entered at all) it is a request that never comes, which is what
    `run_training` uses when its caller installs no handlers.
    """

    def __init__(self, signals: Sequence[signal.Signals] = STOP_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.signum: int | None = None  # the first signal received (None = no stop requested)
        self.on_request: list[Callable[[], None]] = []  # called at the first signal (a served target's engine
        # client stops waiting out a hung engine's timeouts)
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def reason(self) -> str | None:
        """The signal's name, e.g. "SIGTERM" (None when no stop was requested)."""
        return None if self.signum is None else signal.Signals(self.signum).name

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            self._restore()
            raise KeyboardInterrupt(f"second stop signal ({name}): aborting without waiting for the checkpoint")
        self.signum = signum
        for call in self.on_request:
            call()
        print(f"received {name}: finishing the current step, then saving a checkpoint and exiting "
              f"(send it again to abort at once)", file=sys.stderr, flush=True)




@dataclass
class BadStepGuard:
    """Decides, per step, whether the loss is finite enough to step on; aborts after `max_in_a_row` bad ones.

    Under DDP every rank must take the same decision: pass the globally reduced loss (or any rank's flag summed).
    """

    max_in_a_row: int  # consecutive non-finite losses that abort the run
    in_a_row: int = 0  # current streak of non-finite losses
    total: int = 0  # non-finite losses over the whole run
    last_bad_step: int = -1  # step of the most recent non-finite loss (-1 = none)
    checkpoints: Path | None = None  # the run's checkpoint folder: the abort says what a rerun resumes from

    def __post_init__(self) -> None:
        if type(self.max_in_a_row) is not int or self.max_in_a_row < 1:
            raise ValueError(f"max_in_a_row (max_bad_steps) must be an int >= 1, got {self.max_in_a_row!r}")

    def ok(self, loss: float | torch.Tensor, step: int) -> bool:
        """True when `loss` is finite (take the step); False to skip it. Raises NonFiniteLossError when this is
        the `max_in_a_row`-th non-finite loss in a row."""
        value = float(loss.detach().float().sum()) if isinstance(loss, torch.Tensor) else float(loss)
        if math.isfinite(value):
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.total += 1
        self.last_bad_step = step
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteLossError(f"loss was {value} for {self.in_a_row} steps in a row (up to step {step}); "
                                     f"aborting (max_bad_steps={self.max_in_a_row}){self._resume_note()}")
        return False

    def _resume_note(self) -> str:
        """'; ' + what a rerun resumes from: the newest checkpoint in `checkpoints` (a skipped step leaves the
        weights as they were, so any checkpoint holds finite ones), or that there is none ("" without a folder)."""
        if self.checkpoints is None:
            return ""
        saved = list_checkpoints(self.checkpoints)
        return (f"; the newest checkpoint, {saved[-1]}, is intact" if saved else
                f"; no checkpoint was written yet (none in {self.checkpoints}): a rerun starts from step 0")

    def state_dict(self) -> dict[str, int]:
        return {"in_a_row": self.in_a_row, "total": self.total, "last_bad_step": self.last_bad_step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.in_a_row, self.total, self.last_bad_step = (int(state[k]) for k in ("in_a_row", "total",
                                                                                  "last_bad_step"))
