"""`make bench-peers`: the same DFlash drafter trained by us, speculators and SpecForge on one shared job, each export
served by the same vLLM (greedy, fp32) and decoded by z-lab's own loop; results.json and docs/peers.md's table.

    .venv/bin/python -P benchmarks/peers/run.py [--work DIR] [--epochs E] [--trainers ours,speculators,specforge]
                                                [--prompts N] [--max-new-tokens N] [--rounds R] [--table]

The job (benchmarks/peers/job.py): the demo's real target, its regenerated answers, the features captured once
through the engine. Each peer runs from PyPI in a venv of its own (`<peer>/install.sh` -> .venv-peers/<peer>), by
`<peer>/train.py` (its offline format written from the job, every setting explicit, device-only CPU patches listed
there); ours by `python -m dflash_lib train -p hidden_cache` on the same features. Each training process runs
under GNU time -v (peak RSS), alone on the machine. Then our drafter decodes the prompt sets in process (held-out
answers, HumanEval, MT-Bench both turns: the second turn asked after the target's own greedy answer, the same for
every drafter) and every export is served on those prompts (`evaluate.served.serve_passes`: the engine with and
without it, `--rounds` timed rounds). `--table` only rewrites docs/peers.md's table from results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from job import Recipe, build_job  # noqa: E402

from dflash_lib.evaluate import _baseline, _warm, decode_groups, decode_threads, prepare, served_sets  # noqa: E402
from dflash_lib.lab.peers import PEER_NAMES, PeerRow, peak_rss_gib, peers_table, served_fields, with_table  # noqa: E402
from dflash_lib.evaluate.served import serve_passes  # noqa: E402
from dflash_lib.serve.measure import ServedPass, ServedSet  # noqa: E402
from dflash_lib.serve.server import engine_python  # noqa: E402

PEERS = PEER_NAMES
RESULTS = HERE / "results.json"
DOCS = REPO / "docs" / "peers.md"
ZLAB = REPO / ".venv-peers" / "dflash" / "bin" / "python"


def time_report(log: Path) -> tuple[float | None, float | None]:
    """(wall seconds, peak RSS GiB) from the GNU time -v report at the end of `log`."""
    text = log.read_text(errors="replace")
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text)
    wall = sum(float(x) * 60 ** i for i, x in enumerate(reversed(m.group(1).split(":")))) if m else None
    return wall, peak_rss_gib(text)


def timed(cmd: list[str], log: Path, env: dict[str, str] | None = None, reuse: bool = False
          ) -> tuple[int, float, float | None]:
    """Run `cmd` under GNU time -v, its output into `log`: (exit code, wall seconds, peak RSS GiB). OpenMP's idle
    threads wait passively (spinning, they cost a busy 2-core machine up to 10x: benchmarks/peers/zlab/decode.py)."""
    if reuse and log.is_file() and "Exit status: 0" in log.read_text(errors="replace"):
        wall, rss = time_report(log)  # --reuse: the last run's process, not run again
        return 0, wall or float("nan"), rss
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(["/usr/bin/time", "-v", *cmd], stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **(env or {})}).returncode
    return rc, time.perf_counter() - t0, peak_rss_gib(log.read_text(errors="replace"))


def last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip() and not ln.startswith("\t")]
    return lines[-1][:300] if lines else "(no output)"


def our_params(job: dict, work: Path) -> dict[str, object]:
    """The flat settings of our run: the job's data and features, the recipe's shape and optimizer."""
    r = job["recipe"]
    return {**job["params"], "hidden_cache": str(work / "job" / "cache"), "target_layer_ids": job["feature_layers"],
            "lr": r["lr"],
            "weight_decay": r["weight_decay"], "warmup_ratio": r["warmup_ratio"], "min_lr_ratio": r["min_lr_ratio"],
            "grad_clip": r["grad_clip"], "gamma": r["gamma"], "steps": 0, "epochs": r["epochs"], "seed": r["seed"],
            "strategy": "packed", "token_budget": r["tokens_per_step"],
            # the token budget closes every batch (as the peers' rows): room for every packed document's anchors
            "block_budget": r["tokens_per_step"] * r["block_size"] * r["num_anchors"], "eval_samples": 0, "eval_every": 0,
            "ckpt_every": 0, "target_cache_gib": 0.0, "wandb_mode": "disabled", "log_every": 10}


def train_ours(job: dict, work: Path, reuse: bool = False) -> PeerRow:
    from importlib.metadata import version

    params = our_params(job, work)
    run, export = work / "ours" / "run", work / "ours" / "export"
    args = [str(REPO / ".venv" / "bin" / "python"), "-m", "dflash_lib", "train", "--preset", "demo", "--run-dir",
            str(run), "--fresh"] + [x for k, v in params.items() for x in ("-p", k, json.dumps(v) if isinstance(
                v, list) else str(v))]
    env = {"OMP_NUM_THREADS": str(job["recipe"]["threads"])}
    rc, wall, rss = timed(args, work / "ours" / "train.log", env, reuse and (run / "summary.json").is_file())
    row = PeerRow("ours", "ran", "", version("dflash_lib"), settings=params, wall_s=wall, peak_rss_gib=rss)
    if rc != 0:
        return PeerRow("ours", "refused", last_line(work / "ours" / "train.log"), row.version, settings=params)
    summary = json.loads((run / "summary.json").read_text())
    row.train_tokens, row.loop_s = int(summary["real_tokens"]), float(summary["loop_s"])
    row.tokens_per_s = row.train_tokens / row.loop_s
    row.tokens_per_cpu_s = row.train_tokens / summary["loop_cpu_s"] if summary.get("loop_cpu_s") else None
    subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-m", "dflash_lib", "export", str(run), str(export),
                    "--dtype", "fp32", "--force"], check=True, cwd=REPO)
    return row


def train_peer(peer: str, job: dict, work: Path, reuse: bool = False) -> PeerRow:
    """install.sh, then the peer's train.py under GNU time; its result.json read into a row."""
    folder = work / peer
    install = subprocess.run(["bash", str(HERE / peer / "install.sh")], cwd=REPO, capture_output=True, text=True)
    if install.returncode != 0:
        tail = " ".join((install.stderr or install.stdout).split())[-300:]
        return PeerRow(peer, "refused", f"install failed: {tail}", "?")
    python = REPO / ".venv-peers" / peer / "bin" / "python"
    rc, wall, rss = timed([str(python), str(HERE / peer / "train.py"), "--job", str(work / "job"), "--work",
                           str(folder / "work"), "--export", str(folder / "export")], folder / "train.log",
                          {"OMP_NUM_THREADS": str(job["recipe"]["threads"])},
                          reuse and (folder / "work" / "result.json").is_file())
    result = folder / "work" / "result.json"
    if not result.is_file():
        return PeerRow(peer, "refused", f"exit {rc}: {last_line(folder / 'train.log')}", "?")
    doc = json.loads(result.read_text())
    ran, loop, cpu = doc["status"] == "ran", doc.get("loop_seconds"), doc.get("loop_cpu_seconds")
    tokens = doc.get("train_tokens")  # as the trainer counted them (speculators: {"theirs", "samples_x_epochs"})
    tokens = tokens.get("theirs") if isinstance(tokens, dict) else tokens
    return PeerRow(peer, doc["status"], doc.get("reason", ""), doc.get("version", "?"),
                   train_tokens=tokens if ran else None, loop_s=loop, tokens_per_s=tokens / loop if ran and loop else None,
                   wall_s=wall, peak_rss_gib=rss, tokens_per_cpu_s=tokens / cpu if ran and cpu else None,
                   unmatched=doc.get("unmatched", []), patches=doc.get("patches", []), settings=doc.get("settings", {}))


