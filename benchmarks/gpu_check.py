"""The GPU check (issues 11, 25, 55): one command, at most 9 minutes on one H200, one JSON summary on the last line.

    PYTHONPATH=. python3 benchmarks/gpu_check.py            # the check (CUDA)
    PYTHONPATH=. python3 benchmarks/gpu_check.py --quick    # tiny shapes, 3 steps; runs on CPU too

Wheels to carry: none. It imports torch, numpy, transformers (and their own dependencies: safetensors, tqdm,
pyyaml) and dflash_lib.{batch, config, feed, pipeline, models, train, validate, dryrun}; none of these imports
pandas, plotly or wandb at import time (train imports them lazily, in functions this script does not call).
Runs on torch 2.11 (the GPU image) and 2.13. The connector section needs more (httpx, and vLLM on CUDA in the
engine's Python: `make engine`'s .venv-engine or $DFLASH_ENGINE_PYTHON) and says "skipped" without them; the
linear_rule section needs flash-linear-attention (`pip install flash-linear-attention`) likewise.

Sections, each guarded (a failure is reported under its name as {"ok": false, "error": ...}, the others run):
  parity    flex / blocks / dense on padded and packed batches of a tiny random target: loss, final drafter states
            and every parameter gradient against `dense`, in fp32 (TF32 off; max |diff| / max |ref| <= 1e-4) and
            under bf16 autocast (<= eps_bf16 * sqrt(N / 3) ~ 4.3e-2 for the N ~ 92 bf16 roundings on the longest
            path: TOL below).
            flex needs CUDA for its backward: skipped elsewhere.
  train     a Qwen3-0.6B-SHAPED random target (hidden 1024, 28 layers, 16 heads, 8 kv heads, head_dim 128,
            intermediate 3072, vocab 151936, bf16 weights on the GPU), the paper drafter (5 layers, 5 features,
            block 16, 512 anchors, flex, checkpointing, bf16 autocast over fp32 master weights, fused AdamW), 30
            optimizer steps through the library's Pipeline (one packed row of ROW_LEN tokens per step) after
            WARMUP untimed steps (compilation). Documents are synthesized: lengths ~ lognormal(median 900, sigma
            0.8) clipped to [64, 3072] tokens, random token ids, the first U(10 %, 50 %) of each document is the
            "user" turn (loss mask off), the rest the assistant's (loss mask on). Reports Ktok/s (real tokens),
            MFU = (FLOPs per real token, counted by torch.utils.flop_counter.FlopCounterMode over one full step) x
            tokens/s / 989 TFLOP/s (H200 dense bf16 peak), the peak memory (`torch.cuda.max_memory_allocated`) of
            the run and of one step on the costliest batch alone, and the dry run's prediction for that same
            batch (`dflash_lib.dryrun.measure_step` in fake mode on the CPU, run BEFORE any GPU step).
  pipeline  the same models and batches: a plain loop (collate -> target -> step, one thread, default stream)
            vs the Pipeline (a target worker thread on its own CUDA stream); Ktok/s of each and their ratio.
  drafting  `acceptance_length` with the bf16 target and the trained drafter (bf16 autocast) on a few prompts;
            its outputs must equal the target's own greedy decoding token for token, up to a first difference at
            a near tie (both tokens within TIE_ULPS eps * max|logit| of the max: the B-row verification and the
            one-row forwards round bf16 differently).
  fsdp      the trainer's FSDP2 wrapper (`distributed.DrafterParallel("fsdp")`: fully_shard per drafter layer and the root,
            bf16 parameters / fp32 reduction on CUDA) in a 1-rank process group (NCCL on CUDA, gloo on CPU) against
            the same drafter without FSDP (fp32 master weights, bf16 autocast on CUDA): 3 accumulated steps
            (2 micro-batches each) of `step.train_step`; the losses' max relative difference (<= 3e-2 on CUDA:
            bf16 parameters against an fp32 master; <= 1e-5 on CPU, fp32 both), and `DrafterParallel.full_weights`
            giving plain full tensors under the plain names. (2-rank FSDP is covered on CPU/gloo by
            tests/test_torchrun.py; one GPU cannot hold a 2-rank NCCL group.)
  kl        loss ce+kl (`context_features_and_final`, the KL term's chunked target logits and its gradient) on the
            device in fp32 (TF32 off, <= 1e-4) and bf16 (<= TOL["bf16"]) against the same models in fp32 on the CPU.
  sampling  speculative sampling at temperature 1, top_p 0.9, with an untrained drafter, on the device against
            the CPU with the same CPU generator: fp32 probabilities agree to ~1e-6, so the outputs must be equal
            token for token (the law itself is proven on the CPU by tests/test_sampling.py's chi-square).
  target_shard  the target sharded with FSDP2 for loss kl (`ShardedTarget(final=True)`, built on the host,
            sharded onto the device) in a 1-rank NCCL group: features and final states against the same target
            built on the device.
  linear_conv  a hybrid target's padded causal convolution (one conv1d over the documents, each preceded by
            W-1 zeros) on the device in fp32 and bf16 against transformers' convolution of each document alone
            in fp64 on the CPU.
  linear_rule  flash-linear-attention's varlen chunked gated delta rule (bf16, CUDA) against transformers' torch
            rule of each document alone in fp32 on the CPU; skipped without CUDA or flash-linear-attention.
  sliding_flex  sliding-window drafter layers through flex against dense in fp32 on the CPU (fp32 and bf16;
            gradients on CUDA, forward only on the CPU).
  connector  our KV connector's hidden states from vLLM on CUDA (bf16) against the local target's features in
            fp32 on the CPU; skipped, with the reason, without CUDA, without an engine Python whose vLLM runs on
            CUDA, or without the budget left for the engine's start.
            Each of these four records max_err (max |x - ref| / max |ref|), its tolerance (derived from the
            dtype: `rounding_tol`, `walk_tol`, TOL), a planted fault's error (which must exceed the tolerance),
            status pass / fail / skipped and seconds.
The list of sections is SECTIONS. The check's budget: BUDGET_S.
--quick: tiny shapes everywhere, 3 steps, for any device (CUDA-only parts are skipped with a reason).
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent  # benchmarks/tokenize.py would shadow the standard library's tokenize
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse
import json
import math
import platform
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from dflash_lib.config import Config, ModelConfig, PipelineConfig  # noqa: E402
from dflash_lib.data.batch import collate_packed, collate_padded  # noqa: E402
from dflash_lib.evaluate.acceptance import acceptance_length  # noqa: E402
from dflash_lib.models import DFlashDrafter, DrafterConfig  # noqa: E402
from dflash_lib.target.local import TargetModel  # noqa: E402
from dflash_lib.train.feed import Work, make_collate, make_prepare, make_target_workers  # noqa: E402
from dflash_lib.train.pipeline import Pipeline  # noqa: E402
from dflash_lib.train.state import BadStepGuard  # noqa: E402
from dflash_lib.train.step import train_step  # noqa: E402

H200_BF16_TFLOPS = 989.0  # dense bf16 peak of an H200 SXM (TFLOP/s): the MFU denominator
GIB = 2 ** 30
# bf16 keeps 8 significant bits: a rounding to nearest errs by a relative amount uniform in +-eps/2 (std
# eps / (2 sqrt 3)), and N independent roundings on a path add up like a random walk. The longest path a bf16 case
# compares (kl: fp32 on the CPU against the bf16 target's features, then the drafter's forward and backward under
# autocast) rounds ~13 times a target layer (2 norms, q/k/v, q/k norms, rotary, attention, o, 2 residual adds,
# gate/up, activation, product, down: bf16 weights, bf16 residual stream) and ~9 times a drafter layer each way
# (autocast keeps its norms and residual stream fp32), plus the fc and the head: N = 4 * 13 + 2 * (2 + 2 * 9) = 92
# for small_models' 4 target and 2 drafter layers. Two standard deviations of the walk: 2 * eps / (2 sqrt 3) *
# sqrt(N) = eps * sqrt(N / 3) = 0.043. Measured on a CPU: parity 0.0079 (blocks against dense), kl 0.0164;
# a planted fault (the blocks backend blind to each run's first context key) gives 0.48.
BF16_ROUNDINGS = 4 * 13 + 2 * (2 + 2 * 9)


def rounding_tol(dtype: torch.dtype, terms: int, depth: int = 1, c: float = 2.0) -> float:
    """max |x - ref| / max |ref| a computation in `dtype` may show against an exact one (the CPU reference, fp32 or
    fp64): the house's rule (tests/fp_tolerance.py), c * eps(dtype) * sqrt(terms) * depth, for sums of `terms`
    rounded in another order, `depth` such steps in a row."""
    return c * torch.finfo(dtype).eps * math.sqrt(terms) * depth


def walk_tol(dtype: torch.dtype, roundings: int) -> float:
    """max |x - ref| / max |ref| of a path that rounds each op's output in `dtype` (its sums accumulated in fp32, as
    CUDA's bf16 matmuls do) `roundings` times against an fp32 reference: eps * sqrt(N / 3) (see BF16_ROUNDINGS)."""
    return torch.finfo(dtype).eps * math.sqrt(roundings / 3)


