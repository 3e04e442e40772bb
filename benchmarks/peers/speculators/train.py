"""Train vLLM's speculators 0.9.0 DFlash trainer on the shared peers job and export its drafter for vLLM.

    .venv-peers/speculators/bin/python benchmarks/peers/speculators/train.py --job JOB --work WORKDIR --export OUTDIR

Runs INSIDE speculators' own venv (install.sh); imports nothing of ours. Steps:
1. Data: speculators' documented OFFLINE format ("file" hidden-states backend), written from the shared job's engine
   features (JOB/samples) into WORKDIR/data:
   - a `datasets` save_to_disk folder, torch format, columns input_ids int64 [T], loss_mask int64 [T], seq_len int;
   - hidden_states/hs_{i}.safetensors: token_ids int64 [T] and hidden_states float32 [T, k+1, H] = the job's k
     feature layers in job order, then the job's last_hidden (the last decoder layer's output before the final
     norm: speculators splits it off and recomputes the target's logits from it with the target's norm and head).
   speculators numbers a feature by vLLM's aux layer id (`--target-layer-ids`, written to the export's
   `aux_hidden_state_layer_ids`; vLLM serves it as dflash target_layer_ids = aux - 1): job feature layer i (decoder
   layer i's OUTPUT) -> i + 1. It refuses a run without a validation split (train_data_ratio must lie in (0, 1)),
   so one copy of sample 0 is appended as row N and the ratio set so that rows 0..N-1 (every job sample, once per
   epoch) train and only the copy validates.
2. Train: `speculators train` (speculators.train.cli.main) run in this process, every setting passed as a flag
   (WORKDIR/result.json "settings"), on ONE process with `recipe.threads` torch threads and no dataloader workers.
3. Export: its last checkpoint folder (config.json in its nested speculators format + model.safetensors, bf16 as
   it always saves) copied to OUTDIR; vLLM loads that format directly (`speculators_model_type: dflash`).
4. WORKDIR/result.json (the peers contract); exit 1 with status "refused" when speculators fails.

Patches applied at run time, only where torch has no accelerator (device selection only, none of its training
math; no file of speculators is edited):
- speculators.train.trainer.get_local_rank -> "cpu": the trainer moves the model and each batch to
  `get_local_rank()` (int 0, i.e. cuda:0);
- Trainer.device_type -> "cpu" after Trainer.__init__: it falls back to "cuda" for autocast when no accelerator;
- torch.accelerator.synchronize -> no-op: its step timer calls it, and it raises without an accelerator.
CPU flags (its own options, no patch): --loss-implementation eager (its fused loss needs Triton),
--draft-attn-impl sdpa (its flex attention compiles `create_block_mask` for an accelerator; the mask is the same).
Measurement-only wrappers (change no value): Trainer.__init__ keeps a handle on the trainer (for its step count and
sampler) and Trainer.train_epoch is timed: loop_seconds = the training epochs alone (data loading in the loop
included; model build, checkpoint writing, its per-epoch validation and export excluded), with the process's CPU
time in it (loop_cpu_seconds: on a shared machine, wall time over CPU time shows the contention).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

VERSION = "0.9.0"


def read_job(job_dir: Path) -> dict:
    doc = json.loads((job_dir / "job.json").read_text())
    if doc.get("format") != 1:
        raise ValueError(f"{job_dir}/job.json: format {doc.get('format')!r}, this script reads format 1")
    return doc


def write_offline_data(job_dir: Path, out: Path) -> dict:
    """JOB/samples/*.safetensors -> speculators' offline folder `out` (module doc, step 1); returns the counts and
    each training row's (length, loss mask) for the anchor budget."""
    import torch
    from datasets import Dataset
    from safetensors.torch import load_file, save_file

    files = sorted((job_dir / "samples").glob("*.safetensors"))
    if not files:
        raise ValueError(f"{job_dir}/samples: no samples")
    if out.exists():
        shutil.rmtree(out)
    (out / "hidden_states").mkdir(parents=True)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    masks = []
    for i, f in enumerate(files):
        s = load_file(str(f))
        ids, mask = s["input_ids"].long(), s["loss_mask"].long()  # (T,), (T,)
        hs = torch.cat([s["hidden_states"].float(), s["last_hidden"].float()[:, None]], dim=1)  # (T, k+1, H)
        save_file({"token_ids": ids.contiguous(), "hidden_states": hs.contiguous()},
                  str(out / "hidden_states" / f"hs_{i}.safetensors"))
        rows["input_ids"].append(ids.tolist())
        rows["loss_mask"].append(mask.tolist())
        rows["seq_len"].append(len(ids))
        masks.append(mask)
    n = len(files)
    # the validation row it insists on: a copy of sample 0 (never trained on: it lies past the train split)
    shutil.copyfile(out / "hidden_states" / "hs_0.safetensors", out / "hidden_states" / f"hs_{n}.safetensors")
    for key in rows:
        rows[key].append(rows[key][0])
    Dataset.from_dict(rows).with_format("torch").save_to_disk(str(out))
    return {"samples": n, "tokens": int(sum(rows["seq_len"][:n])), "loss_tokens": int(sum(int(m.sum()) for m in masks)),
            "masks": masks, "train_data_ratio": (n + 0.5) / (n + 1)}


def our_anchors(mask, per_sample: int) -> int:
    """Anchors the job's recipe gives one sample: min(num_anchors, #a with loss_mask[a] and loss_mask[a+1])."""
    m = mask.bool()
    return min(per_sample, int((m[:-1] & m[1:]).sum()))


def plan_steps_and_anchors(masks: list, recipe: dict, total_seq_len: int) -> dict:
    """speculators draws min(max_anchors, #loss tokens of the packed ROW outside its last block) anchors per row.
    Replays its own packing sampler (seed, epochs) to get each step's row, then picks the smallest max_anchors whose
    anchors over the run reach the recipe's per-sample anchors over the run (same average anchors per sample)."""
    import numpy as np
    import torch
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    lengths = [len(m) for m in masks]
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=total_seq_len, lengths=lengths, num_replicas=1,
                                                 rank=0, seed=int(recipe["seed"]))
    epochs = float(recipe["epochs"])
    num_epochs = max(1, math.ceil(epochs))
    per_epoch = []
    for e in range(num_epochs):
        per_epoch.append([list(b) for b in sampler._generate_batches(e)])  # noqa: SLF001 - read-only replay
    full = int(math.floor(epochs))
    total_steps = sum(len(b) for b in per_epoch[:full])
    if epochs > full:  # a fractional last epoch: its first part, as --max-steps cuts it
        total_steps += max(1, round((epochs - full) * len(per_epoch[full])))
    steps = [b for ep in per_epoch for b in ep][:total_steps]
    B = int(recipe["block_size"])
    row_valid, row_tokens = [], []
    for batch in steps:
        row = torch.zeros(total_seq_len, dtype=torch.bool)  # the padded row's loss mask
        docs = torch.cat([masks[i] for i in batch])[:total_seq_len].bool()
        row[: len(docs)] = docs
        row[-B:] = False  # its exclusion of the row's last block
        row_valid.append(int(row.sum()))
        row_tokens.append(min(total_seq_len, sum(lengths[i] for i in batch)))
    ours = sum(our_anchors(masks[i], int(recipe["num_anchors"])) for b in steps for i in b)
    valid = np.array(row_valid)
    best = int(valid.max()) if len(valid) else 1
    lo, hi = 1, max(1, best)
    while lo < hi:  # smallest M with sum(min(M, valid)) >= ours
        mid = (lo + hi) // 2
        if int(np.minimum(mid, valid).sum()) >= ours:
            hi = mid
        else:
            lo = mid + 1
    theirs = int(np.minimum(lo, valid).sum())
    return {"num_epochs": num_epochs, "total_steps": total_steps, "fractional": epochs != full,
            "max_anchors": lo, "anchors_ours": ours, "anchors_theirs": theirs,
            "samples_seen": sum(len(b) for b in steps), "packed_tokens": int(sum(row_tokens)),
            "steps_per_epoch": [len(b) for b in per_epoch]}


def apply_cpu_patches() -> list[str]:
    """The device-only patches (module doc); none where torch sees an accelerator."""
    import torch
    import speculators.train.trainer as T

    if torch.accelerator.is_available():
        return []
    T.get_local_rank = lambda: "cpu"
    init = T.Trainer.__init__

    def cpu_init(self, *a, **k):
        init(self, *a, **k)
        self.device_type = "cpu"

    T.Trainer.__init__ = cpu_init
    torch.accelerator.synchronize = lambda *a, **k: None
    return ["speculators.train.trainer.get_local_rank -> 'cpu' (model and batches were sent to cuda:0)",
            "Trainer.device_type -> 'cpu' after __init__ (its fallback is 'cuda' for autocast)",
            "torch.accelerator.synchronize -> no-op (its step timer calls it; it raises without an accelerator)"]


def instrument():
    """Measurement-only wrappers: the trainer handle and the training epochs' wall time."""
    import speculators.train.trainer as T

    box = {"trainer": None, "loop_seconds": 0.0, "loop_cpu_seconds": 0.0}
    init, train_epoch = T.Trainer.__init__, T.Trainer.train_epoch

    def keep(self, *a, **k):
        init(self, *a, **k)
        box["trainer"] = self

    def timed(self, *a, **k):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return train_epoch(self, *a, **k)
        finally:
            box["loop_seconds"] += time.perf_counter() - t0
            box["loop_cpu_seconds"] += time.process_time() - c0

    T.Trainer.__init__, T.Trainer.train_epoch = keep, timed
    return box


def build_argv(job: dict, data_dir: Path, save_dir: Path, log_dir: Path, plan: dict, ratio: float,
               cpu: bool) -> tuple[list[str], list[dict]]:
    """The `speculators train` flags, every one set from the recipe or stated; plus what could not be matched."""
    r = job["recipe"]
    L, B = int(r["drafter_layers"]), int(r["block_size"])
    aux = [int(i) + 1 for i in job["feature_layers"]]  # decoder layer i's output = vLLM aux layer id i + 1
    argv = [
        "--speculator-type", "dflash",
        "--verifier-name-or-path", job["target"],
        "--seed", str(int(r["seed"])),
        # drafter
        "--num-layers", str(L),
        "--draft-arch", "qwen3",
        "--draft-hidden-act", "silu",
        "--target-layer-ids", *map(str, aux),
        "--mask-token-id", str(int(job["mask_id"])),
        "--block-size", str(B),
        "--no-sample-from-anchor",  # the anchor is the verified token; positions 1..B-1 are drafted
        "--full-attention-indices", *map(str, range(L)),  # full attention, not its 2048 sliding window default
        "--sliding-window-non-causal",  # bidirectional in the block; its export writes causal = not this for vLLM
        "--no-embed-requires-grad",
        "--draft-attn-impl", "sdpa" if cpu else "simple_flex_attention",
        # data
        "--data-path", str(data_dir),
        "--hidden-states-backend", "file",
        "--on-missing", "raise",  # every sample is on disk; never ask a vLLM server
        "--total-seq-len", str(int(r["tokens_per_step"])),
        "--train-data-ratio", repr(ratio),
        "--hidden-states-dtype", "float32",
        "--num-workers", "0",
        "--max-anchors", str(plan["max_anchors"]),
        # loss
        "--loss-implementation", "eager" if cpu else "fused",
        "--loss-fn", "ce",
        "--per-position-loss-weight", "fixed-exp-decay",  # its dflash default is dpace
        "--dflash-decay-gamma", repr(float(r["gamma"])),
        # optimizer and schedule
        "--optimizer", "adamw",  # its default is muon
        "--lr", repr(float(r["lr"])),
        "--weight-decay", repr(float(r["weight_decay"])),
        "--scheduler-type", "cosine" if r["schedule"] == "cosine" else "linear",
        "--scheduler-warmup-ratio", repr(float(r["warmup_ratio"])),
        "--scheduler-total-steps", str(plan["total_steps"]),
        "--scheduler-num-cosine-cycles", "0.5",  # half a cosine: lr -> 0 at the last step
        "--epochs", str(plan["num_epochs"]),
        # bookkeeping
        "--save-path", str(save_dir),
        "--checkpoint-freq", str(plan["num_epochs"]),
        "--no-resume-from-checkpoint",
        "--log-freq", "1",
        "--logger", "",
        "--log-dir", str(log_dir),
        "--run-name", "peers-speculators",
    ]
    if plan["fractional"]:
        argv += ["--max-steps", str(plan["total_steps"])]
    unmatched = [
        {"setting": "num_anchors", "ours": f"{r['num_anchors']} per sample (document)",
         "theirs": f"--max-anchors {plan['max_anchors']} per packed row",
         "why": f"it counts anchors per packed row; {plan['max_anchors']} makes the run's anchors "
                f"{plan['anchors_theirs']} vs the recipe's {plan['anchors_ours']} over {plan['samples_seen']} "
                "samples (same average per sample), but a row's anchors fall on its documents by their loss tokens"},
        {"setting": "anchor candidates", "ours": "a with loss_mask[a] and loss_mask[a+1], inside the document",
         "theirs": "any a with loss_mask[a] outside the row's last block",
         "why": "not exposed; its block at a document's last answer token scores nothing"},
        {"setting": "loss targets", "ours": "the data's tokens (the target's own greedy answers)",
         "theirs": "argmax of the target's logits recomputed from last_hidden (--loss-fn ce)",
         "why": "its DFlash loss always reads the verifier's logits; equal to the data's tokens up to ties"},
        {"setting": "loss normalizer", "ours": "sum of the loss weights (decay x mask) of the step",
         "theirs": "number of scored positions of the row",
         "why": "not exposed; a constant factor (mean decay weight) that AdamW mostly absorbs"},
        {"setting": "batching", "ours": f"~{r['tokens_per_step']} tokens per step",
         "theirs": f"one packed row of --total-seq-len {r['tokens_per_step']} per step (LPT packing, padding excluded "
                   f"{plan['packed_tokens'] / max(1, plan['total_steps']):.0f} tokens on average)",
         "why": "it has no batch size or gradient accumulation; its packing decides the documents of a row"},
        {"setting": "export precision", "ours": "fp32", "theirs": "bf16 (trained fp32, saved bf16)",
         "why": "its checkpointer always saves bfloat16"},
        {"setting": "validation", "ours": "none in the loop", "theirs": "one validation pass per epoch",
         "why": "it requires a validation split; one copy of sample 0 (outside the timed loop)"},
    ]
    if float(r["grad_clip"]) != 1.0:
        unmatched.append({"setting": "grad_clip", "ours": r["grad_clip"], "theirs": 1.0,
                          "why": "hard-coded clip_grad_norm_(..., 1.0) in its trainer"})
    if float(r["min_lr_ratio"]) != 0.0:
        unmatched.append({"setting": "min_lr_ratio", "ours": r["min_lr_ratio"], "theirs": 0.0,
                          "why": "transformers' get_cosine_schedule_with_warmup decays to 0"})
    if list(r["betas"]) != [0.9, 0.999] or float(r["eps"]) != 1e-8:
        unmatched.append({"setting": "betas/eps", "ours": [r["betas"], r["eps"]], "theirs": [[0.9, 0.999], 1e-8],
                          "why": "its AdamW takes torch's defaults"})
    if r["schedule"] != "cosine":
        unmatched.append({"setting": "schedule", "ours": r["schedule"], "theirs": "linear",
                          "why": "it offers linear, cosine or none"})
    return argv, unmatched


def run(a: argparse.Namespace) -> dict:
    job_dir, work, export = Path(a.job).resolve(), Path(a.work).resolve(), Path(a.export).resolve()
    job = read_job(job_dir)
    r = job["recipe"]
    threads = int(r["threads"])
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    import torch

    torch.set_num_threads(threads)
    data_dir, save_dir = work / "data", work / "ckpt"
    t0 = time.perf_counter()
    data = write_offline_data(job_dir, data_dir)
    print(f"speculators: wrote {data['samples']} samples ({data['tokens']} tokens) to {data_dir} in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    plan = plan_steps_and_anchors(data["masks"], r, int(r["tokens_per_step"]))
    cpu = not torch.accelerator.is_available()
    argv, unmatched = build_argv(job, data_dir, save_dir, work / "logs", plan, data["train_data_ratio"], cpu)
    patches = apply_cpu_patches()
    box = instrument()
    if save_dir.exists():
        shutil.rmtree(save_dir)
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    (work / "argv.json").write_text(json.dumps(argv, indent=1))
    main(TrainConfig.resolve(argv))
    trainer = box["trainer"]
    steps = int(trainer.global_step)
    if steps != plan["total_steps"]:
        raise RuntimeError(f"it ran {steps} steps, the plan said {plan['total_steps']}")
    last = max(int(p.name) for p in save_dir.iterdir() if p.name.isdigit())
    if export.exists():
        shutil.rmtree(export)
    export.mkdir(parents=True)
    for f in (save_dir / str(last)).iterdir():
        if f.is_file() and f.suffix != ".pt" and f.name not in ("training_state.json", "val_metrics.json"):
            shutil.copy2(f, export / f.name)
    loop = box["loop_seconds"]
    epochs = float(r["epochs"])
    return {"trainer": "speculators", "version": VERSION, "status": "ran", "reason": "",
            "train_tokens": {"theirs": plan["packed_tokens"], "samples_x_epochs": round(data["tokens"] * epochs)},
            "steps": steps, "loop_seconds": loop, "tokens_per_s": plan["packed_tokens"] / loop if loop > 0 else None,
            "loop_cpu_seconds": box["loop_cpu_seconds"],  # this process's CPU time in the loop (a shared machine)
            "settings": {"argv": argv, "threads": threads, "max_anchors": plan["max_anchors"],
                         "anchors_run": {"recipe": plan["anchors_ours"], "speculators": plan["anchors_theirs"]},
                         "steps_per_epoch": plan["steps_per_epoch"], "checkpoint": str(save_dir / str(last))},
            "unmatched": unmatched, "patches": patches, "export": str(export)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--export", required=True)
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    try:
        result = run(a)
        code = 0
    except BaseException as e:  # noqa: BLE001 - any failure of the peer is reported, never hidden
        traceback.print_exc()
        if isinstance(e, KeyboardInterrupt):
            raise
        reason = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
        result = {"trainer": "speculators", "version": VERSION, "status": "refused", "reason": reason,
                  "export": str(Path(a.export).resolve())}
        code = 1
    (work / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("status", "reason", "steps", "loop_seconds", "tokens_per_s")
                      if k in result}), flush=True)
    return code


if __name__ == "__main__":  # guarded: a spawned dataloader worker re-imports this file
    sys.exit(main())
