"""CPU time of the drafter's training forward + backward on a padded batch: every-slot context vs real tokens.

    .venv/bin/python benchmarks/drafter_context.py [--hidden 64] [--vocab 4096] [--reps 15] [--threads 2]

Four documents (400, 300, 260 and 160 tokens: 30% of the 4 x 400 slots are padding) and their target features
(computed once, untimed) run through the demo preset's drafter (`--hidden` scales it; a small vocabulary so the
LM head does not hide the context's share) three ways, interleaved rep by rep so a shared machine's load
drifts alike through all three: `every_slot` (the context fuses and projects all 1600 slots, the drafter's path
before it took the real tokens, still the `static_shapes` one), `real` (the target's flat features of the 1120
real tokens, what the trainer runs) and `unpadded` (the same documents in one row of 1120 slots, no padding at
all). Reported: the median seconds of each and their ratios to `unpadded` (goal: `real` within noise of 1.0),
the machine's load average, and the drafter FLOPs of each (FlopCounterMode; `real` equals `unpadded` exactly).
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder holds scripts named like stdlib modules (tokenize.py): keep it off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from dflash_lib.config import demo  # noqa: E402
from dflash_lib.data.batch import collate_packed, collate_padded  # noqa: E402
from dflash_lib.models import DFlashDrafter, DrafterConfig, tiny_qwen3_config  # noqa: E402
from dflash_lib.target.local import TargetModel  # noqa: E402
from dflash_lib.models.attention import sdpa_flop_mapping  # noqa: E402
from dflash_lib.models.layout import build_layout  # noqa: E402

LENGTHS = (400, 300, 260, 160)  # 1120 real tokens in 4 x 400 slots: 30% padding


def build(hidden: int, vocab: int) -> tuple[TargetModel, DFlashDrafter]:
    """The demo preset's target and drafter at hidden size `hidden` over `vocab` ids (MASK = vocab - 1)."""
    cfg = demo().model
    cfg.hidden_size, cfg.mask_id = hidden, vocab - 1
    hf = tiny_qwen3_config(hidden_size=hidden, num_layers=cfg.target_layers, vocab_size=vocab)
    target = TargetModel.from_hf_config(hf, cfg.num_features, seed=0)
    torch.manual_seed(0)
    return target, DFlashDrafter(DrafterConfig.from_model_config(cfg, target), target, attention="blocks")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=64, help="target and drafter hidden size (demo: 64)")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary of the target (and the drafter's head)")
    p.add_argument("--reps", type=int, default=15, help="timed forward + backward per case (median reported)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target, drafter = build(args.hidden, args.vocab)
    rng = np.random.default_rng(0)
    docs = [(rng.integers(0, args.vocab - 1, n), np.arange(n) >= n // 2) for n in LENGTHS]
    padded, unpadded = collate_padded(docs, 0), collate_packed(docs, 0, row_len=sum(LENGTHS))
    cases = {}  # name -> (batch, features, layout)
    for name, batch, every in (("every_slot", padded, True), ("real", padded, False), ("unpadded", unpadded, False)):
        layout = build_layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(0)), "blocks",
                              every_slot=every)
        feats = target.features(batch) if every else target.context_features(batch)  # (R, T, F*H) / (C, F*H)
        cases[name] = (batch, feats, layout)

    def run(name: str) -> float:
        batch, feats, layout = cases[name]
        t0 = time.perf_counter()
        drafter.loss(batch, feats, layout).loss.backward()
        drafter.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for name in cases:  # warm-up
        run(name)
    times: dict[str, list[float]] = {name: [] for name in cases}
    load = os.getloadavg()[0]
    for _ in range(args.reps):
        for name in cases:
            times[name].append(run(name))
    load = (load + os.getloadavg()[0]) / 2
    c = drafter.cfg
    print(f"drafter {c.num_layers} layer(s) H={c.hidden_size}, {c.num_features} features, B={c.block_size}, "
          f"{c.num_anchors} anchors/doc, vocab {c.vocab_size}; documents {list(LENGTHS)} "
          f"({sum(LENGTHS)} real tokens, {padded.padded_tokens} padded slots); torch threads {args.threads}, "
          f"load average {load:.1f} on {os.cpu_count()} cores; {args.reps} reps")
    base = statistics.median(times["unpadded"])
    for name, (batch, feats, layout) in cases.items():
        with FlopCounterMode(display=False, custom_mapping=sdpa_flop_mapping()) as counter:
            drafter.loss(batch, feats, layout).loss.backward()
        drafter.zero_grad(set_to_none=True)
        sec = statistics.median(times[name])
        print(f"  {name:10s} context {layout.num_context:5d}: {1e3 * sec:7.1f} ms forward + backward "
              f"({sec / base:.3f} of unpadded), {counter.get_total_flops() / 1e9:.3f} GFLOP")


if __name__ == "__main__":
    main()
