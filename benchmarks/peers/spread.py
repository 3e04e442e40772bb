"""Our trainer on the peers' job again, with other seeds or one setting changed: how far our served tau moves with
the seed alone, and what a setting changes (docs/peers.md, "Where the peers may gain").

    .venv/bin/python -P benchmarks/peers/spread.py --work runs/peers --seeds 1,2
    .venv/bin/python -P benchmarks/peers/spread.py --work runs/peers --seeds 0 --tag tps836 -p tokens_per_step 836

Reads the job `run.py` built in --work (job.json and the captured features: run `make bench-peers` first), trains
`python -m dflash_lib train` with run.py's settings of ours (`our_params`) and the seed and `-p` overrides given,
into WORK/spread/<tag>-s<seed>/, then decodes the drafter in process on the same prompt sets run.py serves (greedy
fp32: vLLM's served tau equals this decoding's, cycle for cycle; benchmarks/peers/results.json shows it for the
reference run). One line per run: tau over every set with its standard error over cycles, tau per set, the
training tokens and loop seconds; all lines also in WORK/spread/spread.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from run import decode_prompt_sets, our_params  # noqa: E402

from dflash_lib.serve.measure import tau_se  # noqa: E402


def train(job: dict, work: Path, out: Path, seed: int, overrides: dict[str, str]) -> dict:
    """One training run of ours on the job's features, the seed and `overrides` over run.py's settings."""
    params = {**our_params(job, work), "seed": seed, **overrides}
    args = [sys.executable, "-m", "dflash_lib", "train", "--preset", "demo", "--run-dir", str(out), "--fresh"]
    args += [x for k, v in params.items() for x in ("-p", k, json.dumps(v) if isinstance(v, list) else str(v))]
    if not (out / "summary.json").is_file():
        with open(out.parent / f"{out.name}.log", "w") as f:
            subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, check=True,
                           env={**os.environ, "OMP_NUM_THREADS": str(job["recipe"]["threads"]),
                                "OMP_WAIT_POLICY": "PASSIVE"})
    return json.loads((out / "summary.json").read_text())


def decoded(run: Path, prompts: int, max_new: int) -> dict:
    """tau over every set (with its standard error) and per set, our decoding of run.py's prompt sets."""
    _, sets = decode_prompt_sets(run, prompts, max_new)
    tau, se = tau_se([c for s in sets for c in s.cycle_log])
    return {"tau": tau, "tau_se": se, "cycles": sum(len(c) for s in sets for c in s.cycle_log),
            "per_set": {s.name: tau_se(s.cycle_log)[0] for s in sets}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=str(REPO / "runs" / "peers"))
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--tag", default="seed")
    ap.add_argument("-p", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    a = ap.parse_args()
    work = Path(a.work)
    job_file = work / "job" / "job.json"
    if not job_file.is_file():
        print(f"no job in {work}: run `make bench-peers` (benchmarks/peers/run.py --work {work}) first")
        return 2
    job = json.loads(job_file.read_text())
    (work / "spread").mkdir(exist_ok=True)
    lines_file = work / "spread" / "spread.json"
    lines = json.loads(lines_file.read_text()) if lines_file.is_file() else []
    for seed in [int(s) for s in a.seeds.split(",")]:
        run = work / "spread" / f"{a.tag}-s{seed}"
        summary = train(job, work, run, seed, dict(a.p))
        line = {"tag": a.tag, "seed": seed, "overrides": dict(a.p), "train_tokens": summary["real_tokens"],
                "loop_s": summary["loop_s"], **decoded(run, a.prompts, a.max_new_tokens)}
        lines = [x for x in lines if (x["tag"], x["seed"]) != (a.tag, seed)] + [line]
        lines_file.write_text(json.dumps(lines, indent=1) + "\n")
        print(f"{a.tag} seed {seed}: tau {line['tau']:.3f} +- {line['tau_se']:.3f} over {line['cycles']} cycles; "
              + ", ".join(f"{k} {v:.3f}" for k, v in line["per_set"].items())
              + f"; {line['train_tokens']:,} tokens in {line['loop_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
