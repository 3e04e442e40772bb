"""What the distributed checkpoints cost: save and load of a weights + AdamW state with `dflash_lib.train.checkpoint`
(DCP shards, fsync, sha256 of every file, manifest, rename) on 1 and 2 ranks vs plain torch.save/torch.load.

Run: .venv/bin/python benchmarks/checkpoint_io.py [--params 250e6] [--repeats 2] [--dir PATH]
The state is what the trainer saves for a drafter of `--params` fp32 parameters: the weights and AdamW's two
moments (12 bytes per parameter: 3 GB at 250 M), as `get_state_dict` lays them out. Rows, median seconds and GB/s:
  plain torch.save / torch.load (weights_only) of the whole state in one process (no fsync, no checksum),
  1 rank: start_save + wait (DCP, no process group) / find_latest + load_into (verify sha256, read in place),
  2 ranks (gloo, DDP layout: both ranks hold the whole state, DCP spreads the writes over them) / the same load,
with the ratios to plain. The plain save does not fsync, so the ratios include the price of durability.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from dflash_lib.train import distributed  # noqa: E402
from dflash_lib.train.checkpoint import find_latest, load_into, start_save  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for benchmarks/_common.py only, then off again
from _common import join_group, spawn_ranks  # noqa: E402

del sys.path[0]

TENSORS = 16  # weight tensors the parameters are split into (a drafter has a few large matrices per layer)


def make_state(params: int) -> dict:
    """Weights + AdamW state of `params` fp32 parameters in TENSORS tensors, `get_state_dict`'s layout."""
    n = params // TENSORS
    gen = torch.Generator().manual_seed(0)
    names = [f"layers.{i // 4}.w{i % 4}" for i in range(TENSORS)]
    return {
        "step": 10,
        "drafter": {k: torch.randn(n, generator=gen) for k in names},
        "optimizer": {"state": {k: {"step": torch.tensor(10.0), "exp_avg": torch.randn(n, generator=gen),
                                    "exp_avg_sq": torch.rand(n, generator=gen)} for k in names},
                      "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                                        "params": names}]},
    }


def median_s(fn, repeats: int, barrier=lambda: None) -> float:
    times = []
    for _ in range(repeats):
        barrier()
        t0 = time.perf_counter()
        fn()
        barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_dcp(state: dict, root: Path, repeats: int, group) -> tuple[float, float]:
    """(save s, load s) of `state` with the library's checkpoints; every rank calls it."""
    barrier = distributed.barrier
    save = median_s(lambda: start_save(root, state, 10, config_hash="bench", keep_last=1,
                                       rank_state={"rng": torch.zeros(8)}, group=group).wait(), repeats, barrier)

    def load() -> None:
        path = None
        if distributed.is_main():
            path = find_latest(root, "bench")[1]  # rank 0 verifies every file's sha256, as a resume does
        barrier()
        load_into(path or root / "ckpt-00000010", {"drafter": state["drafter"], "optimizer": state["optimizer"]},
                  group)
    return save, median_s(load, repeats, barrier)


def worker(rank: int, params: int, root: str, repeats: int, port: int, out: "mp.Queue") -> None:
    join_group(rank, 2, port, timeout_s=1800)
    group = distributed.checkpoint_group(1800)
    state = make_state(params)
    out.put((rank, run_dcp(state, Path(root), repeats, group)))
    distributed.destroy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=250e6, help="fp32 parameters of the drafter (state = 12 B each)")
    ap.add_argument("--repeats", type=int, default=2, help="timed repetitions per operation (median reported)")
    ap.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temp folder)")
    args = ap.parse_args()
    params = int(args.params)
    gb = 12 * params / 1e9
    rows: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        state = make_state(params)
        plain = root / "plain.pt"
        rows["plain torch.save"] = median_s(lambda: torch.save(state, plain), args.repeats)
        rows["plain torch.load"] = median_s(lambda: torch.load(plain, weights_only=True), args.repeats)
        plain.unlink()
        rows["1 rank save"], rows["1 rank load"] = run_dcp(state, root / "one", args.repeats, None)
        state = None  # free 3 GB before the 2-rank processes build theirs
        shutil.rmtree(root / "one")
        results = spawn_ranks(worker, (params, str(root / "two"), args.repeats), join_timeout_s=120)
        rows["2 ranks save"] = max(results[r][0] for r in results)
        rows["2 ranks load"] = max(results[r][1] for r in results)
    print(f"state: {params / 1e6:.0f} M parameters, weights + AdamW = {gb:.2f} GB; median of {args.repeats}")
    print(f"{'op':<20} {'s':>8} {'GB/s':>7} {'x plain':>8}")
    for op, s in rows.items():
        base = rows["plain torch.save"] if "save" in op else rows["plain torch.load"]
        print(f"{op:<20} {s:>8.2f} {gb / s:>7.2f} {s / base:>8.2f}")


if __name__ == "__main__":
    main()