TOL = {"fp32": 1e-4,  # max |x - dense| / max |dense| (see the module docstring)
       "bf16": walk_tol(torch.bfloat16, BF16_ROUNDINGS)}


def qwen3_shape(quick: bool):
    """(transformers.Qwen3Config, drafter settings, run settings) for the train/pipeline/drafting sections."""
    import transformers

    if quick:
        hf = transformers.Qwen3Config(vocab_size=1024, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, intermediate_size=192,
                                      max_position_embeddings=4096, attn_implementation="sdpa")
        model = ModelConfig(drafter_layers=1, num_features=2, block_size=4, num_anchors=16, mask_id=1023)
        run = dict(row_len=512, steps=3, warmup=1, median_len=90, max_len=300, seq_steps=2)
    else:  # Qwen3-0.6B's published config.json shapes
        hf = transformers.Qwen3Config(vocab_size=151936, hidden_size=1024, num_hidden_layers=28,
                                      num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                      intermediate_size=3072, max_position_embeddings=40960, rope_theta=1_000_000.0,
                                      rms_norm_eps=1e-6, tie_word_embeddings=True, attn_implementation="sdpa")
        model = ModelConfig(drafter_layers=5, num_features=5, block_size=16, num_anchors=512)
        run = dict(row_len=8192, steps=30, warmup=3, median_len=900, max_len=3072, seq_steps=10)
    return hf, model, run


def synth_docs(n: int, vocab: int, median: int, max_len: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """n documents: lengths ~ lognormal(log median, 0.8) clipped to [64 (quick: 16), max_len]; the first
    U(0.1, 0.5) of each is the user turn (loss mask False), the rest the assistant's (True)."""
    rng = np.random.default_rng(seed)
    lo = min(64, median // 4)
    lens = np.clip(rng.lognormal(math.log(median), 0.8, n), lo, max_len).astype(int)
    docs = []
    for L in lens:
        user = int(L * rng.uniform(0.1, 0.5))
        docs.append((rng.integers(0, min(vocab, 151643), L), np.arange(L) >= user))
    return docs


def pack(lengths: list[int], row_len: int) -> list[list[int]]:
    """Greedy first-fit in order: index lists of documents whose lengths sum to <= row_len."""
    rows, cur, used = [], [], 0
    for i, L in enumerate(lengths):
        if used + L > row_len and cur:
            rows.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += L
    if cur:
        rows.append(cur)
    return rows


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def small_models(device: torch.device, target_dtype: torch.dtype, attention: str, vocab: int = 512,
                 **drafter: Any):
    """A 4-layer hidden-64 random Qwen3 target (seed 0) and a 2-layer drafter on it (seed 0); `drafter`: more
    DrafterConfig fields (e.g. loss="ce+kl")."""
    from dflash_lib.models import tiny_qwen3_config

    target = TargetModel.from_hf_config(tiny_qwen3_config(hidden_size=64, num_layers=4, vocab_size=vocab), 2,
                                        device=device, dtype=target_dtype)
    cfg = DrafterConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                        vocab_size=vocab, target_layer_ids=target.layer_ids, target_num_layers=target.num_layers,
                        block_size=8, mask_id=vocab - 1, num_anchors=12, ce_chunk_blocks=4, **drafter)
    torch.manual_seed(0)
    return target, DFlashDrafter(cfg, target, attention=attention, checkpointing=True)


def one_rank_group(device: torch.device) -> None:
    """The default process group of this one process (NCCL on CUDA, gloo elsewhere) on a free local port."""
    import socket

    import torch.distributed as dist

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.TCPStore("127.0.0.1", port, 1, True), rank=0,
                            world_size=1, device_id=device if cuda else None)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (b the reference), in fp32 on the host."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


# -- a. parity --------------------------------------------------------------------------------------------------


def section_parity(device: torch.device, quick: bool) -> dict[str, Any]:
    backends = ["dense", "blocks"] + (["flex"] if device.type == "cuda" else [])
    out: dict[str, Any] = {"backends": backends, "tolerance": TOL, "cases": []}
    if device.type != "cuda":
        out["skipped_flex"] = "flex needs CUDA for its backward (FlexAttention has no CPU backward)"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    vocab = 512
    rng = np.random.default_rng(0)
    # documents shorter than a block, long ones, and ones with no assistant token in the first block
    docs = [(rng.integers(0, vocab - 1, n), np.arange(n) >= s) for n, s in ((5, 1), (40, 3), (23, 10), (61, 2))]
    batches = {"padded": collate_padded(docs, 0), "packed": collate_packed(docs, 0, 160)}
    worst_ok = True
    for precision in ("fp32", "bf16"):
        tdtype = torch.float32 if precision == "fp32" else torch.bfloat16
        autocast = precision == "bf16"
        ref_state = None
        for kind, batch in batches.items():
            results: dict[str, dict[str, Any]] = {}
            for backend in backends:
                target, drafter = small_models(device, tdtype, backend, vocab)
                if ref_state is None:
                    ref_state = {k: v.clone() for k, v in drafter.state_dict().items()}
                drafter.load_state_dict(ref_state)
                anchors = drafter.sample_anchors(batch, torch.Generator().manual_seed(7))
                layout = drafter.layout(batch, anchors).to(device)
                dev_batch = batch.to(device)
                feats = target.context_features(dev_batch, target.segments(batch.doc_ids))  # as the trainer
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    hidden = drafter.forward_hidden(dev_batch, feats, layout)
                    loss = drafter.loss(dev_batch, feats, layout).loss
                loss.backward()
                grads = {n: p.grad.detach().float().clone() for n, p in drafter.named_parameters()
                         if p.grad is not None}
                results[backend] = dict(loss=loss.detach().float(), hidden=hidden.detach().float(), grads=grads)
            ref = results["dense"]
            for backend in backends[1:]:
                got = results[backend]
                errs = dict(loss=rel_err(got["loss"], ref["loss"]), hidden=rel_err(got["hidden"], ref["hidden"]),
                            grads=max(rel_err(got["grads"][n], ref["grads"][n]) for n in ref["grads"]))
                ok = all(v <= TOL[precision] for v in errs.values()) and set(got["grads"]) == set(ref["grads"])
                worst_ok &= ok
                out["cases"].append(dict(precision=precision, batch=kind, backend=backend, ok=ok,
                                         **{f"rel_err_{k}": v for k, v in errs.items()}))
    out["ok"] = worst_ok
    return out


# -- f. loss ce+kl on the device against the CPU ---------------------------------------------------------------


def kl_step(device: torch.device, precision: str, batch, seed: int) -> dict[str, Any]:
    """One loss ce+kl forward and backward of `small_models` on `device` (fp32, or a bf16 target under bf16
    autocast): the target's features and final states at the layout's rows (`context_features_and_final`),
    the drafter's loss and every parameter gradient, on the host in fp32."""
    target, drafter = small_models(device, torch.float32 if precision == "fp32" else torch.bfloat16, "blocks",
                                   loss="ce+kl", kl_temperature=1.5)
    layout = drafter.layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(seed)))
    dev_batch = batch.to(device)
    feats, final = target.context_features_and_final(dev_batch, layout.target_rows, target.segments(batch.doc_ids))
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = drafter.loss(dev_batch, feats, layout.to(device), target_hidden=final).loss
    loss.backward()
    return dict(loss=loss.detach().float().cpu(), final=final.float().cpu(), rows=int(layout.target_rows.numel()),
                grads={n: p.grad.detach().float().cpu() for n, p in drafter.named_parameters() if p.grad is not None})


