"""Benchmark: the CSP pipeline against a plain sequential loop, same batches, same tiny models, same step.

(a) sequential: for each batch: collate -> target.features -> train_step, one after another in one thread.
(b) pipeline:   `run_training` as shipped: sampler, collate and target worker(s) in their own threads, the
    drafter step in the caller, bounded queues in between.
Both see the first `--steps` batches of epoch 0 of a BucketedShuffleSampler over the bundled corpus, and the
same drafter initialisation. Throughput is REAL tokens/s after the steady-state detector fires (the trainer's
own `ThroughputMeter`); data wait is the share of wall time the drafter step waited for its batch (for (a):
the collate + target time, which a sequential loop always waits for).

torch intra-op threads: run with each of `--threads` (default 1 and 2). On a 2-core machine, 1 thread lets
the target worker and the drafter step each own a core in (b); 2 threads give a sequential loop both cores.
The pipeline is also run with its target worker limited to `--target-threads` (the `target_threads` setting;
torch's thread count is per thread, so the drafter keeps all of its own). Every variant is measured
`--repeats` times, the variants alternated, and pipeline / sequential is the median of ratios within a repeat.

    .venv/bin/python benchmarks/pipeline.py [--steps 40] [--threads 1,2] [--repeats 3] [--limit 2000]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# Running a script puts its folder first on sys.path; benchmarks/ holds scripts, not modules, and one named
# like a stdlib module (e.g. tokenize.py) would shadow it for torch. Drop the folder from the path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
os.environ.setdefault("WANDB_MODE", "disabled")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dflash_lib.config import Config, from_params, preset  # noqa: E402
from dflash_lib.data import build_token_store_from_config  # noqa: E402
from dflash_lib.data.stats import store_drafter_queries  # noqa: E402
from dflash_lib.models import DFlashDrafter, DrafterConfig  # noqa: E402
from dflash_lib.target.local import TargetModel  # noqa: E402
from dflash_lib.plan.sampler import FixedBatchSampler  # noqa: E402
from dflash_lib.train.build import TrainingParts, bucket_edges, build_sampler, drafter_checkpointing  # noqa: E402
from dflash_lib.train.feed import Work, make_collate, make_prepare, make_target_workers  # noqa: E402
from dflash_lib.train.loop import run_training  # noqa: E402
from dflash_lib.train.metrics import ThroughputMeter  # noqa: E402
from dflash_lib.train.schedule import lr_at, noise_at  # noqa: E402
from dflash_lib.train.state import BadStepGuard  # noqa: E402
from dflash_lib.train.step import build_optimizer, train_step  # noqa: E402


def steady_rate(times: list[float], tokens: list[int], waits: list[float]) -> dict:
    """Steady-state figures of per-step durations (s), real tokens and data waits (s), replayed through the
    trainer's ThroughputMeter: tokens/s and data-wait % from the steady window's start (without a steady
    state: over the second half of the steps, flagged by steady_start None)."""
    clock = [0.0]
    meter = ThroughputMeter(clock=lambda: clock[0])
    meter.start()
    for i, (dt, tok, w) in enumerate(zip(times, tokens, waits)):
        clock[0] += dt
        meter.step(i, tok, tok, w)
    if meter.detector.steady:
        return dict(tok_s=meter.steady_tok_s, steady_start=meter.detector.start_step,
                    wait_pct=meter.steady_data_wait_pct, first=meter.detector.start_step)
    s = len(times) // 2
    return dict(tok_s=sum(tokens[s:]) / sum(times[s:]), steady_start=None,
                wait_pct=100 * sum(waits[s:]) / sum(times[s:]), first=s)


def models(config: Config) -> tuple[TargetModel, DFlashDrafter]:
    target = TargetModel.from_model_config(config.model, seed=config.train.seed)
    torch.manual_seed(config.train.seed)
    return target, DFlashDrafter(DrafterConfig.from_model_config(config.model, target), target,
                                 attention=config.model.drafter_attention,
                                 checkpointing=drafter_checkpointing(config.model.drafter_checkpointing, target.device))


def run_sequential(config: Config, store, batches, pad_id: int, edges: list[int]) -> dict:
    target, drafter = models(config)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = build_optimizer(params, config.train, target.device)
    # the trainer's feed stage: anchors drawn and the drafter's layout built in the collate step
    prepare = make_prepare(drafter, config.train.seed, lambda index: noise_at(index, config.train))
    collate = make_collate(store, False, pad_id, 0, edges, prepare=prepare)
    (work,) = make_target_workers([target], 1, target.device)
    guard = BadStepGuard(config.train.max_bad_steps)
    times, tokens, waits, collate_s = [], [], [], []
    total = len(batches)
    for step, idx in enumerate(batches):
        t0 = time.perf_counter()
        host = collate(Work(0, step, 0, True, idx, step))
        collate_s.append(time.perf_counter() - t0)
        item = work(host)
        t1 = time.perf_counter()
        res = train_step(drafter, [item], params, opt, lr_at(step, total, config.train), config.train.grad_clip,
                         False, guard, step + 1)
        times.append(time.perf_counter() - t0)
        waits.append(t1 - t0)  # a sequential loop waits for all of its data work
        tokens.append(res.real_tokens)
    out = steady_rate(times, tokens, waits)
    s = out["first"]
    return dict(out, collate_pct=100 * sum(collate_s[s:]) / sum(times[s:]),
                collate_ms=1e3 * float(np.mean(collate_s[s:])))


def run_pipeline(config: Config, store, lengths, batches, pad_id: int, edges: list[int]) -> dict:
    target, drafter = models(config)
    parts = TrainingParts(store, lengths, FixedBatchSampler(batches), [target], drafter, pad_id, False, 0, edges)
    with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(io.StringIO()):  # no log lines here
        run_training(config, parts, Path(d))
        rows = [json.loads(line) for line in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    out = steady_rate([r["step_s"] for r in rows], [r["real_tokens"] for r in rows], [r["wait_s"] for r in rows])
    tail = rows[out["first"]:]
    return dict(out, q_pre_mean=float(np.mean([sum(r["q_pre"]) for r in tail])),
                q_hs_mean=float(np.mean([sum(r["q_hs"]) for r in tail])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="batches (= optimizer steps) per measurement")
    ap.add_argument("--threads", default="1,2", help="torch intra-op thread counts to try")
    ap.add_argument("--limit", type=int, default=2000, help="conversations read from the bundled corpus")
    ap.add_argument("--max-len", type=int, default=1024, help="tokens per sample")
    ap.add_argument("--budget", type=int, default=4096, help="token budget per batch, padding included")
    ap.add_argument("--workers", type=int, default=1, help="target worker threads in the pipeline")
    ap.add_argument("--target-threads", default="0,1",
                    help="torch threads of each pipeline target worker to try (0 = the same as the drafter's)")
    ap.add_argument("--repeats", type=int, default=3, help="measurements of every variant, alternated")
    ap.add_argument("--target-layers", type=int, default=8, help="tiny target depth")
    ap.add_argument("--hidden", type=int, default=128, help="tiny target (and drafter) hidden size")
    ap.add_argument("--anchors", type=int, default=8, help="anchors per document (the drafter's work)")
    args = ap.parse_args()

    config = from_params(dict(limit=args.limit, max_len=args.max_len, token_budget=args.budget, k=6,
                              steps=args.steps, log_every=10 ** 9, wandb_mode="disabled",
                              target_workers=args.workers, prefetch=4, hs_queue=2, target_layers=args.target_layers,
                              hidden_size=args.hidden, num_anchors=args.anchors), preset("demo"))
    store = build_token_store_from_config(config.data, progress=False)
    lengths = np.asarray(store.lengths)
    queries = store_drafter_queries(store, config.model.num_anchors, config.model.block_size)  # as build_parts
    edges = bucket_edges(config, lengths, queries=queries)
    sampler = build_sampler(config, lengths, 0, 1, edges, queries)
    batches = [b for _, b in zip(range(args.steps), sampler)]
    pad_id = int(store.meta["tokenizer"]["pad_id"])
    real = sum(int(lengths[b].sum()) for b in batches)
    print(f"{len(batches)} batches, {real} real tokens, edges {edges}, budget {args.budget}, "
          f"model: target {config.model.target_layers}L/{config.model.hidden_size}H, drafter "
          f"{config.model.drafter_layers}L, {config.model.num_anchors} anchors/doc, {os.cpu_count()} CPUs, "
          f"pipeline target workers {args.workers}")
    variants = []  # (loop name, torch threads of the caller, target worker threads or 0)
    for threads in (int(t) for t in args.threads.split(",")):
        variants.append(("sequential", threads, 0))
        variants += [("pipeline", threads, tt) for tt in sorted({int(t) for t in args.target_threads.split(",")})
                     if tt < threads]  # tt = 0: the same as the caller; tt = threads would repeat it
    results: dict[tuple[str, int, int], list[dict]] = {v: [] for v in variants}
    for rep in range(args.repeats):  # alternate the variants so that drift of the machine hits all alike
        for loop, threads, tt in variants:
            torch.set_num_threads(threads)
            if loop == "sequential":
                results[(loop, threads, tt)].append(run_sequential(config, store, batches, pad_id, edges))
            else:
                cfg = from_params({"target_threads": tt}, config)
                results[(loop, threads, tt)].append(run_pipeline(cfg, store, lengths, batches, pad_id, edges))

    def name(v: tuple[str, int, int]) -> str:
        return v[0] if v[0] == "sequential" else f"pipeline, target {v[2] or v[1]} thr"

    print(f"{'loop':<26} {'threads':>7} {'median Ktok/s':>13} {'range':>13} {'data wait':>9}")
    for v, runs in results.items():
        tok = [r["tok_s"] / 1e3 for r in runs]
        print(f"{name(v):<26} {v[1]:>7} {np.median(tok):>13.2f} {min(tok):>6.2f}-{max(tok):<6.2f} "
              f"{np.median([r['wait_pct'] for r in runs]):>8.2f}%")
    seq = {t: np.array([r["tok_s"] for r in results[("sequential", t, 0)]]) for _, t, _ in variants}
    for v, runs in results.items():
        if v[0] != "pipeline":
            continue
        paired = np.array([r["tok_s"] for r in runs]) / seq[v[1]]  # (repeats,) same repeat, same machine state
        p = runs[len(runs) // 2]
        print(f"at {v[1]} thread(s), {name(v)}: pipeline / sequential = {np.median(paired):.2f}x median of "
              f"{len(paired)} paired repeats (range {paired.min():.2f}-{paired.max():.2f}; goal >= 1.0x); data wait "
              f"{np.median([r['wait_pct'] for r in runs]):.2f}% (goal <= 2%), q_pre {p['q_pre_mean']:.1f} "
              f"q_hs {p['q_hs_mean']:.1f}")
    best = {loop: max((np.median([r["tok_s"] for r in runs]), v) for v, runs in results.items() if v[0] == loop)
            for loop in ("sequential", "pipeline")}
    print(f"best pipeline ({name(best['pipeline'][1])}, {best['pipeline'][1][1]} threads) / best sequential "
          f"({best['sequential'][1][1]} threads): {best['pipeline'][0] / best['sequential'][0]:.2f}x (goal >= 1.0x)")
    collate = [r for v, runs in results.items() if v[0] == "sequential" for r in runs]
    print(f"collation: {np.mean([r['collate_ms'] for r in collate]):.1f} ms per batch, "
          f"{np.mean([r['collate_pct'] for r in collate]):.2f}% of a sequential step (threads suffice; a process "
          f"pool could save at most that share)")
    if any(r["steady_start"] is None for runs in results.values() for r in runs):
        print("* some measurement found no steady state: its rate is over the second half of the steps")


if __name__ == "__main__":
    main()
