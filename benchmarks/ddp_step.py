"""Gradient reduction: the trainer's OLD per-tensor all-reduce vs torch's DistributedDataParallel, 2 gloo ranks.

Run: .venv/bin/python benchmarks/ddp_step.py [--hidden 1024] [--layers 4] [--steps 5] [--tokens 512]
Two processes (spawned here, gloo on localhost, one CPU thread each) train the same ~50 M-parameter drafter on
the same micro-batches (2 per step: accumulation) in both modes, each mode timed over `--steps` steps after one
warm-up step:
  old: forward/backward of every micro-batch, then, after the whole backward, one all-reduce per parameter
       tensor on a clone of its gradient (what dflash_lib/train/loop.py did before DDP: no bucketing, no overlap),
  ddp: `step.train_step` on a `distributed.DrafterParallel("ddp")`: no_sync on the first micro-batch, bucketed
       all-reduce overlapped with the last backward.
Prints each mode's median seconds per step and the old/ddp ratio (> 1: DDP is faster), and checks that both
modes leave the two ranks with the same weights as each other.
The baseline lives here because it left the library: this script is its only remaining implementation.
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

from dflash_lib.data.batch import collate_padded  # noqa: E402
from dflash_lib.models import DFlashDrafter, DrafterConfig, tiny_qwen3_config  # noqa: E402
from dflash_lib.target.local import TargetModel  # noqa: E402
from dflash_lib.train import distributed  # noqa: E402
from dflash_lib.train.distributed import all_reduce_floats  # noqa: E402
from dflash_lib.train.feed import Item  # noqa: E402
from dflash_lib.train.state import BadStepGuard  # noqa: E402
from dflash_lib.train.step import train_step  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for benchmarks/_common.py only, then off again
from _common import join_group, spawn_ranks  # noqa: E402

del sys.path[0]

VOCAB = 2048


def build(args: argparse.Namespace, rank: int) -> tuple[DFlashDrafter, list[Item]]:
    """The drafter (same init on both ranks) and this rank's 2 micro-batches (different data per rank)."""
    H = args.hidden
    target = TargetModel.from_hf_config(tiny_qwen3_config(hidden_size=H, num_layers=4, num_heads=8, num_kv_heads=8,
                                                          vocab_size=VOCAB), 2)
    cfg = DrafterConfig(hidden_size=H, num_layers=args.layers, num_heads=8, num_kv_heads=8, head_dim=H // 8,
                        intermediate_size=int(2.75 * H), vocab_size=VOCAB, target_layer_ids=target.layer_ids,
                        target_num_layers=target.num_layers, block_size=8, mask_id=VOCAB - 1, num_anchors=16,
                        ce_chunk_blocks=16)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, target, attention="blocks")
    rng = np.random.default_rng(rank)
    items = []
    for m in range(2):
        docs = [(rng.integers(0, VOCAB - 1, args.tokens // 2), np.arange(args.tokens // 2) >= 8) for _ in range(2)]
        batch = collate_padded(docs, 0)
        layout = drafter.layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(100 * rank + m)))
        with torch.no_grad():
            feats = target.features(batch)
        items.append(Item(0, batch, batch, feats, layout=layout, device_layout=layout))
    return drafter, items


def old_step(drafter: DFlashDrafter, items: list[Item], params: list[torch.nn.Parameter],
             opt: torch.optim.Optimizer) -> None:
    """The removed reduction: the global normaliser, every backward, then one all-reduce per gradient tensor."""
    (weight_sum,) = all_reduce_floats([sum(it.layout.weight_sum for it in items)])
    for it in items:
        drafter.loss(it.device_batch, it.features, it.device_layout, normalizer=weight_sum).loss.backward()
    for p in params:  # every rank reduces every tensor in the same order
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        p.grad = distributed.all_reduce_sum(grad)  # a clone per tensor, reduced after the whole backward
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed(step, n: int) -> float:
    step()  # warm-up (DDP builds its buckets on the first step)
    times = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(rank: int, args: argparse.Namespace, port: int, out: "mp.Queue") -> None:
    torch.set_num_threads(1)
    join_group(rank, 2, port, timeout_s=600)
    result = {}
    drafter, items = build(args, rank)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    result["old_s"] = timed(lambda: old_step(drafter, items, params, opt), args.steps)
    result["old_sum"] = float(sum(p.detach().double().sum() for p in params))

    drafter, items = build(args, rank)  # fresh weights: the same start for DDP
    parallel = distributed.wrap_drafter(drafter, "ddp")
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    guard = BadStepGuard(10)
    result["ddp_s"] = timed(lambda: train_step(parallel, items, params, opt, 1e-4, 1.0, False, guard, 1), args.steps)
    result["ddp_sum"] = float(sum(p.detach().double().sum() for p in params))
    result["params"] = sum(p.numel() for p in params)
    out.put((rank, result))
    distributed.destroy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024, help="drafter hidden size (1024 x 4 layers: ~53 M params)")
    ap.add_argument("--layers", type=int, default=4, help="drafter layers")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per micro-batch (2 documents)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode (median reported)")
    args = ap.parse_args()
    results = spawn_ranks(worker, (args,))
    r0, r1 = results[0], results[1]
    old = max(r0["old_s"], r1["old_s"])
    ddp = max(r0["ddp_s"], r1["ddp_s"])
    mib = 4 * r0["params"] / 2 ** 20
    print(f"drafter: {r0['params'] / 1e6:.1f} M parameters ({mib:.0f} MiB of fp32 gradients per step), 2 gloo ranks, "
          f"2 micro-batches of {args.tokens} tokens per rank and step")
    print(f"old per-tensor all-reduce: {old:.3f} s/step | DDP: {ddp:.3f} s/step | ratio old/ddp = {old / ddp:.2f}")
    same = abs(r0["old_sum"] - r1["old_sum"]) < 1e-6 * abs(r0["old_sum"]) + 1e-9 and \
        abs(r0["ddp_sum"] - r1["ddp_sum"]) < 1e-6 * abs(r0["ddp_sum"]) + 1e-9
    print(f"ranks hold the same weights after each mode: {same}")
    if not same:
        raise SystemExit("the ranks diverged")


if __name__ == "__main__":
    main()
