"""The trainer's held-out tau against the tau decoding serves, on the same held-out samples (issue 52).

    .venv/bin/python -P benchmarks/heldout_vs_served.py RUN_DIR                # a trainer run folder: its checkpoints
    .venv/bin/python -P benchmarks/heldout_vs_served.py RUN_DIR --steps 500,1000 --max-new-tokens 32,128
    .venv/bin/python -P benchmarks/heldout_vs_served.py                        # trains the demo recipe 300 steps first

For each checkpoint (default: the newest) and every held-out sample of the run (`heldout.json`, all of them, not
the first `eval_samples`), printed side by side:
- `anchors`: the per-anchor figure heldout_tau was before issue 52 (`tau_anchors` now): random anchors anywhere
  in the answers, each block's own 1 + leading run, at the run's precision, on the run's `eval_samples` and on all;
- the same over EVERY answer anchor, by the anchor's position in the answer, and restricted to the anchors a
  decoding of `max_new_tokens` tokens can start a cycle from;
- `walk`: the held-out tau the trainer logs now (`train.heldout.evaluate`): decoding's cycles laid along the
  stored answers over their first `max_new_tokens` tokens, at the run's precision and in fp32;
- `decoded`: greedy speculative decoding of the same prompts, target and drafter in fp32 on the CPU, as `evaluate`
  runs it (vLLM's served tau equals it, greedy fp32), and how many stored answers equal the target's greedy ones.

With no RUN_DIR it trains the demo recipe (`--preset demo` on the real target's answers, notebook 04's split,
`lab.demo.prepare_target` as `make demo` makes or reads them) for `--train-steps` steps into a temporary folder.
Minutes on 2 CPU cores per checkpoint measured (the decodings dominate); the figures: LOG.md (issue 52).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, benchmarks/ is sys.path[0]: benchmarks/tokenize.py would shadow the stdlib module for torch.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dflash_lib.config import uses_bf16  # noqa: E402
from dflash_lib.data.batch import collate_padded  # noqa: E402
from dflash_lib.data.store import build_token_store_from_config  # noqa: E402
from dflash_lib.evaluate import build_config, load_drafter, run_checkpoints  # noqa: E402
from dflash_lib.evaluate.acceptance import acceptance_length  # noqa: E402
from dflash_lib.export import export_source  # noqa: E402
from dflash_lib.models.anchors import answer_span, decoding_anchors  # noqa: E402
from dflash_lib.models.export import DTYPES  # noqa: E402
from dflash_lib.rundir.reader import HELDOUT_FILE  # noqa: E402
from dflash_lib.target.local import TargetModel  # noqa: E402
from dflash_lib.train.heldout import build_eval_set, evaluate  # noqa: E402

POSITION_EDGES = (0, 1, 8, 16, 32, 64, 128)  # answer-position buckets of the per-anchor figure (tokens)


def trainer_config(train_dir: Path) -> Any:
    doc = json.loads((train_dir / "config.json").read_text())
    recorded = {k: v for sec in doc["config"].values() if isinstance(sec, dict) for k, v in sec.items()}
    return build_config({}, None, recorded)[0]


def every_anchor_runs(drafter: Any, target: Any, store: Any, samples: list[int], pad_id: int, eos: int | None,
                      autocast: bool) -> dict[int, dict[int, int]]:
    """{store index: {answer index j: the block's leading run}} for every answer anchor of every sample."""
    c, out = drafter.cfg, {}
    for i in samples:
        batch = collate_padded([store[i]], pad_id, [i])
        layout = drafter.layout(batch, decoding_anchors(batch, 10 ** 9, c.block_size, c.gamma, c.mask_id,
                                                        c.position_weight, eos))
        if not layout.num_blocks:
            out[i] = {}
            continue
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            runs = drafter.loss(batch, target.context_features(batch), layout).block_runs_t.tolist()
        pos = layout.anchor_pos.tolist()
        out[i] = {p - min(pos): int(r) for p, r in zip(pos, runs)}
    return out


def pairs(runs: dict[int, dict[int, int]], samples: list[int]) -> list[float]:
    """The every-anchor figure (1 + mean run over both samples' blocks) of every pair of samples."""
    out = []
    for a in range(len(samples)):
        for b in range(a + 1, len(samples)):
            both = list(runs[samples[a]].values()) + list(runs[samples[b]].values())
            out.append(1 + sum(both) / len(both) if both else math.nan)
    return out


def decoded_pairs(dec: Any) -> list[float]:
    """Decoded tau (tokens / cycles) of every pair of prompts of one decoding."""
    logs = dec.cycle_log
    return [sum(t for _, t in logs[a] + logs[b]) / len(logs[a] + logs[b]) if logs[a] + logs[b] else math.nan
            for a in range(len(logs)) for b in range(a + 1, len(logs))]


def spread(values: list[float]) -> str:
    v = np.sort([x for x in values if x == x])
    if not len(v):
        return "-"
    return f"{v[0]:.2f}-{v[-1]:.2f} (middle 80%: {np.quantile(v, 0.1):.2f}-{np.quantile(v, 0.9):.2f})"


def within(runs: dict[int, dict[int, int]], lo: int, hi: int) -> list[int]:
    """The runs of every sample's blocks anchored at answer index lo <= j < hi."""
    return [r for s in runs.values() for j, r in s.items() if lo <= j < hi]


def mean_tau(runs: list[int]) -> str:
    return f"{1 + sum(runs) / len(runs):.3f} ({len(runs)})" if runs else "-"


def measure(train_dir: Path, steps: list[int] | None, news: list[int]) -> None:
    config = trainer_config(train_dir)
    store = build_token_store_from_config(config.data, progress=False)
    held = [int(i) for i in json.loads((train_dir / HELDOUT_FILE).read_text())["indices"]]
    pad_id, eos = int(store.meta["tokenizer"]["pad_id"]), int(store.meta["tokenizer"]["eos_id"])
    eos = eos if config.evaluate.stop_at_eos else None
    spans = {i: answer_span(store[i][1], store[i][0], eos) for i in held}
    samples = [i for i in held if spans[i] is not None and spans[i][0] > 0]
    run_n = config.regenerate.max_new_tokens
    news = sorted(set(news or [run_n]))
    bf16 = uses_bf16(config.train.precision, torch.device("cpu"))
    precisions = (("bf16", torch.bfloat16), ("fp32", torch.float32)) if bf16 else (("fp32", torch.float32),)
    print(f"run {train_dir}: {len(samples)} held-out samples with a prompt (the trainer evaluates the first "
          f"{config.train.eval_samples}), answers of {min(spans[i][1] for i in samples)}.."
          f"{max(spans[i][1] for i in samples)} tokens, run precision {config.train.precision}, decoding's "
          f"max_new_tokens {run_n}", flush=True)
    targets = {name: TargetModel.from_model_config(config.model, device=torch.device("cpu"), dtype=dtype,
                                                   seed=config.train.seed) for name, dtype in precisions}
    ckpts = dict(run_checkpoints(train_dir))
    chosen = steps or [max(ckpts)]
    missing = [s for s in chosen if s not in ckpts]
    if missing:
        raise SystemExit(f"no checkpoint at steps {missing}; the run has {sorted(ckpts)}")
    prompts = [[int(t) for t in store[i][0][:spans[i][0]]] for i in samples]
    answers = [[int(t) for t in store[i][0][spans[i][0]:sum(spans[i])]] for i in samples]
    with tempfile.TemporaryDirectory(prefix="dflash-heldout-") as scratch:
        for step in chosen:
            t0 = time.perf_counter()
            folder = export_source(ckpts[step], Path(scratch) / f"ckpt-{step}", DTYPES["fp32"])
            print(f"\n== step {step}", flush=True)
            runs_at: dict[str, dict[int, dict[int, int]]] = {}
            for name, _ in precisions:
                target = targets[name]
                drafter = load_drafter(folder, target)
                autocast = name == "bf16"
                for n in dict.fromkeys((config.train.eval_samples, len(samples))):
                    for new in news:
                        es = build_eval_set(store, held, drafter, pad_id, config.sampler.token_budget,
                                            config.train.seed, n, new, eos)
                        f = evaluate(drafter, target, es, autocast)
                        print(f"[{name}] {f.samples:2d} samples, max_new_tokens {new:3d}: anchors (old heldout_tau) "
                              f"{f.tau_anchors:.3f} ({f.blocks} random blocks) | walk (heldout_tau now) {f.tau:.3f} "
                              f"({f.cycles} cycles)", flush=True)
                runs = runs_at[name] = every_anchor_runs(drafter, target, store, samples, pad_id, eos, autocast)
                every = [r for s in runs.values() for r in s.values()]
                buckets = " ".join(f"[{lo},{hi}) {mean_tau(within(runs, lo, hi))}"
                                   for lo, hi in zip(POSITION_EDGES, POSITION_EDGES[1:] + (10 ** 9,)))
                print(f"[{name}] every answer anchor: {mean_tau(every)}; by answer position: {buckets}")
                for new in news:
                    print(f"[{name}] anchors a {new}-token decoding can start from (j < {new - 1}): "
                          f"{mean_tau(within(runs, 0, new - 1))}")
            run_runs = runs_at[precisions[0][0]]
            target = targets["fp32"]
            drafter = load_drafter(folder, target)
            dec_first = None
            for new in news:
                dec = acceptance_length(target, drafter, prompts, new, [eos] if eos is not None else [], 0)
                same = sum(o == a[:len(o)] for o, a in zip(dec.outputs, answers))
                dec_first = dec_first or dec
                forced = acceptance_length(target, drafter, prompts, new, [eos] if eos is not None else [], 0,
                                           answers=answers)
                print(f"[fp32] decoded, max_new_tokens {new:3d}: tau {dec.tau:.3f} ({dec.cycles} cycles, per position "
                      f"{[round(p, 3) for p in dec.per_position]}) | along the stored answers {forced.tau:.3f} | "
                      f"greedy answers equal to the stored ones {same}/{len(samples)}", flush=True)
                per = " ".join(f"{sum(t for _, t in log) / len(log):.2f}" if log else "-" for log in dec.cycle_log)
                print(f"       per sample: {per}")
            print(f"[{precisions[0][0]}] every answer anchor, per sample: " + " ".join(
                f"{1 + sum(run_runs[i].values()) / len(run_runs[i]):.2f}" if run_runs[i] else "-" for i in samples))
            anchored, decoded = pairs(run_runs, samples), decoded_pairs(dec_first)
            print(f"2 samples of {len(samples)}, every pair: every answer anchor {spread(anchored)}, decoded "
                  f"({news[0]} tokens) {spread(decoded)}; the first minus the second on the same pair "
                  f"{spread([a - d for a, d in zip(anchored, decoded)])}")
            print(f"step {step}: {time.perf_counter() - t0:.0f} s", flush=True)


def train_short(steps: int, folder: Path) -> Path:
    """The demo recipe (`--preset demo` on the real target's answers, split as notebook 04 splits them) for `steps`
    steps, a checkpoint at the end; returns the trainer folder."""
    from dflash_lib.lab.demo import train_link, engine_available, prepare_target
    from dflash_lib.rundir import load_config
    from dflash_lib.train.loop import train

    target_params, inputs = prepare_target("demo", {}, kind="real", engine=engine_available())
    params = {**target_params, **train_link(inputs), "steps": steps, "ckpt_every": steps, "wandb_mode": "disabled"}
    train(load_config(params, "demo"), folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", nargs="?", default="", help="a trainer run folder (config.json, heldout.json, checkpoints/)")
    ap.add_argument("--steps", default="", help="checkpoint steps to measure, comma-separated (default: the newest)")
    ap.add_argument("--max-new-tokens", default="", help="decoding lengths, comma-separated (default: the run's)")
    ap.add_argument("--train-steps", type=int, default=300, help="without RUN: the demo recipe's steps to train first")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    steps = [int(s) for s in args.steps.split(",") if s]
    news = [int(s) for s in args.max_new_tokens.split(",") if s]
    if args.run:
        measure(Path(args.run), steps or None, news)
        return
    with tempfile.TemporaryDirectory(prefix="dflash-heldout-run-") as tmp:
        measure(train_short(args.train_steps, Path(tmp) / "train"), None, news)


if __name__ == "__main__":
    main()
