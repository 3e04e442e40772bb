"""A trainer on the peers' job again, with other seeds or (ours) one setting changed: how far served tau moves with
the seed alone, and what a setting changes (docs/peers.md, "Where the peers may gain").

    .venv/bin/python -P benchmarks/peers/spread.py --work runs/peers --seeds 1,2
    .venv/bin/python -P benchmarks/peers/spread.py --work runs/peers --seeds 0 --tag tps836 -p token_budget 836
    .venv/bin/python -P benchmarks/peers/spread.py --work runs/peers --seeds 1,2 --trainer speculators
    .venv/bin/python -P benchmarks/peers/spread.py --work runs/peers --seeds 1,2 --tag order --order-follows-seed
    .venv/bin/python -P benchmarks/peers/spread.py --work runs/peers --losses

Reads the job `run.py` built in --work (job.json and the captured features: run `make bench-peers` first), trains
`python -m dflash_lib train` with run.py's settings of ours (`our_params`) and the seed and `-p` overrides given,
into WORK/spread/<tag>-s<seed>/, then decodes the drafter in process on the same prompt sets run.py serves (greedy
fp32: vLLM's served tau equals this decoding's, cycle for cycle; benchmarks/peers/results.json shows it for the
reference run). A peer (`--trainer speculators` or `specforge`) trains by its own train.py on a copy of the job whose
recipe has the seed given, into WORK/spread/<trainer>-s<seed>/, and its export is served by vLLM on the same prompts
(one round: the served tau of a peer's export equals z-lab's loop's, results.json). One line per run: tau over
every set with its standard error over cycles, tau per set, the training tokens and loop seconds; all lines also
in WORK/spread/spread.json. The committed reference is benchmarks/peers/spread.json (a copy of one such file):
`--table` renders docs/peers.md's seeds-and-levers table from it and results.json (a test checks they agree).
"""

from __future__ import annotations

import argparse
import ast
import fcntl
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from run import PEERS, decode_prompt_sets, our_params  # noqa: E402

from dflash_lib.evaluate.served import serve_passes, served_tau_se, tau_se  # noqa: E402
from dflash_lib.lab.peers import (SPREAD_BEGIN, SPREAD_END, PeerRow, SpreadLine, loss_thirds,  # noqa: E402
                                  served_fields, spread_table, with_table)
from dflash_lib.serve.measure import ServedPass  # noqa: E402
from dflash_lib.serve.server import engine_python  # noqa: E402

REFERENCE = HERE / "spread.json"  # the committed lines
RESULTS = HERE / "results.json"
DOCS = REPO / "docs" / "peers.md"


def write_table(lines_file: Path = REFERENCE) -> None:
    """docs/peers.md's seeds-and-levers table from `lines_file` and results.json's rows."""
    lines = [SpreadLine.from_json(x) for x in json.loads(lines_file.read_text())]
    rows = [PeerRow.from_json(r) for r in json.loads(RESULTS.read_text())["rows"]]
    DOCS.write_text(with_table(DOCS.read_text(), spread_table(lines, rows), SPREAD_BEGIN, SPREAD_END))


def run_losses(spread: Path) -> dict[str, list[float]]:
    """Each finished run's training loss a step, by run name: ours' from its metrics.jsonl, a peer's from the
    `step N: {...}` lines its trainer prints (SpecForge) into WORK/spread/<run>.log."""
    out: dict[str, list[float]] = {}
    for log in sorted(spread.glob("*.log")):
        run = spread / log.stem
        if (run / "summary.json").is_file():
            out[run.name] = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
        elif (run / "work" / "result.json").is_file():
            steps = [ast.literal_eval(m.group(1))["loss"] for m in re.finditer(r"^step \d+: (\{.*\})$",
                                                                                 log.read_text(), re.M)]
            if steps:
                out[run.name] = steps
    return out


def print_losses(spread: Path) -> None:
    """The mean training loss over each third of every finished run, and each tag's mean over its runs."""
    by_tag: dict[str, list[tuple[float, float, float]]] = {}
    for name, losses in run_losses(spread).items():
        thirds = loss_thirds(losses)
        by_tag.setdefault(name.rsplit("-s", 1)[0], []).append(thirds)
        print(f"{name}: {len(losses)} steps, loss by third " + " / ".join(f"{x:.2f}" for x in thirds))
    for tag, rows in by_tag.items():
        means = (sum(r[i] for r in rows) / len(rows) for i in range(3))
        print(f"{tag} ({len(rows)} runs): " + " / ".join(f"{x:.2f}" for x in means))


def add_line(lines_file: Path, line: dict) -> None:
    """`line` into `lines_file` in place of the line of its tag and seed; the file read just before it is written
    (under a lock), so runs of spread.py sharing a work folder keep each other's lines."""
    with open(lines_file.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lines = json.loads(lines_file.read_text()) if lines_file.is_file() else []
        lines = [x for x in lines if (x["tag"], x["seed"]) != (line["tag"], line["seed"])] + [line]
        tmp = lines_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(lines, indent=1) + "\n")
        tmp.replace(lines_file)


def prompt_run(work: Path) -> Path:
    """A run of ours on the job, whose held-out split and settings give the prompt sets a peer's export is served
    on: run.py's, else any of spread.py's (the split hashes each sample, so every run of ours holds out the same)."""
    for run in [work / "ours" / "run", *sorted((work / "spread").iterdir())]:
        if (run / "config.json").is_file() and (run / "summary.json").is_file():
            return run
    raise SystemExit(f"no run of ours in {work}: run `make bench-peers` or spread.py (ours) first")


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