def export_of(row: PeerRow, work: Path) -> Path:
    return work / row.trainer / "export"


def decode_prompt_sets(run: Path, prompts: int, max_new: int, rounds: int = 1) -> tuple[Any, list[ServedSet]]:
    """The drafter of trainer run `run` decoded in process (greedy fp32) on the held-out answers, HumanEval and
    MT-Bench (both turns), `prompts` a set: (the evaluation setup, the prompt sets with our decodings)."""
    params = {"prompts": prompts, "max_new_tokens": max_new, "min_new_tokens": 0, "engine": "vllm",
              "prompts_from": "heldout,humaneval,mt-bench", "engine_rounds": rounds, "decode_threads": 0}
    setup = prepare(run, None, params)
    with decode_threads(setup):
        _warm(setup, setup.drafter)
        baseline = _baseline(setup)
        done = decode_groups(setup, setup.drafter, baseline)
    return setup, served_sets(baseline.groups, done)


def serve_all(rows: list[PeerRow], work: Path, prompts: int, max_new: int, rounds: int) -> list[str]:
    """Our drafter decodes the prompt sets in process; every export that trained is served on those prompts.
    Returns the set names (the table's columns)."""
    setup, sets = decode_prompt_sets(work / "ours" / "run", prompts, max_new, rounds)
    with open(work / "prompts.jsonl", "w") as f:  # z-lab's loop decodes the same prompts
        for s in sets:
            for p in s.prompts:
                f.write(json.dumps({"set": s.name, "prompt": p}) + "\n")
    for row in rows:
        if row.status != "ran":
            continue
        try:
            (report,) = serve_passes(setup.config.model.target, str(export_of(row, work)), [ServedPass(sets)],
                                     setup.drafter.cfg.block_size, max_new, setup.stop_ids, setup.min_new_tokens,
                                     "float32", engine_python(), "", work / row.trainer, 600.0, None, True,
                                     "engine", rounds)
        except Exception as e:  # noqa: BLE001 - an export the engine refuses is a finding: its error in the row
            row.reason = f"vLLM: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
            continue
        for k, v in served_fields(report).items():
            setattr(row, k, v)
        failed = [ln for ln in report.lines if ln.startswith("FAIL served: the engine failed")]
        if failed:
            row.reason = failed[0][:300]
    return [s.name for s in sets]


