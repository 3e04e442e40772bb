"""Decode prompt sets with z-lab's own DFlash loop (PyPI dflash==0.1.0: `DFlashDraftModel`, the `dflash_generate`
loop its `spec_generate` calls) and report its acceptance length tau per set. Runs in .venv-peers/dflash
(benchmarks/peers/zlab/install.sh); nothing of the package is copied here, it is imported and called.

    .venv-peers/dflash/bin/python benchmarks/peers/zlab/decode.py --target DIR --drafter DIR \
        --prompts prompts.jsonl --max-new-tokens N --out result.json [--threads N] [--convert-config] [--baseline]

prompts.jsonl: one {"set": name, "prompt": [token ids]} a line, ids already chat-templated. Each prompt is decoded
greedily, batch 1, fp32, to N new tokens or through the first of the target's generation_config.json
`eos_token_id`s (the end-of-turn token), by `dflash.model.dflash_generate(drafter, target, ids, N, stop_ids,
return_stats=True)`: `spec_generate` is that call without `return_stats`, the only way the package hands back its
per-cycle counts (`acceptance_lengths`: the tokens each draft-verify cycle kept, the target's own included).

Figures per set (result.json "sets"; the same over all sets at the top level):
  tau            sum of the package's acceptance_lengths / cycles: tokens per cycle AS THE PACKAGE COUNTS THEM. It
                 cuts a cycle's count at the stop token and at N, and shrinks the last blocks to the tokens left
                 (verify_size = min(B, N left)), where vLLM's counters and our `evaluate` count the cycle's whole
                 accepted run of a full block: the two differ only in each answer's last cycles.
  tau_verified   accepted drafts + 1 per cycle as the target verified them (before the package's cuts), read by a
                 forward hook on the target (read-only: it sees the block the loop verified and recomputes the
                 loop's own greedy match); what vLLM's counters count.
  per_position   [k-1] share of cycles whose verified run reached draft position k, k = 1 .. B-1.
  cycles, prompts, output_tokens, outputs (the new token ids of each prompt, stop token included, cut at N),
  acceptance_lengths (per prompt, the package's list), verified (per prompt, per cycle: [block length verified,
  drafts accepted]), seconds and tokens_per_s (wall clock of the loop calls, prefills included, after one untimed
  warm-up decode of the first prompt), and with --baseline the same prompts decoded by the target alone
  (`generate`, greedy, fp32): outputs_equal_baseline, baseline_outputs and baseline_tokens_per_s.

A drafter the package does not load is reported, not decoded: status "refused" and reason (its error, one line).
So is one it loads only partly (missing keys left at random init, or tensors it has no place for: a draft
vocabulary's `lm_head.weight` / `d2t`, since z-lab's model always drafts through the target's embedding and head):
decoding it would not be that drafter's. --convert-config: for speculators' nested export (`speculators_config` +
`transformer_layer_config`), which z-lab's loader refuses, build a flat config from it, THE CONFIG ONLY (the
weights are read as stored: the tensor names are already z-lab's), `convert_speculators_config` says what changes.

Device-only patches (CPU), applied at run time, nothing else of the package touched:
  1. `dflash.model._cuda_time` -> `time.perf_counter`: its stats timer calls `torch.cuda.synchronize()`, which
     raises on a machine without CUDA (only when `return_stats=True`). Not applied when CUDA is available.

Speed on CPU, settings only (no patch; LOG.md, issue 52): OMP_WAIT_POLICY=PASSIVE unless the caller set it (before
torch loads its OpenMP runtime): by default libgomp's idle threads spin at every barrier, and on a 2-core machine
other processes share, each of the small per-token GEMMs then waits for a descheduled spinning thread. Measured (1
prompt x 32 tokens, run queue ~9 on 2 cores): 2 threads 0.37 tok/s spinning (46 s of CPU), 2.52 passive (8 s),
1 thread 3.64. The loop itself costs what ours does: 3.79 tok/s against our `evaluate`'s 3.88 on the same prompts,
1 thread. `--threads` sets torch's intra-op threads (the harness passes the job's); the untimed warm-up keeps
first-call set-up out of the rate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import OrderedDict
from importlib import metadata
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch's OpenMP runtime starts (docstring)
import torch  # noqa: E402

PACKAGE = "dflash"
VERSION = "0.1.0"
PATCH_TIMER = "dflash.model._cuda_time -> time.perf_counter (its timer calls torch.cuda.synchronize(); no CUDA here)"


class Refused(Exception):
    """The package cannot load this drafter (as published)."""


def read_prompts(path: Path) -> "OrderedDict[str, list[list[int]]]":
    """{set name: [prompt token ids, ...]} in file order."""
    sets: OrderedDict[str, list[list[int]]] = OrderedDict()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        ids = row["prompt"]
        if not ids or not all(isinstance(t, int) for t in ids):
            raise SystemExit(f"{path}:{n}: 'prompt' must be a non-empty list of token ids")
        sets.setdefault(str(row["set"]), []).append(ids)
    if not sets:
        raise SystemExit(f"{path}: no prompts")
    return sets


def stop_ids(target_dir: Path) -> list[int]:
    """The target's end-of-turn ids: generation_config.json's eos_token_id (int or list), else config.json's."""
    for name in ("generation_config.json", "config.json"):
        f = target_dir / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    raise SystemExit(f"{target_dir}: no eos_token_id in generation_config.json or config.json")


