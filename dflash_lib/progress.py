"""Where a training run stands: the counters its loop advances every step (the same on every rank) and the
trainer state a checkpoint records of them, so that a resumed run continues exactly where it stood.

Besides the step (the lr schedule is a function of it) and the GLOBAL data position, the state carries the
bad-step guard, the throughput meter's token counts, every rank's skipped samples (merged) and the sampler's
fingerprint (a resume on other data or sampler settings is refused). Anchors need no state: each micro-batch's
draw is seeded by its sampler position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dflash_lib.checkpoint import CheckpointError
from dflash_lib.metrics import ThroughputMeter
from dflash_lib.validate import BadStepGuard, SkipCounter

TRAIN_STATE_FORMAT = 3  # layout of the trainer's checkpoint state; bump when it changes


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
    last: dict[str, Any] = field(default_factory=dict)  # the latest step's metrics record
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
                      "acc": [self.acc_mean.total, self.acc_mean.count]},
            "last": self.last,
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
        self.last = dict(state["last"])
        self.step = self.resumed_from = int(state["step"])
        pos = state["position"]
        self.position, self.batches_done = (int(pos["epoch"]), int(pos["step"])), int(pos["done"])
        self.empty_batches = int(pos.get("empty", 0))  # absent from checkpoints written before it was counted
        if "sampler" in state and hasattr(sampler, "load_state_dict"):
            sampler.load_state_dict(state["sampler"])