def zlab_all(rows: list[PeerRow], work: Path, job: dict, max_new: int) -> None:
    """Each served export decoded by z-lab's `spec_generate` (benchmarks/peers/zlab/decode.py)."""
    install = subprocess.run(["bash", str(HERE / "zlab" / "install.sh")], cwd=REPO, capture_output=True, text=True)
    for row in rows:
        if row.status != "ran":
            continue
        if install.returncode != 0:
            row.zlab_reason = "install failed: " + " ".join(install.stderr.split())[-200:]
            continue
        out = work / row.trainer / "zlab.json"
        for convert in ([], ["--convert-config"]):  # speculators' nested export: its config made flat (decode.py)
            out.unlink(missing_ok=True)
            rc = subprocess.run([str(ZLAB), str(HERE / "zlab" / "decode.py"), "--target", job["target"], "--drafter",
                                 str(export_of(row, work)), "--prompts", str(work / "prompts.jsonl"),
                                 "--max-new-tokens", str(max_new), "--out", str(out), "--threads",
                                 str(job["recipe"]["threads"]), *convert], cwd=REPO, capture_output=True, text=True)
            doc = json.loads(out.read_text()) if out.is_file() else {
                "status": "refused", "reason": f"exit {rc.returncode}: " + " ".join(rc.stderr.split())[-200:]}
            if doc.get("status") == "ran":
                break
        if doc.get("status") != "ran":
            row.zlab_reason = doc.get("reason", "refused")[:200]
            continue
        if convert:
            row.patches.append("z-lab's loader: the export's nested config made flat (benchmarks/peers/zlab/decode.py "
                               "--convert-config; the weights as stored)")
        # tau_verified: accepted drafts + 1 per cycle as the target verified them, what vLLM's counters count (the
        # package's own tau cuts each answer's last cycle at the token limit)
        row.zlab_tau = doc["tau_verified"]
        row.zlab_tau_per_set = {name: s["tau_verified"] for name, s in doc["sets"].items()}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def write_table(results: dict) -> None:
    rows = [PeerRow.from_json(r) for r in results["rows"]]
    DOCS.write_text(with_table(DOCS.read_text(), peers_table(rows, results["sets"])))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=str(REPO / "runs" / "peers"))
    ap.add_argument("--epochs", type=float, default=Recipe.epochs)
    ap.add_argument("--tokens-per-step", type=int, default=Recipe.tokens_per_step)
    ap.add_argument("--trainers", default="ours," + ",".join(PEERS))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reuse", action="store_true", help="keep each trainer's last finished run in --work (its "
                    "figures and export; the job must be the same): serve and decode again only")
    ap.add_argument("--table", action="store_true", help="only rewrite docs/peers.md's table from results.json")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    if a.table:
        write_table(json.loads(Path(a.out).read_text()))
        return 0
    work = Path(a.work)
    trainers = a.trainers.split(",")
    t0 = time.perf_counter()
    job = build_job(work / "job", Recipe(epochs=a.epochs, tokens_per_step=a.tokens_per_step))
    rows = [train_ours(job, work, a.reuse) if t == "ours" else train_peer(t, job, work, a.reuse) for t in trainers]
    sets = serve_all(rows, work, a.prompts, a.max_new_tokens, a.rounds)
    zlab_all(rows, work, job, a.max_new_tokens)
    results = {"what": __doc__.splitlines()[0], "date": time.strftime("%Y-%m-%d"),
               "machine": {"cpu": cpu_name(), "cores": os.cpu_count()},
               "job": {k: v for k, v in job.items() if k != "target"}, "sets": sets,
               "prompts_per_set": a.prompts, "max_new_tokens": a.max_new_tokens, "rounds": a.rounds,
               "seconds": round(time.perf_counter() - t0), "rows": [r.to_json() for r in rows]}
    Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
    write_table(results)
    print(peers_table(rows, sets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