def section_kl(device: torch.device) -> dict[str, Any]:
    """loss ce+kl (the KL term's chunked target logits, its one-matmul gradient) on `device` in fp32 (TF32 off) and
    under bf16 against the same models in fp32 on the CPU: the final states, the loss and every gradient within
    TOL. On the CPU the fp32 case is the reference itself; the bf16 case still measures bf16 autocast."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rng = np.random.default_rng(5)
    docs = [(rng.integers(0, 511, n), np.arange(n) >= s) for n, s in ((33, 4), (70, 9), (12, 2))]
    batch = collate_padded(docs, 0)
    ref = kl_step(torch.device("cpu"), "fp32", batch, 3)
    cases, ok = [], ref["rows"] > 0
    for precision in ("fp32", "bf16"):
        got = kl_step(device, precision, batch, 3)
        errs = dict(final=rel_err(got["final"], ref["final"]), loss=rel_err(got["loss"], ref["loss"]),
                    grads=max(rel_err(got["grads"][n], ref["grads"][n]) for n in ref["grads"]))
        good = all(v <= TOL[precision] for v in errs.values()) and set(got["grads"]) == set(ref["grads"])
        ok &= good
        cases.append(dict(precision=precision, ok=good, **{f"rel_err_{k}": v for k, v in errs.items()}))
    return dict(ok=ok, loss="ce+kl", kl_temperature=1.5, target_rows=ref["rows"], reference="fp32 on the CPU",
                tolerance=TOL, cases=cases)


# -- g. speculative sampling on the device against the CPU ------------------------------------------------------


def section_sampling(device: torch.device, quick: bool) -> dict[str, Any]:
    """Speculative sampling (temperature 1, top_p 0.9) with an untrained drafter (some drafts rejected, so the
    residual resampling runs: `per_position` < 1) on `device` in fp32 (TF32 off) against the same models on the
    CPU, every draw from a CPU generator seeded alike: the probabilities agree to ~1e-6, so a token differs only
    where a uniform falls within that of a threshold (expected count ~0); the outputs must be equal token for
    token. The distribution itself is proven on the CPU (tests/test_sampling.py: chi-square against the target's
    exact law)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 511, int(n)).tolist() for n in (9, 25, 40, 64)[:2 if quick else 4]]
    n_new = 12 if quick else 40
    runs = {}
    for where in (torch.device("cpu"), device):
        target, drafter = small_models(where, torch.float32, "blocks")
        drafter.eval()
        with torch.no_grad():
            runs[where.type] = acceptance_length(target, drafter, prompts, n_new, temperature=1.0, top_p=0.9,
                                                 generator=torch.Generator().manual_seed(11))
    ref, got = runs["cpu"], runs[device.type]
    equal = [a == b for a, b in zip(got.outputs, ref.outputs)]
    rejected = min(got.per_position) < 1  # a draft was rejected: the residual was sampled
    return dict(ok=all(equal) and rejected, rejected=rejected, prompts=len(prompts), new_tokens=n_new,
                temperature=1.0, top_p=0.9, equals_cpu=equal, tau=got.tau, tau_cpu=ref.tau,
                per_position=got.per_position,
                reference="the same models and generator on the CPU" + (" (this run is on the CPU: the path only)"
                                                                        if device.type == "cpu" else ""))


# -- h. the target sharded with FSDP2 (loss kl: every layer), 1-rank group ---------------------------------------


def section_target_shard(device: torch.device) -> dict[str, Any]:
    """`target.sharded.ShardedTarget` built with `final` (loss kl / ce+kl) from a target on the HOST, sharded onto
    `device` in a 1-rank process group (NCCL on CUDA: fully_shard's move of the layers to the device, the
    per-layer all-gathers and the prefetch chain over every layer), against the same target built on the device:
    features and final states within TOL["bf16"] (bf16 weights; `bitwise_equal` says whether they are identical),
    every layer parameter a DTensor, the replicated parts on the device. (2 ranks are covered on CPU/gloo by
    tests/test_target_parallel.py and tests/test_torchrun.py.)"""
    import torch.distributed as dist

    from dflash_lib.target.sharded import ShardedTarget

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    plain, drafter = small_models(device, dtype, "blocks", loss="kl")
    host, _ = small_models(torch.device("cpu"), dtype, "blocks")
    rng = np.random.default_rng(8)
    batch = collate_padded([(rng.integers(0, 511, n), np.arange(n) >= 3) for n in (45, 20, 77)], 0)
    layout = drafter.layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(2)))
    want = plain.context_features_and_final(batch, layout.target_rows)
    one_rank_group(device)
    try:
        sharded = ShardedTarget(host, 60.0, device, final=True)
        got = sharded.context_features_and_final(batch, layout.target_rows)
        bare = sharded.context_features(batch)  # a filler's pass: every layer too
        sync(device)
        layers = sorted({type(p).__name__ for p in sharded.target.base.layers.parameters()})
        outside = {str(p.device) for n, p in sharded.target.model.named_parameters() if ".layers." not in n}
    finally:
        dist.destroy_process_group()
    errs = dict(features=rel_err(got[0], want[0]), final=rel_err(got[1], want[1]), bare=rel_err(bare, want[0]))
    bitwise = all(torch.equal(a.cpu(), b.cpu()) for a, b in ((got[0], want[0]), (got[1], want[1]), (bare, want[0])))
    ok = max(errs.values()) <= TOL["bf16"] and layers == ["DTensor"] and outside == {str(plain.device)}
    return dict(ok=ok, **{f"rel_err_{k}": v for k, v in errs.items()}, bitwise_equal=bitwise, layer_params=layers,
                replicated_on=sorted(outside), target_rows=int(layout.target_rows.numel()),
                precision=str(dtype).replace("torch.", ""))


# -- i. the paths only a GPU runs, each against its CPU reference (issue 55) -------------------------------------


def compared(cases: list[dict[str, Any]], seconds: float, **more: Any) -> dict[str, Any]:
    """A section's record from its cases (each: name, max_err, tolerance, and `planted_err` where a planted fault
    was measured too, which must exceed the tolerance): pass when every case is within its tolerance and every
    planted fault outside it; max_err and tolerance of the case nearest its tolerance; seconds of the section."""
    for c in cases:
        c["ok"] = c["max_err"] <= c["tolerance"] and c.get("planted_err", math.inf) > c["tolerance"]
    worst = max(cases, key=lambda c: c["max_err"] / c["tolerance"])
    ok = all(c["ok"] for c in cases)
    return dict(status="pass" if ok else "fail", ok=ok, max_err=worst["max_err"], tolerance=worst["tolerance"],
                seconds=seconds, cases=cases, **more)


def skipped(reason: str) -> dict[str, Any]:
    """A section that cannot run here: why it did not (never a pass)."""
    return dict(status="skipped", ok=None, reason=reason)


def doc_bounds(lengths: list[int]) -> list[tuple[int, int]]:
    """Consecutive [start, end) of documents of `lengths` tokens tiling 0 .. sum(lengths)."""
    ends = np.cumsum(lengths).tolist()
    return list(zip([0] + ends[:-1], ends))


