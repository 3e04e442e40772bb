"""CPU forward time of the target on a padded batch: the real-tokens path against every slot, and the documents alone.

    .venv/bin/python -P benchmarks/padding.py [--hidden 1024] [--layers 2] [--reps 9] [--threads 2]

One batch of documents of a few hundred tokens, one per row, right-padded to the longest (`--lengths`; the default
leaves ~30% of the slots padding). Three forwards of the same documents (`TargetModel.features`, every decoder
layer up to the last, fp32):
- real tokens: today's path (`gather` on): the real tokens gathered into one sequence (`masks.real_tokens`);
- every slot: `gather` off, what `sampler.static_shapes` runs: the padding goes through every linear layer
  (attention still skips it: the padding runs are not attended);
- documents alone: the same documents packed end to end in one row of exactly their tokens (no padding at all).
Each repetition times the three in turn (the order rotates between repetitions, so a load change on a shared
machine hits each alike); the ratios are taken within a repetition, and their median and range are printed, and
the ratio of the fastest forwards of each (load only ever adds time, so the minimum is the least disturbed).
Goals (issue 23): real tokens / every slot within 5% of the real-token share; real tokens / documents alone ~1.0.

Why this shape: padding costs the linear layers (projections and MLP: ~11.5 H^2 multiply-adds per token and layer
with a quarter of the heads as kv heads and intermediate size 3H), not the attention (which runs on no padding in
either path), so the real-tokens path can only gain where linear layers dominate. A token of a document of `len`
tokens spends ~len x H multiply-adds per layer on attention, len / (11.5 H) of its linear work: ~3% at hidden 1024
for these documents, ~7% at hidden 512, where CPU attention (per-document SDPA, less efficient per FLOP than the
big matrix products) already takes a visible share of the time; at the demo target's hidden 64 attention dominates
and the two paths time alike (LOG.md, issue 23 item 1). Two layers keep a forward to 1-2 s on two idle cores; the
ratios do not depend on the depth. The vocabulary is small: the forward never runs the LM head.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder holds scripts named like stdlib modules (tokenize.py): keep it off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dflash_lib.data.batch import Batch, collate_packed, collate_padded  # noqa: E402
from dflash_lib.models import tiny_qwen3_config  # noqa: E402
from dflash_lib.target.local import TargetModel  # noqa: E402

# 8 documents, 2,910 real tokens in 8 x 512 slots: 71% real, ~30% padding
LENGTHS = (512, 470, 420, 380, 340, 300, 260, 228)


def documents(lengths: list[int], vocab: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random token documents of `lengths` tokens (loss mask unused by the target's forward)."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab - 1, n), np.ones(n, dtype=bool)) for n in lengths]


def forward_s(target: TargetModel, batch: Batch) -> float:
    """Wall seconds of one `features` forward of `batch`."""
    t0 = time.perf_counter()
    target.features(batch)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024, help="target hidden size (intermediate 3x)")
    p.add_argument("--layers", type=int, default=2, help="target decoder layers, all run")
    p.add_argument("--heads", type=int, default=16, help="attention heads (kv heads: a quarter)")
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="document lengths (tokens)")
    p.add_argument("--reps", type=int, default=9, help="timed repetitions of the three forwards")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    hf = tiny_qwen3_config(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                           num_kv_heads=max(1, args.heads // 4), vocab_size=4096)
    layer_ids = [args.layers - 1]  # the deepest layer as the feature: every layer runs
    real_path = TargetModel.from_hf_config(hf, 1, layer_ids, seed=0)
    slot_path = TargetModel(real_path.model, layer_ids, gather=False)  # the same weights, every slot run
    docs = documents(args.lengths, hf.vocab_size)
    padded = collate_padded(docs, 0)
    alone = collate_packed(docs, 0, sum(args.lengths))  # one row of exactly the documents' tokens
    share = padded.real_tokens / padded.padded_tokens
    diff = (real_path.features(padded) - slot_path.features(padded)).abs().max().item()
    print(f"target: {args.layers} layers, H={args.hidden}, intermediate {hf.intermediate_size}, {args.heads} heads, "
          f"fp32, torch threads {torch.get_num_threads()}; {len(docs)} documents, {padded.real_tokens} real tokens "
          f"in {padded.padded_tokens} slots: real-token share {share:.3f}; features of the two paths differ by "
          f"{diff:.1e} at most")
    cases = {"real tokens": (real_path, padded), "every slot": (slot_path, padded),
             "documents alone": (real_path, alone)}
    names = list(cases)
    for name in names:  # warm-up
        forward_s(*cases[name])
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(args.reps):
        for name in names[rep % 3:] + names[:rep % 3]:
            times[name].append(forward_s(*cases[name]))
    for name in names:
        print(f"  {name:16s} median {statistics.median(times[name]):.3f} s "
              f"(range {min(times[name]):.3f} - {max(times[name]):.3f} s over {args.reps} repetitions)")
    for num, den, goal in (("real tokens", "every slot", f"goal: the real-token share {share:.3f} within 5%"),
                           ("real tokens", "documents alone", "goal: ~1.0")):
        ratios = [a / b for a, b in zip(times[num], times[den])]
        print(f"  {num} / {den}: median {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f} - {max(ratios):.3f}), fastest / fastest "
              f"{min(times[num]) / min(times[den]):.3f}; {goal}")


if __name__ == "__main__":
    main()