def convert_speculators_config(cfg: dict[str, Any], target_cfg: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """speculators' nested DFlash config -> the flat Qwen3 config z-lab's `DFlashDraftModel` reads, and what was
    changed, in words. No weight is read or changed. Refuses what z-lab's model cannot express."""
    kind = cfg.get("speculators_model_type")
    if kind != "dflash":
        raise Refused(f"--convert-config: speculators_model_type {kind!r}: only 'dflash' has z-lab's architecture")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise Refused("--convert-config: no transformer_layer_config in the export's config.json")
    vocab = layer.get("vocab_size")
    if cfg.get("draft_vocab_size") not in (None, vocab):
        raise Refused(f"--convert-config: draft_vocab_size {cfg['draft_vocab_size']} < vocab_size {vocab}: z-lab's "
                      "model drafts through the target's full LM head, not the drafter's own")
    aux = cfg.get("aux_hidden_state_layer_ids")
    if not aux:
        raise Refused("--convert-config: no aux_hidden_state_layer_ids (which target layers the drafter reads)")
    flat = dict(layer)
    flat.update(architectures=["DFlashDraftModel"], model_type="qwen3", block_size=int(cfg["block_size"]),
                num_target_layers=int(target_cfg["num_hidden_layers"]),
                dflash_config={"mask_token_id": int(cfg["mask_token_id"]),
                               "target_layer_ids": [int(i) - 1 for i in aux], "block_size": int(cfg["block_size"])})
    changes = [
        "transformer_layer_config's fields moved to the top level (z-lab reads a flat Qwen3 config)",
        f"dflash_config.target_layer_ids = aux_hidden_state_layer_ids - 1 = {[int(i) - 1 for i in aux]} (speculators "
        "numbers layer boundaries as vLLM does, 0 = embeddings; z-lab 0-based layers, reading hidden_states[id + 1]; "
        "speculators' own z-lab converter maps i -> i + 1)",
        f"num_target_layers = {target_cfg['num_hidden_layers']} (the target's; absent from the export, which z-lab's "
        "loader needs even with explicit ids)",
        "mask_token_id and block_size copied into dflash_config",
    ]
    types = layer.get("layer_types") or []
    if cfg.get("sliding_window_non_causal") and "sliding_attention" in types:
        flat["is_causal"] = False
        changes.append("is_causal = false (sliding_window_non_causal: its sliding layers see the whole block, as its "
                       "full layers do)")
    elif "sliding_attention" in types:
        changes.append(f"layer_types kept: z-lab makes a sliding layer causal in its block, as speculators does "
                       f"(sliding_window_non_causal false); the window ({layer.get('sliding_window')}) is counted from "
                       "each query in z-lab, from the block's anchor in speculators: the same masks while the context "
                       "is shorter than the window")
    return flat, changes


def load_drafter(drafter_dir: Path, target_cfg: dict[str, Any], convert: bool) -> tuple[Any, list[str]]:
    """z-lab's DFlashDraftModel in fp32, and the config changes made (empty without --convert-config)."""
    from dflash import DFlashDraftModel
    from transformers import Qwen3Config

    cfg = json.loads((drafter_dir / "config.json").read_text())
    changes: list[str] = []
    kwargs: dict[str, Any] = {}
    if "speculators_config" in cfg:
        if not convert:
            try:  # what the package does with the folder as published: its own error is the finding
                DFlashDraftModel.from_pretrained(str(drafter_dir), dtype=torch.float32)
            except Exception as e:  # noqa: BLE001
                raise Refused(
                    f"{type(e).__name__}: {' '.join(str(e).split())} (speculators' nested config: z-lab reads a flat "
                    "Qwen3 config, so the drafter's shapes in transformer_layer_config, its feature layers in "
                    "aux_hidden_state_layer_ids and the target's layer count are all unseen, and the first missing "
                    "field its constructor reads, num_target_layers, raises; --convert-config builds a flat config, "
                    "config only)") from None
            raise Refused("speculators' nested config loaded without error but with the defaults of Qwen3Config "
                          "(no hidden_size at the top level); --convert-config builds a flat one")
        flat, changes = convert_speculators_config(cfg, target_cfg)
        kwargs["config"] = Qwen3Config(**flat)
    try:
        model, info = DFlashDraftModel.from_pretrained(str(drafter_dir), dtype=torch.float32,
                                                       output_loading_info=True, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise Refused(f"{type(e).__name__}: {' '.join(str(e).split())}") from None
    partial = {k: sorted(v) for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys",
                                                                     "mismatched_keys")}
    if partial:
        why = ""
        if {"d2t", "lm_head.weight"} & set(partial.get("unexpected_keys", [])):
            why = (" (a draft vocabulary: z-lab's model drafts through the target's embedding and full LM head and "
                   "has no place for the drafter's own head and d2t)")
        raise Refused(f"loaded only partly, so its decoding would not be this drafter's: {partial}{why}")
    return model.eval(), changes


def check_fit(model: Any, target_cfg: dict[str, Any]) -> None:
    """Refuse a drafter whose features do not fit the target (the package would fail mid-loop or read garbage)."""
    ids, n = list(model.target_layer_ids), int(target_cfg["num_hidden_layers"])
    if any(not 0 <= i < n for i in ids):
        raise Refused(f"target_layer_ids {ids} outside the target's {n} layers")
    if model.config.hidden_size != target_cfg["hidden_size"] or model.config.vocab_size != target_cfg["vocab_size"]:
        raise Refused(f"hidden/vocab {model.config.hidden_size}/{model.config.vocab_size} vs the target's "
                      f"{target_cfg['hidden_size']}/{target_cfg['vocab_size']}")
    if model.mask_token_id is None or not 0 <= int(model.mask_token_id) < target_cfg["vocab_size"]:
        raise Refused(f"mask_token_id {model.mask_token_id} is not a row of the target's embedding")


class VerifyLog:
    """A read-only forward hook on the target: for each verification call (every target call but the prefill, which
    passes `logits_to_keep`), the block's length and the drafts the target's greedy choices accept, computed as the
    loop computes them (argmax, leading run of matches)."""

    def __init__(self, target: Any):
        self.cycles: list[tuple[int, int]] = []  # (block length verified, drafts accepted)
        self.handle = target.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if "logits_to_keep" in kwargs:  # the prefill
            return
        block = args[0] if args else kwargs["input_ids"]  # (1, b)
        posterior = output.logits.argmax(dim=-1)  # (1, b)
        accepted = int((block[:, 1:] == posterior[:, :-1]).cumprod(dim=1).sum(dim=1)[0])
        self.cycles.append((block.shape[1], accepted))


def figures(results: list[dict[str, Any]], block: int) -> dict[str, Any]:
    """Tau and the rest over `results` (one dict per prompt)."""
    lengths = [a for r in results for a in r["acceptance_lengths"]]
    verified = [c for r in results for c in r["verified"]]
    cycles = len(lengths)
    seconds = sum(r["seconds"] for r in results)
    out_tokens = sum(len(r["output"]) for r in results)
    nan = float("nan")
    return {
        "prompts": len(results), "cycles": cycles, "output_tokens": out_tokens,
        "tau": sum(lengths) / cycles if cycles else nan,
        "tau_verified": sum(a + 1 for _, a in verified) / len(verified) if verified else nan,
        "per_position": [sum(a >= k for _, a in verified) / len(verified) if verified else nan
                         for k in range(1, block)],
        "short_blocks": sum(b < block for b, _ in verified),  # cycles the package verified with fewer than B tokens
        "seconds": seconds, "tokens_per_s": out_tokens / seconds if seconds > 0 else nan,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, required=True, help="the target's Hugging Face folder")
    ap.add_argument("--drafter", type=Path, required=True, help="the drafter export folder")
    ap.add_argument("--prompts", type=Path, required=True, help='JSONL: {"set": name, "prompt": [ids]} a line')
    ap.add_argument("--max-new-tokens", type=int, required=True, help="new tokens per prompt at most")
    ap.add_argument("--out", type=Path, required=True, help="result.json to write")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("--convert-config", action="store_true",
                    help="read speculators' nested config as a flat one (config only; see the docstring)")
    ap.add_argument("--baseline", action="store_true",
                    help="also decode each prompt with the target alone (greedy generate) and compare outputs")
    a = ap.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    import dflash.model as zlab
    from transformers import AutoModelForCausalLM, GenerationConfig

    patches = []
    if not torch.cuda.is_available():
        zlab._cuda_time = time.perf_counter
        patches.append(PATCH_TIMER)
    version = metadata.version(PACKAGE)
    if version != VERSION:
        print(f"warning: {PACKAGE} {version} installed, this script was checked against {VERSION}", file=sys.stderr)
    sets = read_prompts(a.prompts)
    stops = stop_ids(a.target)
    target_cfg = json.loads((a.target / "config.json").read_text())
    doc: dict[str, Any] = {"decoder": "z-lab dflash", "version": version, "status": "ran", "reason": "",
                           "target": str(a.target), "drafter": str(a.drafter), "max_new_tokens": a.max_new_tokens,
                           "stop_ids": stops, "threads": torch.get_num_threads(),
                           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "patches": patches,
                           "config_changes": [], "dtype": "float32", "device": "cpu"}
    try:
        drafter, doc["config_changes"] = load_drafter(a.drafter, target_cfg, a.convert_config)
        check_fit(drafter, target_cfg)
    except Refused as e:
        doc.update(status="refused", reason=str(e))
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"refused: {e}", file=sys.stderr)
        return 1
    target = AutoModelForCausalLM.from_pretrained(str(a.target), dtype=torch.float32).eval()
    block = int(drafter.block_size)
    doc.update(block_size=block, target_layer_ids=list(drafter.target_layer_ids),
               mask_token_id=int(drafter.mask_token_id))

    log = VerifyLog(target)

    def run(ids: list[int], n_new: int) -> dict[str, Any]:
        x = torch.tensor([ids], dtype=torch.long)
        log.cycles.clear()
        t0 = time.perf_counter()
        st = zlab.dflash_generate(drafter, target, x, n_new, stops, return_stats=True)
        dt = time.perf_counter() - t0
        return {"output": st.output_ids[0, len(ids):].tolist(), "acceptance_lengths": list(st.acceptance_lengths),
                "verified": list(log.cycles), "seconds": dt}

    drafter.eval()  # what spec_generate does before its call
    run(next(iter(sets.values()))[0], min(8, a.max_new_tokens))  # warm-up, untimed
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=a.max_new_tokens, eos_token_id=stops,
                               pad_token_id=stops[0])
    everything: list[dict[str, Any]] = []
    doc["sets"] = {}
    for name, prompts in sets.items():
        results = [run(p, a.max_new_tokens) for p in prompts]
        everything += results
        row = figures(results, block)
        row["outputs"] = [r["output"] for r in results]
        row["acceptance_lengths"] = [r["acceptance_lengths"] for r in results]
        row["verified"] = [r["verified"] for r in results]  # per prompt, per cycle: [block length, drafts accepted]
        if a.baseline:
            log.handle.remove()
            base, secs = [], 0.0
            for p in prompts:
                t0 = time.perf_counter()
                with torch.inference_mode():
                    out = target.generate(torch.tensor([p]), generation_config=gen_cfg)
                secs += time.perf_counter() - t0
                base.append(out[0, len(p):].tolist())
            log.handle = target.register_forward_hook(log._hook, with_kwargs=True)
            row["outputs_equal_baseline"] = sum(o == b for o, b in zip(row["outputs"], base))
            row["baseline_tokens_per_s"] = sum(map(len, base)) / secs if secs > 0 else math.nan
            row["baseline_outputs"] = base
        doc["sets"][name] = row
        print(f"{name}: {row['prompts']} prompts, tau {row['tau']:.3f} (verified {row['tau_verified']:.3f}) over "
              f"{row['cycles']} cycles, {row['tokens_per_s']:.2f} tok/s", file=sys.stderr)
    doc.update(figures(everything, block))
    if a.baseline:
        doc["outputs_equal_baseline"] = sum(r["outputs_equal_baseline"] for r in doc["sets"].values())
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"all: tau {doc['tau']:.3f} over {doc['cycles']} cycles, {doc['tokens_per_s']:.2f} tok/s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