def section_linear_conv(device: torch.device, quick: bool) -> dict[str, Any]:
    """The padded causal convolution of a hybrid target's linear-attention layers (`linear_attention.
    padded_causal_conv`: what CUDA runs, one conv1d over the documents each preceded by W-1 zeros) on `device`
    against transformers' convolution run on each document alone (the per-document torch rule the CPU runs,
    `varlen_causal_conv`'s fallback) in fp64 on the CPU from the same inputs, in fp32 (TF32 off) and bf16:
    within rounding_tol(dtype, W + 1 terms: the taps and the bias; depth 2: the convolution's output and silu's).
    Planted: the same convolution over the row as one document (the state of one document leaking into the next)
    must fall outside. Qwen3-Next's shapes (8192 channels: 2 x 16 key heads and 32 value heads of 128; W 4) over
    4096 tokens, documents of 1 and 2 tokens (< W - 1) and long ones; --quick: 64 channels, 66 tokens. On the CPU
    the same function runs (the rule is checked there, not the CUDA kernel)."""
    from dflash_lib.models.linear_attention import padded_causal_conv, varlen_causal_conv

    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next
    except ImportError as e:
        return skipped(f"this transformers has no Qwen3-Next, whose per-document rule is the reference: {e}")
    t0 = time.perf_counter()
    torch.backends.cudnn.allow_tf32 = False
    D, W = (64, 4) if quick else (8192, 4)  # channels, taps
    lengths = [1, 7, 2, 13, 3, 40] if quick else [1, 2, 3, 700, 64, 1500, 5, 1784, 37]
    documents = doc_bounds(lengths)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, D, sum(lengths), generator=g)  # (1, D, N)
    weight, bias = torch.randn(D, W, generator=g) / math.sqrt(W), torch.randn(D, generator=g)
    fallback = getattr(qwen3_next.causal_conv1d_fn, "dflash_original", qwen3_next.causal_conv1d_fn)
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        xs, ws, bs = (t.to(dtype) for t in (x, weight, bias))  # the inputs both sides start from
        ref = varlen_causal_conv(xs.double(), ws.double(), bs.double(), "silu", documents, fallback)  # the CPU's
        got = padded_causal_conv(xs.to(device), ws.to(device), bs.to(device), "silu", documents)
        leak = padded_causal_conv(xs.to(device), ws.to(device), bs.to(device), "silu", [(0, x.shape[-1])])
        sync(device)
        cases.append(dict(dtype=str(dtype).replace("torch.", ""), max_err=rel_err(got, ref),
                          tolerance=rounding_tol(dtype, W + 1, 2), planted_err=rel_err(leak, ref)))
    return compared(cases, time.perf_counter() - t0, channels=D, taps=W, documents=len(lengths),
                    tokens=int(sum(lengths)), reference="transformers' causal_conv1d_fn per document, fp64, CPU",
                    planted="one convolution over the whole row (documents leak into the next)")


def section_linear_rule(device: torch.device, quick: bool) -> dict[str, Any]:
    """flash-linear-attention's chunked gated delta rule over every document at once (`linear_attention.fla_rule`,
    varlen cu_seqlens: what a hybrid target's linear-attention layers run on CUDA, in bf16) against transformers'
    chunked torch rule run on each document alone (`varlen_rule`'s fallback: what the CPU runs) in fp32 on the CPU
    from the same bf16 inputs (q, k, v, beta in bf16, the log decay g in fp32, as the layer passes them): within
    rounding_tol(bf16, CHUNK terms: a chunk's sums). Planted: the kernel over the row as one document (each
    document's state carried into the next) must fall outside. Qwen3-Next's heads (16 key heads serving 32 value
    heads, 128 wide) over 4096 tokens of documents of 1 to 2000 tokens (one chunk of 64 exactly, one token either
    side of it); --quick: smaller. Needs CUDA and flash-linear-attention."""
    from dflash_lib.models import linear_attention as la

    if device.type != "cuda":
        return skipped("flash-linear-attention's kernels are Triton kernels for CUDA (a CPU runs transformers' "
                       "torch rule per document; tests/test_linear_attention.py holds fla_rule's input "
                       "preparation against it through a stand-in kernel)")
    if not la.HAS_FLA:
        return skipped("flash-linear-attention is not installed (pip install flash-linear-attention; a hybrid "
                       "target refuses to run on CUDA without it)")
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next
    except ImportError as e:
        return skipped(f"this transformers has no Qwen3-Next, whose per-document rule is the reference: {e}")
    t0 = time.perf_counter()
    Hk, Hv, K, V = (4, 8, 32, 32) if quick else (16, 32, 128, 128)  # key heads, value heads, their widths
    lengths = [1, 63, 64, 65, 130, 9] if quick else [1, 63, 64, 65, 2000, 7, 1200, 696]
    documents = doc_bounds(lengths)
    N = int(sum(lengths))
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, N, Hk, K, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(1, N, Hv, V, generator=gen).bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(1, N, Hv, generator=gen) + 3)  # log decay (~0.95 a token)
    beta = torch.sigmoid(torch.randn(1, N, Hv, generator=gen)).bfloat16()
    fallback = getattr(qwen3_next.torch_chunk_gated_delta_rule, "dflash_original",
                       qwen3_next.torch_chunk_gated_delta_rule)
    ref = la.varlen_rule(q.float(), k.float(), v.float(), g, beta.float(), documents, None, fallback,
                         use_qk_l2norm_in_kernel=True)  # (1, N, Hv, V), the CPU's rule in fp32
    dev = [t.to(device) for t in (q, k, v, g, beta)]
    cu = torch.tensor([0] + [e for _, e in documents], dtype=torch.int32, device=device)
    got = la.fla_rule(*dev, cu)
    leak = la.fla_rule(*dev, torch.tensor([0, N], dtype=torch.int32, device=device))
    sync(device)
    case = dict(dtype="bfloat16", max_err=rel_err(got, ref), tolerance=rounding_tol(torch.bfloat16, la.CHUNK),
                planted_err=rel_err(leak, ref))
    return compared([case], time.perf_counter() - t0, heads=dict(key=Hk, value=Hv, key_dim=K, value_dim=V),
                    tokens=N, documents=len(lengths),
                    reference="transformers' torch_chunk_gated_delta_rule per document, fp32, CPU",
                    planted="the kernel over the row as one document (states carried across documents)")


SLIDING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5)  # shorter than the documents


def sliding_step(device: torch.device, precision: str, backend: str, batch, grad: bool, **drafter: Any
                 ) -> dict[str, Any]:
    """`small_models`' drafter with SLIDING layers (or `drafter` instead) on `device`: its final states, loss and
    (with `grad`) every parameter gradient on one batch, anchors seeded; on the host in fp32."""
    target, model = small_models(device, torch.float32 if precision == "fp32" else torch.bfloat16, backend,
                                 **(drafter or SLIDING))
    layout = model.layout(batch, model.sample_anchors(batch, torch.Generator().manual_seed(4)))
    dev_batch, dev_layout = batch.to(device), layout.to(device)
    feats = target.context_features(dev_batch, target.segments(batch.doc_ids))
    with torch.set_grad_enabled(grad), torch.autocast(device.type, dtype=torch.bfloat16,
                                                      enabled=precision == "bf16"):
        hidden = model.forward_hidden(dev_batch, feats, dev_layout)
        loss = model.loss(dev_batch, feats, dev_layout).loss
    if grad:
        loss.backward()
    return dict(loss=loss.detach().float().cpu(), hidden=hidden.detach().float().cpu(),
                grads={n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None})


def section_sliding_flex(device: torch.device, quick: bool) -> dict[str, Any]:
    """Sliding-window drafter layers (SLIDING: a window of 5 positions in the first layer) through the flex backend
    (`attention.flex_attend` with a window: the compiled FlexAttention kernel on CUDA) on `device` against the
    dense backend (SDPA under `dense_mask` & `window_mask`) in fp32 on the CPU: final states, loss and, on CUDA,
    every gradient, in fp32 (TF32 off) and under bf16 autocast with a bf16 target, within TOL. Planted: the same
    drafter with every layer full (the window ignored) must fall outside. On the CPU: fp32, forward only
    (FlexAttention has no CPU backward)."""
    t0 = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    cuda = device.type == "cuda"
    rng = np.random.default_rng(9)
    docs = [(rng.integers(0, 511, n), np.arange(n) >= s) for n, s in ((37, 3), (12, 2), (61, 5), (4, 1))]
    batch = collate_packed(docs, 0, 128)
    ref = sliding_step(torch.device("cpu"), "fp32", "dense", batch, cuda)
    full = sliding_step(torch.device("cpu"), "fp32", "dense", batch, False, layer_types=[], sliding_window=0)
    planted = rel_err(full["hidden"], ref["hidden"])
    cases = []
    for precision in ("fp32", "bf16") if cuda else ("fp32",):
        got = sliding_step(device, precision, "flex", batch, cuda)
        errs = dict(hidden=rel_err(got["hidden"], ref["hidden"]), loss=rel_err(got["loss"], ref["loss"]))
        if cuda:
            errs["grads"] = max(rel_err(got["grads"][n], ref["grads"][n]) for n in ref["grads"])
        cases.append(dict(precision=precision, max_err=max(errs.values()), tolerance=TOL[precision],
                          planted_err=planted, **{f"rel_err_{k}": e for k, e in errs.items()}))
    out = compared(cases, time.perf_counter() - t0, window=SLIDING["sliding_window"],
                   reference="the dense backend in fp32 on the CPU",
                   planted="every layer full (the window ignored), final states")
    if not cuda:
        out["not_run"] = "gradients and bf16: FlexAttention has no CPU backward; the CUDA check runs both"
    return out


