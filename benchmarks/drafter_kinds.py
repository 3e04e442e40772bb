"""Training throughput of the drafter kinds on the demo's job, taking turns on the same machine:

    .venv/bin/python -P benchmarks/drafter_kinds.py --steps 120 --rounds 2

Each round trains `--preset demo` on the demo's data (the real target's own answers, as `make demo` makes them;
notebook 04's split) for `--steps` steps with each kind in turn (`-p drafter_kind`, the whole head: dflash2 refuses
a draft vocabulary, so dflash runs without one too), the same seed and batches, no held-out pass and no checkpoint,
into a temporary folder. Prints per kind the training loop's real tokens per second of every round (the run
summary's own figures: the first steps' compile and warm-up included alike) and the ratio of the medians. Taking
turns keeps a load that drifts over the minutes from favouring one kind.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from dflash_lib.lab.demo import engine_available, prepare_target, train_link
from dflash_lib.rundir import load_config
from dflash_lib.train.loop import train

KINDS = ("dflash", "dflash2")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    base = {"draft_vocab": 0}
    params, inputs = prepare_target("demo", base, kind="real", engine=engine_available())
    params = {**params, **train_link(inputs), **base, "steps": a.steps, "eval_every": 0, "eval_samples": 0,
              "ckpt_every": 0, "wandb_mode": "disabled"}
    ktok: dict[str, list[float]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for kind in KINDS:
                summary = train(load_config({**params, "drafter_kind": kind}, "demo"), Path(tmp) / f"{kind}-{r}")
                ktok[kind].append(summary.real_tokens / summary.loop_s / 1e3)
                print(f"round {r} {kind}: {ktok[kind][-1]:.3f} Ktok/s ({summary.loop_s:.1f} s)", flush=True)
    medians = {k: statistics.median(v) for k, v in ktok.items()}
    print(json.dumps({"steps": a.steps, "rounds": a.rounds, "ktok_s": ktok, "median_ktok_s": medians,
                      "dflash2_over_dflash": medians["dflash2"] / medians["dflash"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
