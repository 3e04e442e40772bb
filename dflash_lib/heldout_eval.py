"""The held-out evaluations inside a training run: which ranks run them, when, and what the run keeps of them.

`heldout` holds the split and one evaluation (`build_eval_set`, `evaluate`); this is the loop's side. Rank 0
records the split in heldout.json and evaluates ALL the held-out samples every `eval_every` steps and after the
run's last step (not on a stop: a resumed run then logs exactly the rows of an uninterrupted one). The other
ranks never evaluate, except under FSDP, where every rank runs the same evaluation because each layer's forward
all-gathers its shards.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from dflash_lib.config import Config
from dflash_lib.distributed import Engine
from dflash_lib.heldout import HELDOUT_FILE, EvalSet, build_eval_set, evaluate
from dflash_lib.parts import TrainingParts
from dflash_lib.runs import write_json


class HeldOutEvaluator:
    """The held-out evaluations of one training run on `parts` (see the module docstring). `latest`: the
    latest evaluation's figures (heldout_step + HELDOUT_KEYS + heldout_s), {} before the first."""

    def __init__(self, config: Config, parts: TrainingParts, engine: Engine, main: bool) -> None:
        self.config, self.parts, self.engine, self.main = config, parts, engine, main
        self.eval_set: EvalSet | None = None  # held-out batches with fixed anchors (built by `prepare`)
        self.latest: dict[str, Any] = {}

    def prepare(self, run_dir: Path) -> None:
        """Rank 0: record the split in run_dir/heldout.json; the evaluating ranks lay out the evaluation
        batches (the first `eval_samples` held-out samples, anchors drawn once)."""
        p, tc = self.parts, self.config.train
        if not (self.main or self.engine.kind == "fsdp") or p.heldout is None:
            return
        source = p.full_store if p.full_store is not None else p.store
        if self.main:
            write_json(run_dir / HELDOUT_FILE, p.heldout.record(len(source)))
        if tc.eval_samples > 0 and len(p.heldout.heldout):
            self.eval_set = build_eval_set(source, p.heldout.heldout, p.drafter, p.pad_id,
                                           self.config.sampler.token_budget, tc.seed, tc.eval_samples)

    def due(self, step: int, final: bool) -> bool:
        """Evaluate after optimizer step `step` (1-based): every `eval_every` steps, and when `final` (the run's
        last step) on a rank that evaluates."""
        if self.eval_set is None or not self.eval_set.samples:
            return False
        every = self.config.train.eval_every
        return final or (every > 0 and step % every == 0)

    def run(self, step: int, say: Callable[[str], None]) -> dict[str, Any]:
        """The drafter on the evaluation batches now (`heldout.evaluate`, after optimizer step `step`): the
        HELDOUT_KEYS figures and heldout_s (seconds); kept in `latest` and said in one line."""
        t0 = time.perf_counter()
        with self.engine.full_root():
            figures = evaluate(self.parts.drafter, self.parts.targets[0], self.eval_set,
                               self.parts.targets[0].device.type == "cuda")
        figures["heldout_s"] = time.perf_counter() - t0
        self.latest = dict(heldout_step=step, **figures)
        say(f"held-out at step {step} ({figures['heldout_samples']} samples): loss {figures['heldout_loss']:.3f} | "
            f"acc {figures['heldout_acc']:.3f} | tau {figures['heldout_tau']:.3f} | "
            f"eal_marginal {figures['heldout_eal_marginal']:.3f}")
        return figures