def train_peer(peer: str, job: dict, work: Path, out: Path, seed: int) -> dict:
    """The peer's own train.py on a copy of the job (job.json with the recipe's seed; its samples linked) into
    `out`; its result.json."""
    job_dir = work / "spread" / f"job-s{seed}"
    job_dir.mkdir(parents=True, exist_ok=True)
    for name in ("samples", "cache"):
        if not (job_dir / name).exists():
            (job_dir / name).symlink_to((work / "job" / name).resolve())
    (job_dir / "job.json").write_text(json.dumps({**job, "recipe": {**job["recipe"], "seed": seed}}, indent=1))
    result = out / "work" / "result.json"
    if not result.is_file():
        out.mkdir(parents=True, exist_ok=True)
        python = REPO / ".venv-peers" / peer / "bin" / "python"
        with open(out.parent / f"{out.name}.log", "w") as f:
            subprocess.run([str(python), str(HERE / peer / "train.py"), "--job", str(job_dir), "--work",
                            str(out / "work"), "--export", str(out / "export")], stdout=f, stderr=subprocess.STDOUT,
                           cwd=REPO, check=True, env={**os.environ, "OMP_NUM_THREADS": str(job["recipe"]["threads"]),
                                                      "OMP_WAIT_POLICY": "PASSIVE"})
    doc = json.loads(result.read_text())
    if doc.get("status") != "ran":
        raise SystemExit(f"{peer} seed {seed} refused: {doc.get('reason')}")
    return doc


def served(sets: list, setup: Any, export: Path, log_dir: Path, max_new: int) -> dict:
    """tau over every set (its standard error from the engine's per-position counts) and per set, `export`
    served by vLLM on `sets` (greedy fp32, one round)."""
    (report,) = serve_passes(setup.config.model.target, str(export), [ServedPass(sets)], setup.drafter.cfg.block_size,
                             max_new, setup.stop_ids, setup.min_new_tokens, "float32", engine_python(), "", log_dir,
                             600.0, None, True, "engine", 1)
    tau, se = served_tau_se(report.rows)
    fields = served_fields(report)
    return {"tau": tau, "tau_se": se, "cycles": sum(r.served_drafts for r in report.rows),
            "per_set": fields["served_tau_per_set"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=str(REPO / "runs" / "peers"))
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--order-follows-seed", action="store_true",
                    help="ours: the sampler's seed (the data's order) set to the seed too; by default it stays 0, so "
                         "only the drafter's init and the anchors' draws change with the seed")
    ap.add_argument("--tag", default="seed")
    ap.add_argument("--trainer", default="ours", choices=["ours", *PEERS])
    ap.add_argument("-p", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--table", action="store_true", help=f"only rewrite docs/peers.md's seeds-and-levers table from "
                                                         f"{REFERENCE.relative_to(REPO)}")
    ap.add_argument("--losses", action="store_true", help="only print the training loss by third of every finished "
                                                            "run in WORK/spread (ours' and SpecForge's)")
    a = ap.parse_args()
    if a.table:
        write_table()
        return 0
    if a.losses:
        print_losses(Path(a.work) / "spread")
        return 0
    work = Path(a.work)
    job_file = work / "job" / "job.json"
    if not job_file.is_file():
        print(f"no job in {work}: run `make bench-peers` (benchmarks/peers/run.py --work {work}) first")
        return 2
    job = json.loads(job_file.read_text())
    (work / "spread").mkdir(exist_ok=True)
    lines_file = work / "spread" / "spread.json"
    if a.trainer != "ours" and (a.p or a.order_follows_seed):
        print("-p changes our settings only: a peer's run takes the job's recipe (benchmarks/peers/job.py)")
        return 2
    tag = a.tag if a.trainer == "ours" else a.trainer
    sets: Any = None
    for seed in [int(s) for s in a.seeds.split(",")]:
        run = work / "spread" / f"{tag}-s{seed}"
        if a.trainer == "ours":
            overrides = {**dict(a.p), **({"sampler_seed": str(seed)} if a.order_follows_seed else {})}
            summary = train(job, work, run, seed, overrides)
            line = {"tag": tag, "seed": seed, "overrides": overrides, "train_tokens": summary["real_tokens"],
                    "loop_s": summary["loop_s"], **decoded(run, a.prompts, a.max_new_tokens)}
        else:
            doc = train_peer(a.trainer, job, work, run, seed)
            if sets is None:  # the prompts and our reference decoding of them, as run.py serves every export
                setup, sets = decode_prompt_sets(prompt_run(work), a.prompts, a.max_new_tokens)
            tokens = doc.get("train_tokens")
            line = {"tag": tag, "seed": seed, "overrides": {},
                    "train_tokens": tokens.get("theirs") if isinstance(tokens, dict) else tokens,
                    "loop_s": doc.get("loop_seconds"), **served(sets, setup, run / "export", run, a.max_new_tokens)}
        add_line(lines_file, line)
        print(f"{tag} seed {seed}: tau {line['tau']:.3f} +- {line['tau_se']:.3f} over {line['cycles']} cycles; "
              + ", ".join(f"{k} {v:.3f}" for k, v in line["per_set"].items())
              + f"; {line['train_tokens']:,} tokens in {line['loop_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
