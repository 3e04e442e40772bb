"""Step time with the target replicated on every rank vs sharded over the ranks (FSDP2), 2 gloo ranks on CPU.

Run: .venv/bin/python benchmarks/target_parallel.py [--steps 10] [--tokens 8192] [--loss ce|kl|ce+kl]
Two processes (spawned here, gloo on localhost, one CPU thread each) build the demo preset's shapes (a 6-layer
tiny Qwen3 target of hidden 64 with the real Qwen3 vocabulary, 2 feature layers, a 1-layer drafter, blocks of 8,
16 anchors, one packed row of `--tokens` tokens per rank and step) and time, over `--steps` steps after one warm-up
step, one training step = the target's feature pass on this rank's row + `step.train_step` on a DDP drafter:
  replicate: the target whole on every rank (`TargetModel.context_features`),
  fsdp:      its decoder layers sharded (`target.sharded.ShardedTarget`: per-layer all-gathers on a group of their own).
With `--loss kl` or `ce+kl` the pass runs every layer and gives the final states at the scored rows too
(`context_features_and_final`), which the drafter's loss reads. Prints each mode's median seconds per step, the
fsdp/replicate ratio, and whether both modes gave the same features (and final states). CPU figures are only a
sanity check of the sharding's overhead (gloo all-gathers, no compute overlap); what it buys, a target that no
longer sits whole on every GPU, shows only on GPUs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from dflash_lib.config import preset  # noqa: E402
from dflash_lib.data.batch import collate_packed  # noqa: E402
from dflash_lib.models import DFlashDrafter, DrafterConfig  # noqa: E402
from dflash_lib.target.local import TargetModel  # noqa: E402
from dflash_lib.train import distributed  # noqa: E402
from dflash_lib.train.feed import Item  # noqa: E402
from dflash_lib.train.state import BadStepGuard  # noqa: E402
from dflash_lib.train.step import train_step  # noqa: E402
from dflash_lib.target.sharded import ShardedTarget  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for benchmarks/_common.py only, then off again
from _common import join_group, spawn_ranks  # noqa: E402

del sys.path[0]


def worker(rank: int, args: argparse.Namespace, port: int, out: "mp.Queue") -> None:
    torch.set_num_threads(1)
    join_group(rank, 2, port, timeout_s=600)
    mc = preset("demo").model
    mc.loss = args.loss
    target = TargetModel.from_model_config(mc, seed=0)
    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterConfig.from_model_config(mc, target), target, attention="blocks")
    engine = distributed.wrap_drafter(drafter, "ddp")
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    rng = np.random.default_rng(rank)
    lengths = rng.integers(64, 1024, 64)  # documents of the demo corpus' order of length (tokens)
    docs, total = [], 0
    for n in lengths:
        if total + n > args.tokens:
            break
        docs.append((rng.integers(0, 150000, n), np.arange(n) >= 8))
        total += n
    batch = collate_packed(docs, 0, args.tokens)
    layout = drafter.layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(rank)))
    guard = BadStepGuard(10)
    result = {"tokens": total}

    def step(runs_on) -> list[torch.Tensor]:
        final = None
        if layout.target_rows is None:
            feats = runs_on.context_features(batch)  # (C, F*H)
        else:  # loss kl / ce+kl: every layer, the final states at the scored rows (u, H)
            feats, final = runs_on.context_features_and_final(batch, layout.target_rows)
        item = Item(0, batch, batch, feats, layout=layout, device_layout=layout, target_hidden=final)
        train_step(engine, [item], params, opt, 1e-4, 1.0, False, guard, 1)
        return [feats] if final is None else [feats, final]

    sharded = ShardedTarget(TargetModel.from_model_config(mc, seed=0), 600.0, final=mc.loss != "ce")
    for name, runs_on in (("replicate", target), ("fsdp", sharded)):
        result[f"{name}_feats"] = step(runs_on)  # warm-up
        times = []
        for _ in range(args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            step(runs_on)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        result[f"{name}_s"] = statistics.median(times)
    result["same"] = all(torch.equal(a, b) for a, b in zip(result.pop("replicate_feats"), result.pop("fsdp_feats")))
    out.put((rank, result))
    distributed.destroy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps per mode (median reported)")
    ap.add_argument("--tokens", type=int, default=8192, help="slots of each rank's packed row (the demo budget)")
    ap.add_argument("--loss", default="ce", choices=["ce", "kl", "ce+kl"], help="the drafter loss (kl: every layer)")
    args = ap.parse_args()
    results = spawn_ranks(worker, (args,))
    rep = max(r["replicate_s"] for r in results.values())
    fsdp = max(r["fsdp_s"] for r in results.values())
    print(f"demo shapes, loss {args.loss}, 2 gloo ranks, one CPU thread each, {results[0]['tokens']} / "
          f"{results[1]['tokens']} real tokens per rank and step")
    print(f"target replicated: {rep:.3f} s/step | sharded (FSDP2): {fsdp:.3f} s/step | ratio fsdp/replicate = "
          f"{fsdp / rep:.2f}")
    print("CPU figures are only a sanity check of the sharding's overhead, not of its use (memory on GPUs)")
    same = all(r["same"] for r in results.values())
    what = "features" if args.loss == "ce" else "features and final states"
    print(f"the sharded target's {what} equal the replicated target's, bit for bit: {same}")
    if not same:
        raise SystemExit("the sharded target's features differ")


if __name__ == "__main__":
    main()
