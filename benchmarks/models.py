"""CPU training-step throughput of the tiny demo models, padded vs packed, and peak memory of the LM head + CE.

    .venv/bin/python benchmarks/models.py [--rows 1] [--steps 2] [--small-vocab 4096] [--mem-docs 8]

Part 1: the same synthetic documents (ShareGPT-like log-normal lengths, loss mask on the second half) fill
`--rows` rows of the demo token budget; they are collated end to end (packed) or one per row in
length-sorted batches of the same budget (padded). One step = target features + drafter loss + backward +
AdamW. Reported: real tokens per second (median step) and the padding share. Run twice: with the real Qwen3
vocabulary (the LM head over every scored position dominates at H=64) and with a small vocabulary, where the
layout-dependent parts (target and drafter attention, padding) show.
Part 2: each case runs in a fresh subprocess and reports its peak resident-memory growth over one loss +
backward, chunked (ce_chunk_blocks) vs unchunked (0), real Qwen3 vocabulary.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder holds scripts named like stdlib modules (tokenize.py): keep it off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dflash_lib.config import demo  # noqa: E402
from dflash_lib.data.batch import Batch, collate_packed, collate_padded  # noqa: E402
from dflash_lib.models import DFlashDrafter, DrafterConfig, tiny_qwen3_config  # noqa: E402
from dflash_lib.target.local import TargetModel  # noqa: E402


def synthetic_docs(n: int, max_len: int, seed: int, vocab: int = 151000) -> list[tuple[np.ndarray, np.ndarray]]:
    """n documents, lengths log-normal (median ~330 tokens) clipped to [32, max_len]; the second half of each
    is the 'assistant' part (loss mask set)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(330), 0.8, n), 32, max_len).astype(int)
    return [(rng.integers(0, vocab - 1, L), np.arange(L) >= L // 2) for L in lengths]


def fill_rows(rows: int, budget: int, max_len: int, seed: int, vocab: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Draw documents in order and lay them into `rows` rows of `budget` tokens; a document that does not
    fit closes the row once it is >= 97% full, else it is skipped. Returns the documents of each row."""
    pool = iter(synthetic_docs(50 * rows + 100, max_len, seed, vocab))
    out: list[list] = [[]]
    used = 0
    while len(out) <= rows:
        tok, lm = next(pool)
        if used + len(tok) <= budget:
            out[-1].append((tok, lm))
            used += len(tok)
        elif used >= 0.97 * budget:
            out.append([(tok, lm)])
            used = len(tok)
    return out[:rows]


def build(ce_chunk_blocks: int, vocab: int = 0) -> tuple[TargetModel, DFlashDrafter]:
    """The demo preset's target and drafter; vocab > 0 swaps in a smaller vocabulary (MASK = vocab - 1)."""
    cfg = demo().model
    cfg.ce_chunk_blocks = ce_chunk_blocks
    if vocab:
        cfg.mask_id = vocab - 1
        hf = tiny_qwen3_config(hidden_size=cfg.hidden_size, num_layers=cfg.target_layers, vocab_size=vocab)
        target = TargetModel.from_hf_config(hf, cfg.num_features, seed=0)
    else:
        target = TargetModel.from_model_config(cfg, seed=0)
    torch.manual_seed(0)
    return target, DFlashDrafter(DrafterConfig.from_model_config(cfg, target), target)


def step_seconds(target, drafter, batches: list[Batch], steps: int) -> tuple[float, float]:
    """Median wall seconds of one optimizer step over all `batches`, and the target's share of it."""
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    times, target_share = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        feats = [target.context_features(b) for b in batches]  # (C, F*H): the trainer's real-token context
        t1 = time.perf_counter()
        layouts = [drafter.layout(b, drafter.sample_anchors(b, gen)) for b in batches]  # the feed stage's work
        total_w = sum(lay.weight_sum for lay in layouts)
        opt.zero_grad()
        for b, f, lay in zip(batches, feats, layouts):
            drafter.loss(b, f, lay, normalizer=total_w).loss.backward()
        opt.step()
        t2 = time.perf_counter()
        times.append(t2 - t0)
        target_share.append((t1 - t0) / (t2 - t0))
    return statistics.median(times), statistics.median(target_share)


def throughput(args, vocab: int) -> None:
    cfg = demo()
    budget = cfg.sampler.token_budget
    rows = fill_rows(args.rows, budget, cfg.data.max_len, seed=0, vocab=vocab or 151000)
    docs = [d for row in rows for d in row]
    target, drafter = build(cfg.model.ce_chunk_blocks, vocab)
    real = sum(len(t) for t, _ in docs)
    per_batch = max(1, budget // max(len(t) for t, _ in docs))  # padded batches within the same budget
    order = sorted(range(len(docs)), key=lambda i: len(docs[i][0]))  # padded: length-sorted batches
    padded = [collate_padded([docs[i] for i in order[s:s + per_batch]], 0) for s in range(0, len(docs), per_batch)]
    packed = [collate_packed(row, 0, budget) for row in rows]
    print(f"demo models, vocab {target.vocab_size}: target {target.num_layers} layers H={target.hidden_size} "
          f"features {target.layer_ids}, drafter {drafter.cfg.num_layers} layer(s), B={drafter.cfg.block_size}, "
          f"{drafter.cfg.num_anchors} anchors/doc; {len(docs)} docs, {real} real tokens; "
          f"torch threads {torch.get_num_threads()}")
    step_seconds(target, drafter, packed[:1], 1)  # warm-up
    for name, batches in (("padded", padded), ("packed", packed)):
        slots = sum(b.padded_tokens for b in batches)
        sec, share = step_seconds(target, drafter, batches, args.steps)
        print(f"  {name:7s} {len(batches):3d} batches, {slots:6d} slots ({1 - real / slots:5.1%} padding): "
              f"{real / sec:8.0f} real tok/s ({sec:.2f} s/step, target forward {share:.0%} of it)")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def memory_case(chunk: int, docs: int) -> None:
    """Runs in a subprocess: peak resident memory growth (MiB) over one loss + backward, sampled every
    0.2 ms by a thread (MALLOC_MMAP_THRESHOLD_ is fixed by the parent, so freed tensors leave the RSS)."""
    target, drafter = build(chunk)
    batch = collate_padded(synthetic_docs(docs, 512, seed=1), 0)
    feats = target.features(batch)
    layout = drafter.layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(0)))
    before, peak, done = _rss_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.0002)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    out = drafter.loss(batch, feats, layout)
    out.loss.backward()
    done.set()
    watcher.join()
    print(json.dumps(dict(chunk=chunk, positions=layout.num_scored, loss=out.loss.item(),
                          peak_growth_mib=(max(peak[0], _rss_bytes()) - before) / 2**20)))


def memory(args) -> None:
    m = demo().model
    print(f"peak memory of one loss + backward (vocab 151936, {args.mem_docs} docs x {m.num_anchors} anchors x "
          f"B={m.block_size}):")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    results = []
    for chunk in (0, 64, 8):
        cmd = [sys.executable, __file__, "--memory-case", str(chunk), "--mem-docs", str(args.mem_docs),
               "--threads", str(args.threads)]
        run = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
        r = json.loads(run.stdout.strip().splitlines()[-1])
        results.append(r)
        label = "unchunked" if chunk == 0 else f"chunk {chunk:2d} blocks"
        print(f"  {label:16s} scored positions {r['positions']:5d}  loss {r['loss']:.6f}  "
              f"peak RSS growth {r['peak_growth_mib']:8.1f} MiB")
    base = results[0]["peak_growth_mib"]
    for r in results[1:]:
        print(f"  chunk {r['chunk']} / unchunked peak growth: {r['peak_growth_mib'] / base:.3f}"
              f" (loss difference {abs(r['loss'] - results[0]['loss']):.1e})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1, help="packed rows of the demo token budget to fill with documents")
    p.add_argument("--steps", type=int, default=2, help="timed steps per layout (median reported)")
    p.add_argument("--small-vocab", type=int, default=4096, help="second throughput run's vocabulary (0 = skip)")
    p.add_argument("--mem-docs", type=int, default=8, help="documents in the memory comparison")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--memory-case", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_case is not None:
        memory_case(args.memory_case, args.mem_docs)
        return
    throughput(args, vocab=0)
    if args.small_vocab:
        throughput(args, vocab=args.small_vocab)
    memory(args)


if __name__ == "__main__":
    main()