def engine_target(root: Path) -> tuple[TargetModel, list[int]]:
    """A random 4-layer Qwen3 (hidden 128, heads of 32; every matrix from N(0, 0.1) and every other weight from
    N(0, 0.5), so that no layer is near the identity and each feature layer differs) saved in root/target, in fp32
    on the CPU; and its feature layers."""
    from dflash_lib.models import tiny_qwen3_config

    layer_ids = [0, 2]
    target = TargetModel.from_hf_config(tiny_qwen3_config(hidden_size=128, num_layers=4, num_heads=4,
                                                          num_kv_heads=2, vocab_size=512), 2, layer_ids)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(1)
        for p in target.model.parameters():
            p.normal_(0.0, 0.1 if p.dim() > 1 else 0.5)
    target.model.save_pretrained(root / "target")
    return target, layer_ids


ENGINE_START_S = 180.0  # seconds the connector section lets vLLM take to start on a GPU (eager, a tiny target)
ENGINE_GPU_SHARE = 0.2  # vLLM's --gpu-memory-utilization: the share of the GPU it wants free at its start (this
# process keeps the earlier sections' models; the engine's KV cache is EngineSpec.kv_cache_gib)
TARGET_LAYER_ROUNDINGS = 13  # bf16 roundings of a target layer (see BF16_ROUNDINGS)


def section_connector(device: torch.device, left_s: float) -> dict[str, Any]:
    """Our connector writing the hidden states of a CUDA vLLM engine (`serve.engine_plugins`: vLLM's
    `extract_hidden_states` on `engine_target`, in bf16) against the local target's features in fp32 on the CPU:
    documents of 1 to 300 tokens, within walk_tol(bf16, 13 roundings a layer x the layers up to the deepest
    feature layer). Planted: the engine's rows one token late within each document must fall outside. Needs CUDA
    and an engine Python (`serve.engine_python`) whose vLLM runs on CUDA, and `left_s` seconds of the check's
    budget for the engine's start; skipped with the reason otherwise. (The CPU build's features are held against
    the local target's by tests/test_served_target.py.)"""
    import subprocess
    import tempfile

    from dflash_lib.config import ConfigError

    if device.type != "cuda":
        return skipped("needs vLLM on CUDA (the CPU build's features are held against the local target's by "
                       "tests/test_served_target.py, make test)")
    try:
        from dflash_lib.serve.adapter import EngineSpec
        from dflash_lib.serve.hidden_states import EngineFiles, HiddenStatesClient, engine_layer_ids, engine_pick
        from dflash_lib.serve.server import EngineServer, engine_python, private_folder

        python = engine_python()
    except (ImportError, ConfigError) as e:  # the serving client's wheels (httpx), or no engine Python
        return skipped(f"no engine: {type(e).__name__}: {e}")
    probe = subprocess.run([str(python), "-c", "import importlib.util, torch; print(torch.cuda.is_available() and "
                            "importlib.util.find_spec('vllm') is not None)"], capture_output=True, text=True,
                           timeout=120)
    if probe.stdout.strip() != "True":
        return skipped(f"the engine Python {python} has no vLLM on CUDA (its torch sees no GPU, or vLLM is not "
                       f"installed): {' '.join((probe.stdout + probe.stderr).split())[-300:]}")
    if left_s < ENGINE_START_S + 30:
        return skipped(f"{left_s:.0f} s left of the check's budget, the engine may take {ENGINE_START_S:.0f} s to "
                       "start")
    t0 = time.perf_counter()
    rng = np.random.default_rng(10)
    docs = [(rng.integers(0, 511, n), np.ones(n, bool)) for n in (1, 37, 300, 64, 5)]
    with tempfile.TemporaryDirectory(prefix="dflash-gpu-check-") as tmp:
        root = Path(tmp)
        target, layer_ids = engine_target(root)
        want = target.context_features(collate_padded(docs, 0))  # (C, F*H) fp32, CPU
        folder = private_folder(root / "hidden_states")
        aux = engine_layer_ids(layer_ids)
        spec = EngineSpec(str(root / "target"), dtype="bfloat16", max_model_len=512, max_num_seqs=4,
                          kv_cache_gib=1.0, hidden_states=tuple(aux), hidden_states_dir=str(folder),
                          extra=("--gpu-memory-utilization", str(ENGINE_GPU_SHARE)))
        torch.cuda.empty_cache()  # the earlier sections' cached blocks, for the engine's start
        with EngineServer(spec, root / "engine.log", str(python), ENGINE_START_S) as server:
            files = EngineFiles.of(folder, "gpu-check", root / "target", aux, "bfloat16")
            client = HiddenStatesClient(server.url, files, 128, concurrency=2)
            try:
                states = client.fetch([t.tolist() for t, _ in docs])  # (len, layers, H) each, bf16
            finally:
                client.close()
    pick = engine_pick(layer_ids)
    got = torch.cat([s[:, pick].reshape(s.shape[0], -1) for s in states])  # (C, F*H)
    late = torch.cat([torch.cat([s[:1], s[:-1]])[:, pick].reshape(s.shape[0], -1) for s in states])
    case = dict(dtype="bfloat16", max_err=rel_err(got, want), planted_err=rel_err(late, want),
                tolerance=walk_tol(torch.bfloat16, TARGET_LAYER_ROUNDINGS * (max(layer_ids) + 1)))
    return compared([case], time.perf_counter() - t0, documents=len(docs), tokens=int(want.shape[0]),
                    layers=layer_ids, reference="TargetModel.context_features, fp32, CPU",
                    planted="the engine's rows one token late within each document")


# -- e. FSDP2 with the trainer's mixed precision ---------------------------------------------------------------


def section_fsdp(device: torch.device) -> dict[str, Any]:
    import copy

    import torch.distributed as dist

    from dflash_lib.train import distributed as D
    from dflash_lib.train.feed import Item

    cuda = device.type == "cuda"
    target, drafter = small_models(device, torch.bfloat16 if cuda else torch.float32, "blocks")
    twin = copy.deepcopy(drafter)  # the same initial weights, for the FSDP2 wrapper
    object.__setattr__(twin, "target", target)  # one target, shared (the trainer's replica)
    rng = np.random.default_rng(1)
    items = []
    for m in range(2):
        docs = [(rng.integers(0, 511, n), np.arange(n) >= 4) for n in (90, 57, 120)]
        batch = collate_padded(docs, 0)
        layout = drafter.layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(m)))
        dev = batch.to(device)
        with torch.no_grad():
            feats = target.context_features(dev, target.segments(batch.doc_ids))  # (C, F*H), as the trainer
        items.append(Item(0, batch, dev, feats, layout=layout, device_layout=layout.to(device)))
    one_rank_group(device)
    try:
        losses: dict[str, list[float]] = {}
        for kind, model in (("single", drafter), ("fsdp", twin)):
            parallel = D.DrafterParallel(model, kind, 1, device)
            params = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=1e-3, fused=cuda)
            guard = BadStepGuard(3)
            losses[kind] = [train_step(parallel, items, params, opt, 1e-3, 1.0, cuda, guard, k + 1).loss
                            for k in range(3)]
            if kind == "fsdp":
                dtensors = sum(type(p).__name__ == "DTensor" for p in params)
                full = parallel.full_weights()
                plain = all(type(t) is torch.Tensor for t in full.values())
                names = sorted(full) == sorted(n for n, p in drafter.named_parameters() if p.requires_grad)
    finally:
        dist.destroy_process_group()
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses["fsdp"], losses["single"]))
    tol = 3e-2 if cuda else 1e-5
    return dict(ok=rel <= tol and dtensors == len(params) and plain and names, losses_single=losses["single"],
                losses_fsdp=losses["fsdp"], max_rel_diff=rel, tolerance=tol, sharded_params=dtensors,
                full_weights_plain=plain, full_weights_names_match=names,
                precision="bf16 params / fp32 reduce" if cuda else "fp32")


