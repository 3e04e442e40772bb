"""Train SGLang's SpecForge 0.2.0 DFlash trainer on the shared peers job and export its drafter for vLLM.

    .venv-peers/specforge/bin/python benchmarks/peers/specforge/train.py --job JOB --work WORKDIR --export OUTDIR

Runs INSIDE specforge's own venv (install.sh); imports nothing of ours. Steps:
1. Data: specforge's documented OFFLINE format, written from the shared job's engine features (JOB/samples), one
   WORKDIR/data/{i:06d}.ckpt per sample (torch.save of a dict): input_ids int64 [T], loss_mask int64 [T],
   hidden_states float32 [T, k*H] = the job's [T, k, H] flattened, feature layers in job order. specforge's
   layer ids are 0-based decoder layers whose OUTPUT is the feature (its `extract_context_feature` reads
   hidden_states[id + 1]), the job's own convention: `dflash_config.target_layer_ids` = job.feature_layers
   unchanged, and the export's config carries the same ids (vLLM reads them as aux ids id + 1).
   No `last_hidden`: specforge's DFlash loss is CE on the data's tokens.
2. Train: `specforge train -c WORKDIR/run.json` run in this process (specforge.cli.main), every setting written
   into run.json and the draft config WORKDIR/draft_config.json (see `settings` in result.json).
3. Export: specforge's `export --to hf` (specforge.export.to_hf.export_to_hf) of the last checkpoint to OUTDIR.
4. WORKDIR/result.json (the peers contract); exit 1 with status "refused" when specforge fails.

CPU (device-only) settings, no code patch needed: SPECFORGE_DEVICE=cpu (its own device switch),
training.fsdp_sharding=NO_SHARD (its FSDP default refuses a machine without an accelerator; NO_SHARD wraps in DDP
over gloo), training.attention_backend=sdpa (its default flex_attention is compiled for an accelerator; the
mask is the same), data.dataloader_num_workers=0 (no prefetch processes on 2 cores).
Device-only patches: NONE (the settings above suffice). Two measurement-only wrappers, changing no value:
TrainerController.fit is timed (loop_seconds = the training loop alone, data loading included, model build,
checkpoint writing and export excluded) and DFlashTrainStrategy.forward_loss counts the tokens it is fed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

VERSION = "0.2.0"


def read_job(job_dir: Path) -> dict:
    doc = json.loads((job_dir / "job.json").read_text())
    if doc.get("format") != 1:
        raise ValueError(f"{job_dir}/job.json: format {doc.get('format')!r}, this script reads format 1")
    return doc


def write_offline_data(job_dir: Path, out: Path, max_len: int) -> dict:
    """JOB/samples/*.safetensors -> specforge .ckpt files; returns counts. A sample without two consecutive
    loss tokens is skipped (specforge refuses such a sample; it has no anchor in our trainer either)."""
    import torch
    from safetensors.torch import load_file

    out.mkdir(parents=True, exist_ok=True)
    files = sorted((job_dir / "samples").glob("*.safetensors"))
    written = skipped = tokens = loss_tokens = 0
    lengths = []
    for f in files:
        s = load_file(str(f))
        ids, mask, hs = s["input_ids"].long(), s["loss_mask"].long(), s["hidden_states"].float()
        T, k, H = hs.shape  # (T, k, H)
        ids, mask, hs = ids[:max_len], mask[:max_len], hs[:max_len]  # specforge truncates to data.max_length too
        if not bool((mask[:-1].bool() & mask[1:].bool()).any()):
            skipped += 1
            continue
        torch.save({"input_ids": ids.contiguous(), "loss_mask": mask.contiguous(),
                    "hidden_states": hs.reshape(len(ids), k * H).contiguous()},  # (T, k*H), job layer order
                   out / f"{f.stem}.ckpt")
        written += 1
        tokens += len(ids)
        loss_tokens += int(mask.sum())
        lengths.append(len(ids))
    if written == 0:
        raise ValueError(f"{job_dir}/samples: no sample with two consecutive loss tokens")
    return {"samples": written, "skipped": skipped, "tokens": tokens, "loss_tokens": loss_tokens,
            "mean_tokens": tokens / written}


def draft_config(job: dict, recipe: dict) -> dict:
    """specforge's DFlash draft config (a Qwen3 config plus block_size / num_target_layers / dflash_config), the
    drafter's sizes taken from the target as ours are. Layers and block size are written HERE, not through
    model.draft_num_hidden_layers: that override rewrites target_layer_ids with specforge's own default."""
    tc = json.loads((Path(job["target"]) / "config.json").read_text())
    rope = tc.get("rope_parameters") or {"rope_theta": tc.get("rope_theta", 10000.0), "rope_type": "default"}
    n = int(recipe["drafter_layers"])
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": tc["hidden_size"], "intermediate_size": tc["intermediate_size"],
        "num_hidden_layers": n, "num_attention_heads": tc["num_attention_heads"],
        "num_key_value_heads": tc["num_key_value_heads"],
        "head_dim": tc.get("head_dim", tc["hidden_size"] // tc["num_attention_heads"]),
        "hidden_act": tc.get("hidden_act", "silu"), "rms_norm_eps": tc["rms_norm_eps"],
        "rope_theta": rope["rope_theta"], "rope_parameters": rope,
        "vocab_size": job["vocab_size"], "max_position_embeddings": tc["max_position_embeddings"],
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "initializer_range": 0.02, "use_sliding_window": False, "sliding_window": None,
        "layer_types": ["full_attention"] * n,
        "block_size": int(recipe["block_size"]), "num_target_layers": int(job["num_hidden_layers"]),
        "dflash_config": {"mask_token_id": int(job["mask_id"]), "target_layer_ids": list(job["feature_layers"])},
    }


def plan(job: dict, recipe: dict, data: dict) -> tuple[dict, list[dict]]:
    """The optimizer-step plan: (batch/accumulation/steps/warm-up values, unmatched settings)."""
    unmatched = []
    n = data["samples"]
    # specforge counts a step in SAMPLES (batch_size x accumulation_steps); batch 1 (no padding) with its
    # token-weighted accumulation (gradients divided by the step's total loss weight) ~ tokens_per_step
    accum = max(1, round(recipe["tokens_per_step"] / data["mean_tokens"]))
    epochs = float(recipe["epochs"])
    num_epochs = max(1, math.ceil(epochs))  # an int in specforge; a fraction is cut by max_steps
    steps = int(n * epochs) // accum
    if steps < 1:
        raise ValueError(f"no optimizer step: {n} samples x {epochs} epochs < accumulation {accum}")
    # ours: W = ceil(warmup_ratio * steps); specforge: int(warmup_ratio * total_steps): pass W / steps
    warm = math.ceil(recipe["warmup_ratio"] * steps)
    warmup_ratio = min(1.0, (warm + 1e-6) / steps) if warm else 0.0
    unmatched.append({"setting": "tokens_per_step", "ours": recipe["tokens_per_step"],
                      "theirs": f"batch_size 1 x accumulation_steps {accum} samples "
                                f"(~{accum * data['mean_tokens']:.0f} tokens on average)",
                      "why": "specforge sizes a step in samples, not tokens; samples vary in length"})
    dropped = int(n * epochs) - steps * accum
    if dropped:
        unmatched.append({"setting": "epochs", "ours": epochs,
                          "theirs": f"num_epochs {num_epochs}, max_steps {steps} ({steps * accum} sample passes)",
                          "why": "specforge runs whole epochs and whole accumulation windows: max_steps stops at the "
                                 f"last full step, {dropped} sample passes of the last epoch are not trained"})
    if float(recipe.get("weight_decay", 0.0)) != 0.0:
        unmatched.append({"setting": "weight_decay", "ours": recipe["weight_decay"], "theirs": 0.0,
                          "why": "specforge's optimizer factory never passes weight decay (BF16Optimizer default 0)"})
    if float(recipe.get("min_lr_ratio", 0.0)) != 0.0:
        unmatched.append({"setting": "min_lr_ratio", "ours": recipe["min_lr_ratio"], "theirs": 0.0,
                          "why": "specforge's cosine always ends at eta_min 0 (not exposed)"})
    if list(recipe.get("betas", [0.9, 0.999])) != [0.9, 0.999] or float(recipe.get("eps", 1e-8)) != 1e-8:
        unmatched.append({"setting": "betas/eps", "ours": [recipe.get("betas"), recipe.get("eps")],
                          "theirs": [[0.9, 0.999], 1e-8], "why": "torch AdamW defaults, not exposed"})
    if recipe.get("schedule", "cosine") != "cosine" or recipe.get("optimizer", "adamw") != "adamw":
        unmatched.append({"setting": "schedule/optimizer", "ours": [recipe.get("schedule"), recipe.get("optimizer")],
                          "theirs": ["cosine", "adamw"], "why": "the only pair specforge's DFlash trainer has"})
    if data["skipped"]:
        unmatched.append({"setting": "samples", "ours": job["samples"], "theirs": data["samples"],
                          "why": f"{data['skipped']} samples without two consecutive loss tokens: specforge refuses them"})
    return {"batch_size": 1, "accumulation_steps": accum, "num_epochs": num_epochs, "max_steps": steps,
            "warmup_ratio": warmup_ratio, "warmup_steps": warm}, unmatched


def run_config(job: dict, recipe: dict, work: Path, p: dict) -> dict:
    return {
        "run_id": "specforge-run",
        "output_dir": str(work / "run"),
        "model": {
            "target_model_path": job["target"],
            "draft_model_config": str(work / "draft_config.json"),
            "torch_dtype": "float32",  # drafter, masters and target head/embedding in fp32
            "mask_token_id": int(job["mask_id"]),
            "load_target_embedding": True,
            "use_liger_kernel": False,
        },
        "data": {
            "hidden_states_path": str(work / "data"),
            "max_length": int(recipe["max_len"]),
            "dataloader_num_workers": 0,  # CPU: no prefetch processes
        },
        "training": {
            "strategy": "dflash",
            "loss_type": "dflash",  # CE on the data's tokens with the exponential position decay
            "loss_decay_gamma": float(recipe["gamma"]),  # w_k = exp(-(k-1)/gamma), k >= 1; anchor never scored
            "num_anchors": int(recipe["num_anchors"]),  # per ROW = per sample at batch_size 1
            "num_epochs": p["num_epochs"],
            "max_steps": p["max_steps"],
            "batch_size": p["batch_size"],
            "accumulation_steps": p["accumulation_steps"],
            "learning_rate": float(recipe["lr"]),
            "lr_scheduler": "cosine",
            "warmup_ratio": p["warmup_ratio"],
            "max_grad_norm": float(recipe["grad_clip"]),
            "optimizer_cpu_offload": False,
            "fsdp_sharding": "NO_SHARD",  # CPU: its FSDP default refuses a machine without an accelerator
            "attention_backend": "sdpa",  # CPU: flex_attention needs a compiler for an accelerator
            "objective_chunk_blocks": 128,  # memory only: blocks per LM-head slice
            "save_interval": 0,
            "eval_interval": 0,
            "log_interval": 1,
            "max_checkpoints": 0,
            "seed": int(recipe["seed"]),
        },
        "tracking": {"report_to": "none"},
    }


def train_and_export(job_dir: Path, work: Path, export: Path) -> dict:
    job = read_job(job_dir)
    recipe = job["recipe"]
    threads = int(recipe["threads"])
    os.environ["SPECFORGE_DEVICE"] = "cpu"
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    import torch

    torch.set_num_threads(threads)
    work.mkdir(parents=True, exist_ok=True)
    data = write_offline_data(job_dir, work / "data", int(recipe["max_len"]))
    p, unmatched = plan(job, recipe, data)
    dcfg = draft_config(job, recipe)
    (work / "draft_config.json").write_text(json.dumps(dcfg, indent=1))
    rcfg = run_config(job, recipe, work, p)
    (work / "run.json").write_text(json.dumps(rcfg, indent=1))

    import specforge.cli
    from specforge.training.controller import TrainerController
    from specforge.training.strategies.base import DFlashTrainStrategy

    timing = {"loop_seconds": 0.0, "loop_cpu_seconds": 0.0, "steps": 0, "tokens": 0, "loss_tokens": 0}
    fit, forward_loss = TrainerController.fit, DFlashTrainStrategy.forward_loss

    def timed_fit(self, data_iter):  # measurement only
        t, cpu = time.perf_counter(), time.process_time()
        try:
            step = fit(self, data_iter)
        finally:
            timing["loop_seconds"] += time.perf_counter() - t
            timing["loop_cpu_seconds"] += time.process_time() - cpu  # this process's CPU time (a loaded machine)
        timing["steps"] = int(step)
        return step

    def counted_forward_loss(self, batch, ctx=None):  # measurement only
        timing["tokens"] += int(batch.tensors["input_ids"].numel())
        timing["loss_tokens"] += int(batch.tensors["loss_mask"].sum())
        return forward_loss(self, batch, ctx)

    TrainerController.fit, DFlashTrainStrategy.forward_loss = timed_fit, counted_forward_loss
    if torch.get_num_threads() != threads:
        raise RuntimeError(f"torch threads {torch.get_num_threads()} != recipe {threads}")
    code = specforge.cli.main(["train", "-c", str(work / "run.json")])
    if code != 0:
        raise RuntimeError(f"specforge train exited {code}")
    ckpt = work / "run" / f"specforge-run-step{timing['steps']}"
    if not ckpt.is_dir():
        raise RuntimeError(f"no checkpoint {ckpt} after {timing['steps']} steps")

    from specforge.export.to_hf import export_to_hf

    export_to_hf(str(ckpt), str(work / "draft_config.json"), str(export))
    exported = json.loads((export / "config.json").read_text())
    if exported.get("dflash_config", {}).get("target_layer_ids") != list(job["feature_layers"]):
        raise RuntimeError(f"export's target_layer_ids {exported.get('dflash_config')} != job {job['feature_layers']}")

    return {
        "trainer": "specforge", "version": VERSION, "status": "ran", "reason": "",
        "train_tokens": timing["tokens"],  # tokens fed to its loss (specforge counts samples: see train_samples)
        "train_tokens_samples_x_epochs": int(job["tokens"] * float(recipe["epochs"])),
        "train_loss_tokens": timing["loss_tokens"],
        "train_samples": p["max_steps"] * p["accumulation_steps"] * p["batch_size"],
        "steps": timing["steps"],
        "loop_seconds": round(timing["loop_seconds"], 3),
        "loop_cpu_seconds": round(timing["loop_cpu_seconds"], 3),
        "tokens_per_s": round(timing["tokens"] / timing["loop_seconds"], 2) if timing["loop_seconds"] else 0.0,
        "threads": threads,
        "settings": {"run_config": rcfg, "draft_config": dcfg, "env": {"SPECFORGE_DEVICE": "cpu"},
                     "warmup_steps": p["warmup_steps"], "data": data,
                     "notes": ["warm-up: ours ceil(warmup_ratio * steps), specforge int(warmup_ratio * total_steps): "
                               f"matched by passing warmup_ratio = {p['warmup_steps']} / {p['max_steps']} steps",
                               "anchors: the same rule as ours (a with loss_mask[a] and loss_mask[a+1], up to "
                               "num_anchors per row = per sample at batch 1), other random draws (torch.rand after "
                               "accelerate's set_seed); samples shuffled by random.Random(seed + epoch)"],
                     "export": "specforge export --to hf (export_to_hf) of " + str(ckpt)},
        "unmatched": unmatched,
        "patches": [],
        "export": str(export),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", required=True, type=Path)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--export", required=True, type=Path)
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    try:
        result = train_and_export(a.job, a.work, a.export)
        code = 0
    except Exception as e:  # the peer failed: say so, never fake a result
        traceback.print_exc()
        reason = f"{type(e).__name__}: {e}".splitlines()[0][:500]
        result = {"trainer": "specforge", "version": VERSION, "status": "refused", "reason": reason,
                  "train_tokens": 0, "steps": 0, "loop_seconds": 0.0, "tokens_per_s": 0.0, "settings": {},
                  "unmatched": [], "patches": [], "export": str(a.export)}
        code = 1
    (a.work / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("status", "reason", "steps", "loop_seconds", "tokens_per_s")}))
    return code


if __name__ == "__main__":
    sys.exit(main())
