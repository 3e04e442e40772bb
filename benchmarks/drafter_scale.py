"""The drafter's attention at paper scale on this CPU: dense vs blocks, one training step, fp32.

    .venv/bin/python benchmarks/drafter_scale.py [--layers 1,2] [--repeats 3] [--tokens 3072] [--anchors 512]

One document of `--tokens` tokens (random ids; the loss mask covers everything after the first `--prompt`
tokens, so `--anchors` valid anchors exist), `--anchors` anchors x block 16, drafter hidden 1024 with 8 query
heads of 128 (2 key/value heads) over a random 4-layer tiny Qwen3 target of the same width and a small
vocabulary. The target's features are computed once, outside every measurement. One step = drafter forward +
chunked LM head + CE + backward (no optimizer: the same for both backends). Both backends see the same anchors
and the same weights, and their losses are compared.

- time: median wall seconds of `--repeats` steps per backend, backends alternated, after one warm-up each;
- peak RSS: each (backend, layers) runs in its OWN subprocess; after the models and inputs are built the peak
  resident set is reset (/proc/self/clear_refs = 5, else `ru_maxrss` is used as is) and the figure is the
  growth of the peak over the resident set at that point, through one step (MALLOC_MMAP_THRESHOLD_ is fixed so
  that freed tensors leave the RSS, the same for every case);
- attention FLOPs: one more step in that subprocess under `FlopCounterMode` with `attention.sdpa_flop_mapping()`
  (SDPA's CPU kernel, forward + backward), next to `layout.attention_work` (query-key pairs the mask allows).

Goals (issue 11): blocks' attention FLOPs <= 0.25x dense, peak memory no higher, step time no slower. The last
stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder holds scripts named like stdlib modules (tokenize.py): keep it off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from dflash_lib.data.batch import Batch, collate_padded  # noqa: E402
from dflash_lib.models import DFlashDrafter, DrafterConfig, build_layout, tiny_qwen3_config  # noqa: E402
from dflash_lib.target.local import TargetModel  # noqa: E402
from dflash_lib.models.attention import sdpa_flop_mapping  # noqa: E402
from dflash_lib.models.layout import DraftLayout, attention_work  # noqa: E402

BACKENDS = ("dense", "blocks")


def pair_flops(heads: int, head_dim: int) -> int:
    """Forward + backward SDPA FLOPs of ONE query-key pair over `heads` heads, by `sdpa_flop_mapping`'s formulas."""
    aten, one = torch.ops.aten, (1, heads, 1, head_dim)  # (b, h, S, d) of one query and one key
    count = sdpa_flop_mapping()
    return (count[aten._scaled_dot_product_flash_attention_for_cpu](one, one, one)
            + count[aten._scaled_dot_product_flash_attention_for_cpu_backward](one, one, one, one))


def build(args, layers: int) -> tuple[DFlashDrafter, Batch, torch.Tensor, object]:
    """Target, drafter (seeded: the same weights for every backend), the document batch, its features
    (1, T, F*H) and its anchors (seeded: the same for every backend)."""
    hf = tiny_qwen3_config(hidden_size=args.hidden, num_layers=4, num_heads=args.heads, num_kv_heads=args.kv_heads,
                           vocab_size=args.vocab, max_position_embeddings=max(4096, args.tokens))
    target = TargetModel.from_hf_config(hf, 2, [1, 2], seed=0)
    cfg = DrafterConfig(hidden_size=args.hidden, num_layers=layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                        head_dim=args.hidden // args.heads, intermediate_size=hf.intermediate_size,
                        vocab_size=args.vocab, target_layer_ids=[1, 2], target_num_layers=4,
                        block_size=args.block, mask_id=args.vocab - 1, num_anchors=args.anchors)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, target, attention="dense")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab - 1, args.tokens)
    batch = collate_padded([(tokens, np.arange(args.tokens) >= args.prompt)], pad_id=0)
    with torch.no_grad():
        feats = target.features(batch)  # (1, T, 2H)
    anchors = drafter.sample_anchors(batch, torch.Generator().manual_seed(0))
    return drafter, batch, feats, anchors


def step(drafter: DFlashDrafter, batch: Batch, feats: torch.Tensor, layout: DraftLayout, backend: str) -> float:
    """Forward + loss + backward of one micro-batch with `backend`; returns the loss."""
    drafter.attention = backend
    drafter.zero_grad(set_to_none=True)
    out = drafter.loss(batch, feats, layout, normalizer=layout.weight_sum)
    out.loss.backward()
    return float(out.loss.detach())


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def case(args, backend: str, layers: int) -> None:
    """Subprocess: peak RSS growth of one step, then the FLOPs of another; prints one JSON line."""
    drafter, batch, feats, anchors = build(args, layers)
    layout = build_layout(batch, anchors, backend)
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # peak resident set := current (Linux >= 4.0)
        method = "VmHWM after clear_refs"
    except OSError:
        method = "ru_maxrss (not reset: the build's peak may hide the step's)"
    base_kib = _status_kib("VmRSS")
    loss = step(drafter, batch, feats, layout, backend)
    peak_kib = _status_kib("VmHWM") if method.startswith("VmHWM") else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with FlopCounterMode(display=False, custom_mapping=sdpa_flop_mapping()) as counter:
        step(drafter, batch, feats, layout, backend)
    counts = counter.get_flop_counts()["Global"]
    attn = sum(v for k, v in counts.items() if "scaled_dot_product" in str(k))
    work = attention_work(layout, backend)
    print(json.dumps(dict(backend=backend, layers=layers, loss=loss, base_mib=base_kib / 1024,
                          peak_mib=peak_kib / 1024, growth_mib=(peak_kib - base_kib) / 1024, rss_method=method,
                          attn_flops=attn, total_flops=sum(counts.values()), pairs_allowed=work["allowed"],
                          pairs_computed=work["computed"], blocks=layout.num_blocks, scored=layout.num_scored)))


