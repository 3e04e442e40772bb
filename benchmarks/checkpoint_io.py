"""What crash safety costs: atomic save (hash + fsync + rename) and verified load vs. plain torch.save/load.

Run: .venv/bin/python benchmarks/checkpoint_io.py [--sizes-mib 16 64 256] [--repeats 3] [--dir PATH]
Prints, per state size, the median seconds and MiB/s of each operation and the atomic/plain ratio. The plain
save does not fsync, so the ratio includes the price of durability (the data really reaching the disk).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Running `python benchmarks/x.py` puts benchmarks/ first on sys.path, where a benchmark module's name can
# shadow the standard library (e.g. `tokenize`, which torch needs): import from the normal path only.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from dflash_lib.checkpoint import load_latest, save_checkpoint, verify_checkpoint  # noqa: E402


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256], help="state sizes in MiB")
    ap.add_argument("--repeats", type=int, default=3, help="timed repetitions per operation (median reported)")
    ap.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temp folder)")
    args = ap.parse_args()

    print(f"{'MiB':>6} {'op':<26} {'median s':>9} {'MiB/s':>8}")
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        root = Path(root)
        for mib in args.sizes_mib:
            n = mib * (1 << 20) // 4
            # a model-like state: a few large tensors plus optimizer-like moments
            state = {"model": {f"w{i}": torch.randn(n // 8) for i in range(4)},
                     "optimizer": {"exp_avg": torch.randn(n // 4), "exp_avg_sq": torch.rand(n // 4), "step": 10},
                     "step": 10}
            plain = root / "plain.pt"
            rows = {
                "plain torch.save": _median_s(lambda: torch.save(state, plain), args.repeats),
                "atomic save_checkpoint": _median_s(lambda: save_checkpoint(root / "ck", state, 10, config_hash="b",
                                                                            keep_last=1), args.repeats),
                "plain torch.load": _median_s(lambda: torch.load(plain, weights_only=True), args.repeats),
                "verify (sha256)": _median_s(lambda: verify_checkpoint(root / "ck" / "ckpt-00000010"), args.repeats),
                "load_latest (verify+load)": _median_s(lambda: load_latest(root / "ck", "b"), args.repeats),
            }
            for op, s in rows.items():
                print(f"{mib:>6} {op:<26} {s:>9.3f} {mib / s:>8.0f}")
            print(f"{mib:>6} ratio save atomic/plain = {rows['atomic save_checkpoint'] / rows['plain torch.save']:.2f}, "
                  f"load verified/plain = {rows['load_latest (verify+load)'] / rows['plain torch.load']:.2f}")


if __name__ == "__main__":
    main()
