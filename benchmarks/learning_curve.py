"""Where a drafter recipe is going: decoded held-out tau against training tokens.

    .venv/bin/python benchmarks/learning_curve.py                          # the demo's recipe, its 500 steps
    .venv/bin/python benchmarks/learning_curve.py --steps 4000 --every 250    # ~1 hour on 2 idle cores
    .venv/bin/python benchmarks/learning_curve.py --steps 40 --every 20 --prompts 2 --max-new-tokens 16  # a test
    .venv/bin/python benchmarks/learning_curve.py --decode-only RUN_DIR    # decode a run's checkpoints again

Trains one run (`dflash_lib.train.train`: `--preset`, `-p KEY VALUE` as `python -m dflash_lib train` takes them)
with a checkpoint every `--every` steps, all kept, and stops it early, checkpointed, past `--minutes` of training
or `--tokens` real training tokens. With the demo preset it trains on the demo's data: the real target's answers
(`lab.demo.prepare_target`, made or read from the cache as `make demo` does) split as notebook 04 splits them.
Then every checkpoint is decoded greedily on the same held-out prompts (`evaluate.acceptance`: served tau in vLLM
equals it, greedy fp32) and one row printed per checkpoint: training tokens, epoch, wall seconds, training loss, the
trainer's teacher-forced held-out tau where it evaluated, decoded tau with its standard error over cycles.
The rows also go to `<run>/learning_curve.json`. The learning-rate schedule spans `--steps`: each point is that
schedule's drafter at that step, not a shorter run's final one (`-p min_lr_ratio 1` for a flat lr after warm-up).
A rerun with the same settings resumes the training (the trainer's rule) and decodes every checkpoint again.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, benchmarks/ is sys.path[0]: benchmarks/tokenize.py would shadow the stdlib module for torch.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from dflash_lib.config import Config  # noqa: E402
from dflash_lib.evaluate import build_config, checkpoint_drafter, decode_threads, run_checkpoints  # noqa: E402
from dflash_lib.evaluate import Setup  # noqa: E402
from dflash_lib.data.prompts import prompt_sets  # noqa: E402
from dflash_lib.evaluate.acceptance import acceptance_length  # noqa: E402
from dflash_lib.target.local import TargetModel  # noqa: E402
from dflash_lib.rundir import load_config  # noqa: E402
from dflash_lib.evaluate.served import histogram_tau_se  # noqa: E402
from dflash_lib.train.loop import train  # noqa: E402
from dflash_lib.rundir.reader import load_metrics  # noqa: E402

CURVE_FILE = "learning_curve.json"


class Budget:
    """A metric sink that stops the run (SIGTERM to this process: the trainer finishes the step, checkpoints and
    returns, `train.state.StopRequest`) once its steps took `minutes` of wall time or read `tokens` real tokens."""

    def __init__(self, minutes: float, tokens: int) -> None:
        self.limit_s, self.tokens = minutes * 60, tokens
        self.seen_s, self.seen_tokens, self.sent = 0.0, 0, False

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.seen_s += metrics["step_s"]
        self.seen_tokens += metrics["real_tokens"]
        over = (self.limit_s and self.seen_s >= self.limit_s) or (self.tokens and self.seen_tokens >= self.tokens)
        if over and not self.sent:
            self.sent = True
            print(f"[curve] budget reached at step {step} ({self.seen_s:.0f} s, {self.seen_tokens} tokens): stopping",
                  flush=True)
            os.kill(os.getpid(), signal.SIGTERM)

    def close(self) -> None:
        pass


def demo_data(preset: str, params: dict[str, str]) -> dict[str, Any]:
    """The parameters that put `preset` on the demo's data: the real target, its answers (made once, cached) and
    notebook 04's split of them (`lab.demo`)."""
    from dflash_lib.lab.demo import train_link, engine_available, prepare_target
    target_params, inputs = prepare_target(preset, params, kind="real", engine=engine_available())
    return {**target_params, **train_link(inputs)}