def run_case(args, backend: str, layers: int) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    cmd = [sys.executable, __file__, "--case", backend, "--layers", str(layers), "--threads", str(args.threads),
           "--tokens", str(args.tokens), "--prompt", str(args.prompt), "--anchors", str(args.anchors),
           "--block", str(args.block), "--hidden", str(args.hidden), "--heads", str(args.heads),
           "--kv-heads", str(args.kv_heads), "--vocab", str(args.vocab)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode:
        raise RuntimeError(f"case {backend}/{layers} failed:\n{run.stderr[-4000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def timing(args, layers: int) -> dict[str, dict]:
    """Median step seconds per backend (alternated, one warm-up each) and the loss each backend gives."""
    drafter, batch, feats, anchors = build(args, layers)
    layouts = {b: build_layout(batch, anchors, b) for b in BACKENDS}
    times: dict[str, list[float]] = {b: [] for b in BACKENDS}
    losses = {b: step(drafter, batch, feats, layouts[b], b) for b in BACKENDS}  # warm-up
    for _ in range(args.repeats):
        for b in BACKENDS:
            t0 = time.perf_counter()
            step(drafter, batch, feats, layouts[b], b)
            times[b].append(time.perf_counter() - t0)
    return {b: dict(seconds=statistics.median(times[b]), runs=times[b], loss=losses[b]) for b in BACKENDS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="1,2", help="drafter depths to measure")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per backend (median), after one warm-up")
    p.add_argument("--tokens", type=int, default=3072, help="document length (tokens)")
    p.add_argument("--prompt", type=int, default=256, help="leading tokens outside the loss mask")
    p.add_argument("--anchors", type=int, default=512, help="anchors (blocks) per document")
    p.add_argument("--block", type=int, default=16, help="block size B")
    p.add_argument("--hidden", type=int, default=1024, help="target and drafter hidden size")
    p.add_argument("--heads", type=int, default=8, help="query heads (head_dim = hidden / heads)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary (LM head rows)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--case", choices=BACKENDS, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    depths = [int(x) for x in args.layers.split(",")]
    if args.case is not None:
        case(args, args.case, depths[0])
        return

    print(f"one document of {args.tokens} tokens, {args.anchors} anchors x B={args.block}, hidden {args.hidden} "
          f"({args.heads} heads x {args.hidden // args.heads}, {args.kv_heads} kv heads), vocab {args.vocab}, fp32, "
          f"{args.threads} torch threads, {os.cpu_count()} CPUs")
    rows = []
    for layers in depths:
        t0 = time.perf_counter()
        cases = {b: run_case(args, b, layers) for b in BACKENDS}
        times = timing(args, layers)
        for b in BACKENDS:
            rows.append(dict(cases[b], seconds=times[b]["seconds"], runs=times[b]["runs"]))
        diff = abs(times["dense"]["loss"] - times["blocks"]["loss"])
        print(f"  {layers} layer(s) measured in {time.perf_counter() - t0:.0f} s; loss dense "
              f"{times['dense']['loss']:.6f} blocks {times['blocks']['loss']:.6f} (|diff| {diff:.1e}); "
              f"{cases['dense']['blocks']} blocks, {cases['dense']['scored']} scored positions")
    print(f"\n{'layers':>6} {'backend':>7} {'step s':>7} {'peak RSS MiB':>12} {'(abs MiB)':>9} "
          f"{'attn GFLOP':>10} {'total GFLOP':>11} {'attn/allowed':>12}")
    for r in rows:
        allowed = pair_flops(args.heads, args.hidden // args.heads) * r["pairs_allowed"] * r["layers"]
        print(f"{r['layers']:>6} {r['backend']:>7} {r['seconds']:>7.2f} {r['growth_mib']:>12.0f} "
              f"{r['peak_mib']:>9.0f} {r['attn_flops'] / 1e9:>10.1f} {r['total_flops'] / 1e9:>11.1f} "
              f"{r['attn_flops'] / allowed:>12.2f}")
    print(f"(peak RSS: growth over the built models and inputs, {rows[0]['rss_method']}; attn/allowed: counted "
          f"attention FLOPs over the forward + backward FLOPs of the query-key pairs the mask allows, per layer)")
    checks = []
    for layers in depths:
        d, b = (next(r for r in rows if r["layers"] == layers and r["backend"] == x) for x in BACKENDS)
        ratios = dict(flops=b["attn_flops"] / d["attn_flops"], memory=b["growth_mib"] / d["growth_mib"],
                      time=b["seconds"] / d["seconds"])
        met = dict(flops=ratios["flops"] <= 0.25, memory=ratios["memory"] <= 1.0, time=ratios["time"] <= 1.0)
        checks.append(dict(layers=layers, ratios=ratios, met=met))
        print(f"{layers} layer(s), blocks / dense: attention FLOPs {ratios['flops']:.3f}x (goal <= 0.25: "
              f"{'met' if met['flops'] else 'MISSED'}), peak RSS growth {ratios['memory']:.2f}x (goal <= 1: "
              f"{'met' if met['memory'] else 'MISSED'}), step time {ratios['time']:.2f}x (goal <= 1: "
              f"{'met' if met['time'] else 'MISSED'})")
    goals = all(all(c["met"].values()) for c in checks)
    print(json.dumps(dict(tokens=args.tokens, anchors=args.anchors, block=args.block, hidden=args.hidden,
                          threads=args.threads, rows=rows, checks=checks, goals_met=goals)))


if __name__ == "__main__":
    main()
