"""The peers' shared job: the demo's real target, its own regenerated answers, and the target's features captured
ONCE through the vLLM engine in fp32, written in a neutral format every trainer's script reads (docs/peers.md).

    JOB/job.json                      target folder, sizes, feature layers, mask id, counts, the recipe
    JOB/cache/                        our `capture` of the whole token store (what OUR trainer reads: -p hidden_cache)
    JOB/samples/{i:06d}.safetensors   one per TRAINING sample (the held-out split left out):
        input_ids      int64   [T]
        loss_mask      int64   [T]       1 = an answer token (trained on)
        hidden_states  float32 [T, k, H] the k feature layers' outputs, from the engine (the cache's rows)
        last_hidden    float32 [T, H]    the last decoder layer's output before the final norm (transformers fp32):
                                         for a trainer whose loss reads the target's own logits

Feature layer i is decoder layer i's OUTPUT: Hugging Face's output_hidden_states[i + 1], vLLM's aux layer id i + 1.
`build_job(out, recipe)` is idempotent: a complete job (job.json written last) of the same data settings is reused,
its recipe rewritten (the samples do not depend on it).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dflash_lib.config import ConfigError
from dflash_lib.data.split import split_store
from dflash_lib.data.store import build_token_store_from_config
from dflash_lib.lab.demo import prepare_target
from dflash_lib.models.anchors import default_gamma
from dflash_lib.models.target_config import chosen_layer_ids, local_hf_config
from dflash_lib.rundir import load_config, write_json
from dflash_lib.target.cached import CapturedFeatures, read_manifest
from dflash_lib.target.capture import run_capture

FORMAT = 1


@dataclass
class Recipe:
    """The settings every trainer is given (as far as it exposes them): the drafter's shape, the optimizer and the
    budget. Anchors are counted per SAMPLE (a conversation); tokens_per_step excludes padding."""

    drafter_layers: int = 1
    block_size: int = 4
    num_anchors: int = 48
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    schedule: str = "cosine"  # linear warm-up, then a cosine from lr to min_lr_ratio * lr
    grad_clip: float = 1.0
    gamma: float = 0.0  # loss decay exp(-(k-1)/gamma); 0 = the paper's rule for the block size (resolved in job.json)
    optimizer: str = "adamw"
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    epochs: float = 3.0
    tokens_per_step: int = 1024
    max_len: int = 1024
    seed: int = 0
    threads: int = 2
    num_features: int = 3

    def resolved(self) -> dict[str, Any]:
        out = asdict(self)
        out["gamma"] = self.gamma or default_gamma(self.block_size)
        return out


def job_params(answers: Path, heldout: float, params: dict[str, Any], recipe: Recipe) -> dict[str, Any]:
    """Our flat settings of the job (the demo preset laid under them): the real target and its answers, fp32, the
    whole vocabulary (the peers' drafters have no draft vocabulary), the recipe's shape."""
    return {**params, "draft_vocab": 0, "source": str(answers), "heldout_fraction": heldout,
            "max_len": recipe.max_len, "precision": "fp32", "device": "cpu", "num_features": recipe.num_features,
            "drafter_layers": recipe.drafter_layers, "block_size": recipe.block_size, "num_anchors": recipe.num_anchors}


def last_hidden(target: str, docs: list[torch.Tensor]) -> list[torch.Tensor]:
    """(T, H) fp32 output of the target's last decoder layer (before the final norm) for each document."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    seen: list[torch.Tensor] = []
    layer = model.model.layers[-1]
    hook = layer.register_forward_hook(lambda _m, _i, out: seen.append((out[0] if isinstance(out, tuple) else out)[0]))
    out = []
    with torch.inference_mode():
        for d in docs:
            seen.clear()
            model(d[None])
            out.append(seen[-1].float().contiguous())
    hook.remove()
    return out


def build_job(out: str | Path, recipe: Recipe, say=print) -> dict[str, Any]:
    """The job folder `out` (see the module doc); returns job.json's content."""
    out = Path(out)
    params, inputs = prepare_target("demo", None, kind="real", engine=True)
    answers, heldout = Path(inputs["answers"]), float(inputs["answers_heldout"])
    flat = job_params(answers, heldout, {k: v for k, v in params.items() if k != "min_new_tokens"}, recipe)
    config = load_config(flat, "demo")
    job_file = out / "job.json"
    if job_file.is_file():
        doc = json.loads(job_file.read_text())
        if (doc.get("format"), doc.get("params")) != (FORMAT, flat):
            raise ConfigError(f"{job_file}: a job of other answers or data settings: give another folder or delete it")
        if doc.get("recipe") != recipe.resolved():  # the samples do not depend on the recipe: only job.json changes
            doc["recipe"] = recipe.resolved()
            write_json(job_file, doc)
        try:
            read_manifest(out / "cache")
        except ConfigError as e:  # an older version's capture: ours cannot train on it, the peers' files stand
            say(f"job: {e}; capturing again (the peers' samples/ are written from the same engine states)")
            shutil.rmtree(out / "cache")
            run_capture(config, out / "cache", progress=False)
        return doc
    store = build_token_store_from_config(config.data, progress=False)
    say(f"job: capturing the target's features of {len(store)} samples through the engine -> {out / 'cache'}")
    run_capture(config, out / "cache", progress=False)
    cache = CapturedFeatures(out / "cache")
    hf = local_hf_config(config.model.target)
    layers = chosen_layer_ids(config.model.target_layer_ids, hf.num_hidden_layers, config.model.num_features)
    split = split_store(store, heldout)
    docs = [torch.from_numpy(store[int(i)][0].astype("int64")) for i in split.train]
    masks = [torch.from_numpy(store[int(i)][1].astype("int64")) for i in split.train]
    say(f"job: the last layer's states of {len(docs)} training samples (transformers, fp32)")
    lasts = last_hidden(config.model.target, docs)
    (out / "samples").mkdir(parents=True, exist_ok=True)
    k, h = len(layers), int(hf.hidden_size)
    for j, (d, m, last) in enumerate(zip(docs, masks, lasts)):
        feats = cache.get(d)
        if feats is None:
            raise ConfigError(f"{out / 'cache'}: training sample {int(split.train[j])} is not in the capture")
        save_file({"input_ids": d.contiguous(), "loss_mask": m.contiguous(),
                   "hidden_states": feats.float().reshape(len(d), k, h).contiguous(), "last_hidden": last},
                  str(out / "samples" / f"{j:06d}.safetensors"))
    doc = {"format": FORMAT, "target": str(Path(config.model.target).resolve()), "hidden_size": h,
           "num_hidden_layers": int(hf.num_hidden_layers), "vocab_size": int(hf.vocab_size), "feature_layers": layers,
           "mask_id": config.model.mask_id, "samples": len(docs), "tokens": int(sum(len(d) for d in docs)),
           "loss_tokens": int(sum(int(m.sum()) for m in masks)), "answers": str(answers), "heldout_fraction": heldout,
           "features": "captured once through vLLM's CPU build in fp32 (our `capture`)", "recipe": recipe.resolved(),
           "params": flat}
    write_json(job_file, doc)
    return doc


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--epochs", type=float, default=Recipe.epochs)
    ap.add_argument("--tokens-per-step", type=int, default=Recipe.tokens_per_step)
    a = ap.parse_args()
    print(json.dumps(build_job(a.out, Recipe(epochs=a.epochs, tokens_per_step=a.tokens_per_step)), indent=1)[:2000])