def decode_checkpoints(train_dir: Path, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Every checkpoint of the trainer run `train_dir` decoded greedily on the same held-out prompts (`-p prompts`,
    `max_new_tokens`, the target in fp32 on the CPU as `evaluate` runs it): one row per checkpoint, step order."""
    doc = json.loads((train_dir / "config.json").read_text())
    recorded = {k: v for sec in doc["config"].values() if isinstance(sec, dict) for k, v in sec.items()}
    config, _ = build_config(params, None, recorded)
    target = TargetModel.from_model_config(config.model, device=torch.device("cpu"), dtype=torch.float32,
                                           seed=config.train.seed)
    prompts = prompt_sets(config, train_dir)
    setup = Setup(config, train_dir, train_dir, target, None, prompts)
    n_new, eos = config.regenerate.max_new_tokens, [prompts.eos_id] if config.evaluate.stop_at_eos else []
    metrics = load_metrics(train_dir)
    rows = []
    with decode_threads(setup), tempfile.TemporaryDirectory(prefix="dflash-curve-") as scratch:
        for step, ckpt in run_checkpoints(train_dir):
            drafter = checkpoint_drafter(ckpt, setup, Path(scratch)).eval()
            t0 = time.perf_counter()
            r = acceptance_length(target, drafter, prompts.prompts, n_new, eos, config.regenerate.min_new_tokens)
            upto = metrics[metrics["step"] <= step]
            held = upto["heldout_tau"].dropna() if "heldout_tau" in upto else []
            rows.append(dict(
                step=step, epoch=int(upto["epoch"].iloc[-1]), train_tokens=int(upto["real_tokens"].sum()),
                train_s=round(float(upto["step_s"].sum()), 1),
                loss=round(float(upto["loss"].tail(10).mean()), 4),
                heldout_tau=round(float(held.iloc[-1]), 4) if len(held) else None,
                tau=round(r.tau, 4), tau_se=round(histogram_tau_se(r.histogram)[1], 4), cycles=r.cycles,
                per_position=[round(x, 3) for x in r.per_position], decode_s=round(time.perf_counter() - t0, 1)))
            print(f"[curve] step {step}: tau {r.tau:.3f} +- {rows[-1]['tau_se']:.3f} over {r.cycles} cycles",
                  flush=True)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    """The rows as a table (epoch: the trainer's, 0-based, of the step's last batch)."""
    print(f"{'step':>6} {'tokens':>9} {'epoch':>5} {'train_s':>8} {'loss':>7} {'heldout':>7} {'tau':>6} {'+-se':>6}"
          f" {'cycles':>6}")
    for r in rows:
        held = f"{r['heldout_tau']:.3f}" if r["heldout_tau"] is not None else "-"
        print(f"{r['step']:>6} {r['train_tokens']:>9} {r['epoch']:>5} {r['train_s']:>8.0f} {r['loss']:>7.3f} "
              f"{held:>7} {r['tau']:>6.3f} {r['tau_se']:>6.3f} {r['cycles']:>6}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="demo", help="config preset of the recipe (demo: make demo's drafter)")
    ap.add_argument("-p", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                    help="config override (with --decode-only: the decoding's, e.g. -p decode_threads 1)")
    ap.add_argument("--steps", type=int, default=0, help="optimizer steps the schedule spans (0 = the preset's)")
    ap.add_argument("--every", type=int, default=0, help="a checkpoint, a decoded point, every N steps "
                                                         "(0 = steps // 10)")
    ap.add_argument("--minutes", type=float, default=0, help="stop training after this much wall time (0 = none)")
    ap.add_argument("--tokens", type=int, default=0, help="stop training after this many real tokens (0 = none)")
    ap.add_argument("--prompts", type=int, default=15, help="held-out prompts decoded per checkpoint (the demo's "
                                                            "split holds 15)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens decoded per prompt at most")
    ap.add_argument("--run-dir", default="", help="the trainer run folder (default: /tmp/learning_curve_<time>)")
    ap.add_argument("--no-demo-data", action="store_true", help="the preset's own data and target, not the "
                                                                "demo's (the real target's answers)")
    ap.add_argument("--decode-only", default="", help="decode the checkpoints of this trainer run folder")
    args = ap.parse_args()

    decode = {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "prompts_from": "heldout"}
    if args.decode_only:  # -p pairs set the decoding's config (decode_threads, say)
        run_dir, decode = Path(args.decode_only), {**decode, **dict(args.p)}
    else:
        params = dict(args.p)
        if args.preset == "demo" and not args.no_demo_data:
            params = {**demo_data(args.preset, params), **params}
        base: Config = load_config(params, args.preset)
        steps = args.steps or base.train.steps
        every = args.every or max(1, steps // 10)
        params = {**params, "steps": steps, "ckpt_every": every, "keep_checkpoints": 10**6}
        run_dir = Path(args.run_dir or f"/tmp/learning_curve_{time.strftime('%Y%m%dT%H%M%S')}")
        print(f"[curve] training {args.preset} for {steps} steps, a checkpoint every {every}, into {run_dir}",
              flush=True)
        t0 = time.perf_counter()
        summary = train(load_config(params, args.preset), run_dir, sinks=[Budget(args.minutes, args.tokens)])
        print(f"[curve] trained to step {summary.steps} in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = decode_checkpoints(run_dir, decode)
    print_table(rows)
    out = {"run_dir": str(run_dir), "decode": decode, "rows": rows}
    (run_dir / CURVE_FILE).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