# -- b, c, d: the 0.6B-shaped run -------------------------------------------------------------------------------


class Run:
    """The models, batches and step of the train / pipeline / drafting sections (built once, shared)."""

    def __init__(self, device: torch.device, quick: bool):
        self.device, self.quick = device, quick
        self.hf, self.mc, self.rs = qwen3_shape(quick)
        cuda = device.type == "cuda"
        self.autocast = cuda  # bf16 autocast on CUDA (on CPU: fp32, the tiny check is about running at all)
        self.attention = "flex" if cuda else "blocks"
        self.target_dtype = torch.bfloat16 if cuda else torch.float32
        docs = synth_docs(4000 if not quick else 200, self.hf.vocab_size, self.rs["median_len"], self.rs["max_len"], 1)
        self.store = docs
        rows = pack([len(t) for t, _ in docs], self.rs["row_len"])
        need = self.rs["warmup"] + self.rs["steps"] + 2 * self.rs["seq_steps"] + 2
        if len(rows) < need:
            raise RuntimeError(f"synthesized {len(rows)} packed rows, need {need}")
        self.rows = rows[:need]
        self.mode = dict(row_len=self.rs["row_len"], doc_len="lognormal(median %d, sigma 0.8) clipped to [%d, %d]"
                         % (self.rs["median_len"], min(64, self.rs["median_len"] // 4), self.rs["max_len"]),
                         user_share="U(0.1, 0.5)", attention=self.attention, autocast_bf16=self.autocast,
                         target_dtype=str(self.target_dtype).replace("torch.", ""), checkpointing=True,
                         drafter_layers=self.mc.drafter_layers, block_size=self.mc.block_size,
                         num_anchors=self.mc.num_anchors, num_features=self.mc.num_features)
        self.models_built = False

    def config(self) -> Config:
        return Config(model=self.mc)

    def build(self) -> None:
        t0 = time.perf_counter()
        self.target = TargetModel.from_hf_config(self.hf, self.mc.num_features, None, self.device, self.target_dtype)
        self.mc.target_layer_ids = list(self.target.layer_ids)
        torch.manual_seed(0)
        self.drafter = DFlashDrafter(DrafterConfig.from_model_config(self.mc, self.target), self.target,
                                     attention=self.attention, checkpointing=True)
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, fused=self.device.type == "cuda")
        self.collate = make_collate(self.store, True, 0, self.rs["row_len"], vocab_size=self.hf.vocab_size,
                                    prepare=make_prepare(self.drafter, 0, lambda index: 1.0))
        self.guard = BadStepGuard(1000)
        self.step_no = 0
        self.models_built = True
        self.build_s = time.perf_counter() - t0

    def works(self, first: int, n: int) -> list[Work]:
        return [Work(0, s, 0, True, self.rows[s], s) for s in range(first, first + n)]

    def step(self, item) -> Any:
        self.step_no += 1
        return train_step(self.drafter, [item], self.params, self.opt, 1e-4, 1.0, self.autocast, self.guard,
                          self.step_no)

    def run_pipeline(self, works: list[Work], on_item: Callable[[Any], None] | None = None) -> tuple[float, int, list]:
        """(seconds, real tokens, step results) of `works` through the library's Pipeline (worker thread)."""
        workers = make_target_workers([self.target], 1, self.device)
        results, tokens = [], 0
        sync(self.device)
        t0 = time.perf_counter()
        with Pipeline(iter(works), self.collate, workers, PipelineConfig(), pin_memory=self.device.type == "cuda") as p:
            for item in p:
                if on_item is not None:
                    on_item(item)
                res = self.step(item)
                results.append(res)
                tokens += res.real_tokens
        sync(self.device)
        return time.perf_counter() - t0, tokens, results

    def run_sequential(self, works: list[Work]) -> tuple[float, int, list]:
        """The same work in one thread on the default stream: collate -> pin -> target -> step."""
        (worker,) = make_target_workers([self.target], 1, self.device, streams=False)
        results, tokens = [], 0
        sync(self.device)
        t0 = time.perf_counter()
        for w in works:
            c = self.collate(w)
            if self.device.type == "cuda":
                c = c.pin_memory()
            res = self.step(worker(c))
            results.append(res)
            tokens += res.real_tokens
        sync(self.device)
        return time.perf_counter() - t0, tokens, results


def dry_prediction(run: Run, batch) -> dict[str, Any]:
    """The dry run's peak for `batch` at the run's shapes, in fake mode on the CPU (before any GPU step)."""
    try:
        from dflash_lib import dryrun
    except Exception as e:  # noqa: BLE001 (reported, not fatal)
        return {"available": False, "reason": f"import dflash_lib.dryrun: {type(e).__name__}: {e}"}
    if not all(hasattr(dryrun, n) for n in ("StepSettings", "build_step_models", "measure_step")):
        return {"available": False, "reason": "dflash_lib.dryrun lacks StepSettings/build_step_models/measure_step"}
    t0 = time.perf_counter()
    settings = dryrun.StepSettings(attention="flex", checkpointing=True, target_dtype=torch.bfloat16, autocast=True)
    cfg = run.config()
    models = dryrun.build_step_models(cfg, run.hf, settings, fake=True)
    fig = dryrun.measure_step(models, batch, seed=0)
    out = dict(available=True, peak_gib=fig.peak_bytes / GIB, kernel_allowance_gib=fig.kernel_allowance / GIB,
               memory_gib={k: v / GIB for k, v in fig.memory.items()}, flops=fig.flops, seconds=time.perf_counter() - t0)
    reserve = getattr(dryrun, "Reserve", None)
    if reserve is not None:
        out["required_gib"] = reserve().required_bytes(fig.peak_bytes, fig.kernel_allowance) / GIB
    return out


def count_flops(run: Run, work: Work) -> tuple[int, int, str]:
    """(FLOPs, real tokens) of one full training step on `work`, counted by FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    from dflash_lib.models.attention import sdpa_flop_mapping

    (worker,) = make_target_workers([run.target], 1, run.device, streams=False)
    item = worker(run.collate(work))
    counter = FlopCounterMode(display=False, custom_mapping=sdpa_flop_mapping())
    with counter:
        res = run.step(item)
    return int(counter.get_total_flops()), res.real_tokens, "FlopCounterMode over one step (target forward, " \
        "drafter forward + checkpoint recompute + backward, LM head + CE; optimizer not counted)"


def section_train(run: Run) -> dict[str, Any]:
    dev = run.device
    out: dict[str, Any] = {"settings": run.mode, "shape": {k: getattr(run.hf, k) for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "vocab_size")}}
    # the costliest row by drafter queries, its anchors drawn as the feed stage draws them (seed 0 here)
    run_rows = run.rows[run.rs["warmup"]:run.rs["warmup"] + run.rs["steps"]]
    worst = max(range(len(run_rows)), key=lambda i: sum(min(run.mc.num_anchors, len(run.store[j][0]))
                                                          for j in run_rows[i]))
    worst_batch = collate_packed([run.store[j] for j in run_rows[worst]], 0, run.rs["row_len"], run_rows[worst])
    try:
        out["dryrun"] = dry_prediction(run, worst_batch)  # on the CPU, in fake mode, before any GPU step
    except Exception as e:  # noqa: BLE001
        out["dryrun"] = {"available": False, "reason": f"{type(e).__name__}: {e}"}
    run.build()
    out["build_s"] = run.build_s
    if dev.type == "cuda":
        out["params_gib"] = torch.cuda.memory_allocated(dev) / GIB
    t_warm, _, _ = run.run_pipeline(run.works(0, run.rs["warmup"]))
    out["warmup_steps"], out["warmup_s"] = run.rs["warmup"], t_warm
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    seconds, tokens, results = run.run_pipeline(run.works(run.rs["warmup"], run.rs["steps"]))
    out.update(steps=len(results), seconds=seconds, real_tokens=tokens, ktok_s=tokens / seconds / 1e3,
               step_s=seconds / len(results), loss_first=results[0].loss, loss_last=results[-1].loss,
               skipped_steps=sum(r.skipped for r in results), drafter_queries_mean=float(np.mean(
                   [r.blocks * run.mc.block_size for r in results])))
    if dev.type == "cuda":
        out["peak_gib_run"] = torch.cuda.max_memory_allocated(dev) / GIB
        out["peak_note"] = ("peak_gib_run includes the pipeline's read-ahead (items in q_hs hold their features); "
                            "peak_gib_worst_step is one step on the costliest batch alone, the dry run's case")
        torch.cuda.reset_peak_memory_stats(dev)
        item = make_target_workers([run.target], 1, dev, streams=False)[0](
            run.collate(Work(0, 0, 0, True, run_rows[worst], 0)))
        run.step(item)
        del item
        sync(dev)
        out["peak_gib_worst_step"] = torch.cuda.max_memory_allocated(dev) / GIB
        if out["dryrun"].get("available"):
            out["peak_over_dryrun"] = out["peak_gib_worst_step"] / out["dryrun"]["peak_gib"]
    try:
        flops, ftok, source = count_flops(run, run.works(len(run.rows) - 1, 1)[0])
        out["flops_per_real_token"] = flops / ftok
        out["flops_source"] = source
        if dev.type == "cuda":
            out["mfu"] = out["flops_per_real_token"] * tokens / seconds / (H200_BF16_TFLOPS * 1e12)
            out["mfu_peak_tflops"] = H200_BF16_TFLOPS
        else:
            out["mfu"], out["mfu_reason"] = None, "no MFU on CPU (the peak is the H200's)"
    except Exception as e:  # noqa: BLE001 (e.g. the compiled flex kernel under FlopCounterMode): the dry run's count
        out["flops_error"] = f"{type(e).__name__}: {e}"
        if out["dryrun"].get("available") and dev.type == "cuda":
            out["flops_per_real_token"] = sum(out["dryrun"]["flops"].values()) / worst_batch.real_tokens
            out["flops_source"] = "the dry run's FlopCounterMode count for the costliest batch (an upper bound)"
            out["mfu"] = out["flops_per_real_token"] * tokens / seconds / (H200_BF16_TFLOPS * 1e12)
    out["ok"] = out["skipped_steps"] == 0 and all(math.isfinite(r.loss) for r in results)
    return out


def section_pipeline(run: Run) -> dict[str, Any]:
    if not run.models_built:
        raise RuntimeError("the train section did not build the models")
    n, first = run.rs["seq_steps"], run.rs["warmup"] + run.rs["steps"]
    works_a, works_b = run.works(first, n), run.works(first + n, n)
    overlap = {"ready_events": 0}

    def seen(item):
        overlap["ready_events"] += item.ready is not None

    t_seq, tok_seq, _ = run.run_sequential(works_a)
    t_pipe, tok_pipe, _ = run.run_pipeline(works_b, seen)
    seq, pipe = tok_seq / t_seq / 1e3, tok_pipe / t_pipe / 1e3
    return dict(steps_each=n, sequential_ktok_s=seq, pipeline_ktok_s=pipe, ratio=pipe / seq,
                items_with_ready_event=overlap["ready_events"], ok=True,
                note="different rows of the same synthesized corpus for each (similar length mix); ratio > 1 = "
                     "the target of the next batch overlapped the drafter step")


# Two greedy decodings by other kernels may differ where the target's top logits lie within 4 eps * max|logit|:
# each logit moves by <= ~2 eps * max|logit| between two paths (one flipped rounding of the LM head's output plus
# about as much from the layers before it), so seen from a third (the full forward) the two choices lie within 4.
TIE_ULPS = 4.0


def tie_gaps(target: TargetModel, prompts: list[list[int]], got: list[list[int]],
             want: list[list[int]]) -> list[float | None]:
    """Per prompt: None when got == want; else, at their first difference i, how far the lower of got[i] and want[i]
    sits below the max of the target's logits after prompt + want[:i] (its full forward), in eps(logits' dtype) *
    max|logit| (inf when one output is a prefix of the other)."""
    gaps: list[float | None] = []
    for p, a, b in zip(prompts, got, want):
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None:
            gaps.append(None if len(a) == len(b) else math.inf)
            continue
        z = target.step(torch.tensor(p + b[:i])).logits[-1]  # (V,)
        unit = torch.finfo(z.dtype).eps * float(z.abs().max())
        gaps.append((float(z.max()) - min(float(z[a[i]]), float(z[b[i]]))) / unit)
    return gaps


def section_drafting(run: Run) -> dict[str, Any]:
    if not run.models_built:
        raise RuntimeError("the train section did not build the models")
    rng = np.random.default_rng(3)
    n_new = 12 if run.quick else 32
    prompts = [rng.integers(0, min(run.hf.vocab_size, 151643), int(L)).tolist() for L in (17, 40, 95)]
    run.drafter.eval()
    t0 = time.perf_counter()
    res = acceptance_length(run.target, run.drafter, prompts, n_new)
    seconds = time.perf_counter() - t0
    greedy = [run.target.greedy(p, n_new) for p in prompts]
    equal = [a == b for a, b in zip(res.outputs, greedy)]
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(res.outputs, greedy)]
    gaps = tie_gaps(run.target, prompts, res.outputs, greedy)
    run.drafter.train()
    return dict(prompts=len(prompts), new_tokens=n_new, tau=res.tau, cycles=res.cycles, histogram=res.histogram,
                equals_target_greedy=equal, first_difference=first_diff, tie_gap_ulps=gaps, tie_ulps=TIE_ULPS,
                seconds=seconds, ok=all(g is None or g <= TIE_ULPS for g in gaps),
                dtypes=dict(target=str(run.target_dtype).replace("torch.", ""),
                            drafter="fp32 weights, bf16 autocast" if run.device.type == "cuda" else "fp32"))


def guarded(name: str, fn: Callable[[], dict[str, Any]], summary: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    try:
        summary[name] = fn()
    except Exception as e:  # noqa: BLE001 (one section's failure is reported; the others still run)
        traceback.print_exc()
        summary[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    summary[name]["section_s"] = round(time.perf_counter() - t0, 2)
    print(f"[gpu_check] {name}: ok={summary[name].get('ok')} in {summary[name]['section_s']} s", file=sys.stderr,
          flush=True)


# bf16 roundings on the longest path of section_dflash2's 2-layer drafter: DFlash's (BF16_ROUNDINGS) plus, per layer
# and sublayer, the kernel projection and the two convolutions (3 x 2 x 2), plus the selector's projection and edges
DFLASH2_BF16_ROUNDINGS = BF16_ROUNDINGS + 3 * 2 * 2 + 2


def section_dflash2(device: torch.device, quick: bool) -> dict[str, Any]:
    """A DFlash2 drafter (models/dflash2.py: block convolutions and the candidate selector), its convolutions and
    codebooks random, trained as on the device (flex on CUDA, blocks elsewhere; fp32, TF32 off, and bf16 autocast
    over an fp32 drafter) against the same drafter on the CPU in fp64 with the dense backend: the final-normed block
    states, the loss (selector term included) and every gradient, within rounding_tol(fp32, H terms, depth 2 x
    layers x 3: attention, MLP and the two convolutions around each) or walk_tol(bf16, DFLASH2_BF16_ROUNDINGS)
    (the bf16 target's features too, as `section_kl` against its fp32 reference); the selector's gradients in fp32
    within that times the largest candidate logit (a softmax over logits each off by tol * |logit|), in bf16
    reported only (the top-k candidate set flips at near ties of bf16 logits, moving whole codebook rows); the
    greedy walk's tokens of every block
    compared (equal tokens reported, not required: a near tie may flip). Planted: the convolutions over half blocks
    (the taps cut at each block's middle) must fall outside."""
    from dflash_lib.models import tiny_qwen3_config
    from dflash_lib.models.dflash2 import DFlash2Config, DFlash2Drafter

    t0 = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    vocab, H, B = 512, 64, 8
    rng = np.random.default_rng(0)
    docs = [(rng.integers(0, vocab - 1, n), np.arange(n) >= s) for n, s in ((5, 1), (40, 3), (23, 10), (61, 2))]
    batch = collate_packed(docs, 0, 160)
    backend = "flex" if device.type == "cuda" else "blocks"

    def run(dev: torch.device, dtype: torch.dtype, attention: str, autocast: bool, conv_block: int = B):
        target = TargetModel.from_hf_config(tiny_qwen3_config(hidden_size=H, num_layers=4, vocab_size=vocab), 2,
                                            device=dev, dtype=dtype)
        cfg = DFlash2Config(hidden_size=H, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                            intermediate_size=128, vocab_size=vocab, target_layer_ids=target.layer_ids,
                            target_num_layers=target.num_layers, block_size=B, mask_id=vocab - 1, num_anchors=12,
                            ce_chunk_blocks=4, conv_group_size=16, selector_rank=32, selector_top_k=8)
        torch.manual_seed(0)
        drafter = DFlash2Drafter(cfg, target, attention=attention)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in drafter.named_parameters():  # away from the identity start: the parts under test act
                if "base_kernel" in name or "kernel_projection" in name or "codebook" in name:
                    p.add_(0.05 * torch.randn(p.shape, generator=g).to(p))
            for layer in drafter.layers:
                layer.attention_conv.block_size = layer.mlp_conv.block_size = conv_block
        drafter = drafter.to(dtype if dtype == torch.float64 else torch.float32)
        anchors = drafter.sample_anchors(batch, torch.Generator().manual_seed(7))
        layout = drafter.layout(batch, anchors).to(dev)
        dev_batch = batch.to(dev)
        feats = target.context_features(dev_batch, target.segments(batch.doc_ids))
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            hidden = drafter.forward_hidden(dev_batch, feats, layout)
            loss = drafter.loss(dev_batch, feats, layout).loss
        loss.backward()
        one = target.features(collate_padded([docs[1]], 0).to(dev))[0]  # (40, F*H): document 1 alone
        walks = [drafter.draft(one, a, int(docs[1][0][a])) for a in (3, 17, 30)]
        with torch.no_grad():
            _, unary = drafter.candidates(hidden.index_select(0, layout.scored).float(), 64)
        return dict(hidden=hidden.detach().float().cpu(), loss=loss.detach().float().cpu(), walks=walks,
                    zmax=float(unary.abs().max()),
                    grads={n: p.grad.detach().float().cpu() for n, p in drafter.named_parameters()
                           if p.grad is not None})

    ref = run(torch.device("cpu"), torch.float64, "dense", False)
    depth = 2 * 2 * 3
    cases = []
    for precision in ("fp32", "bf16"):
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        got = run(device, torch.float32 if precision == "fp32" else torch.bfloat16, backend, precision == "bf16")
        planted = run(device, torch.float32, backend, False, conv_block=B // 2) if precision == "fp32" else None
        selector = [n for n in ref["grads"] if n.startswith("candidate_selector.")]
        errs = dict(hidden=rel_err(got["hidden"], ref["hidden"]), loss=rel_err(got["loss"], ref["loss"]),
                    grads=max(rel_err(got["grads"][n], ref["grads"][n]) for n in ref["grads"] if n not in selector))
        tol = rounding_tol(dtype, H, depth) if precision == "fp32" else walk_tol(dtype, DFLASH2_BF16_ROUNDINGS)
        cases.append(dict(name=f"drafter {precision}", max_err=max(errs.values()), tolerance=tol,
                          **{f"rel_err_{k}": v for k, v in errs.items()},
                          walk_tokens_equal=sum(a == b for a, b in zip(got["walks"], ref["walks"])),
                          walks=len(ref["walks"]),
                          **({"planted_err": rel_err(planted["hidden"], ref["hidden"])} if planted else {})))
        selector_err = max(rel_err(got["grads"][n], ref["grads"][n]) for n in selector)
        if precision == "fp32":
            cases.append(dict(name="selector gradients fp32", tolerance=tol * max(1.0, ref["zmax"]),
                              max_err=selector_err, max_candidate_logit=ref["zmax"]))
        else:  # which k tokens are candidates flips at near ties of bf16 logits: a codebook row's whole gradient
            cases[-1]["selector_grads_rel_err"] = selector_err  # moves, so reported, not judged
    return compared(cases, time.perf_counter() - t0, backend=backend, reference="the same drafter, fp64, dense, CPU",
                    planted="convolutions over half blocks (taps cut at each block's middle)")


BUDGET_S = 540.0  # seconds the whole check may take (a lent GPU machine runs one command 10 minutes at most); the
# connector section skips rather than start the engine past it. Not yet timed on a GPU with the issue 55 sections.


@dataclass
class Check:
    """What every section is handed: the device, --quick, the check's deadline, and the Run that `train` builds
    for `pipeline` and `drafting`."""

    device: torch.device
    quick: bool
    deadline: float  # time.perf_counter() by which the check should end (BUDGET_S after its start)
    run: Run | None = None

    def left_s(self) -> float:
        return self.deadline - time.perf_counter()


def check_train(c: Check) -> dict[str, Any]:
    c.run = Run(c.device, c.quick)
    return section_train(c.run)


def check_pipeline(c: Check) -> dict[str, Any]:
    out = section_pipeline(c.run)  # on the CPU too: the code path works
    if c.device.type != "cuda":
        out["ratio_meaning"] = "CPU: both paths share the same cores; the ratio says nothing"
    return out


# The sections, in order: (name in the JSON, what runs it). Each is guarded: a failure is reported under its name
# and the others run; a section that cannot run here says why (status "skipped").
SECTIONS: list[tuple[str, Callable[[Check], dict[str, Any]]]] = [
    ("parity", lambda c: section_parity(c.device, c.quick)),
    ("train", check_train),
    ("pipeline", check_pipeline),
    ("drafting", lambda c: section_drafting(c.run)),
    ("fsdp", lambda c: section_fsdp(c.device)),
    ("kl", lambda c: section_kl(c.device)),
    ("sampling", lambda c: section_sampling(c.device, c.quick)),
    ("target_shard", lambda c: section_target_shard(c.device)),
    ("linear_conv", lambda c: section_linear_conv(c.device, c.quick)),
    ("linear_rule", lambda c: section_linear_rule(c.device, c.quick)),
    ("sliding_flex", lambda c: section_sliding_flex(c.device, c.quick)),
    ("connector", lambda c: section_connector(c.device, c.left_s())),
    ("dflash2", lambda c: section_dflash2(c.device, c.quick)),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 3 steps; runs on CPU too")
    ap.add_argument("--device", default="auto", help="auto (cuda when available) | cpu | cuda")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type != "cuda" and not args.quick:
        print(json.dumps({"ok": False, "error": "the full check needs CUDA; use --quick on CPU"}))
        return 2
    t0 = time.perf_counter()
    summary: dict[str, Any] = dict(
        quick=args.quick, device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
        or "cpu", torch=torch.__version__, python=platform.python_version())
    try:
        import transformers
        summary["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        pass
    torch.manual_seed(0)
    check = Check(device, args.quick, t0 + BUDGET_S)
    for name, fn in SECTIONS:
        guarded(name, lambda: fn(check), summary)
    summary["ok"] = all(summary[name].get("ok") is not False for name, _ in SECTIONS)
    summary["skipped"] = {name: summary[name]["reason"] for name, _ in SECTIONS
                          if summary[name].get("status") == "skipped"}
    summary["total_s"] = round(time.perf_counter() - t0, 1)
    summary["budget_s"], summary["within_budget"] = BUDGET_S, summary["total_s"] <= BUDGET_S
    print(json.dumps(summary, default=lambda o: o if not isinstance(o, torch.Tensor) else o.tolist()))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
