"""The tiny Qwen3 target and DFlash drafter (random weights, built locally in well under a second) that the
attention and drafter-reference tests share, tiny random models saved as local Hugging Face folders, a
trainer-like run folder of a random drafter, and the two-step smoke training the target-folder tests run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_lib.models import DFlashDrafter, DrafterConfig, tiny_qwen3_config
from dflash_lib.target.local import TargetModel

VOCAB, MASK, HIDDEN, BLOCK = 300, 299, 32, 4  # vocabulary, MASK id (its last row), hidden size, block size (tokens)
SMALL_STORE = {"limit": 300, "max_len": 512}  # the smoke preset's token store (cached once for all tests)


def tiny_target(num_layers: int = 6, num_features: int = 2) -> TargetModel:
    """A random `num_layers`-layer Qwen3 of hidden size HIDDEN whose `num_features` layers feed the drafter."""
    return TargetModel.from_hf_config(tiny_qwen3_config(hidden_size=HIDDEN, num_layers=num_layers, vocab_size=VOCAB),
                                      num_features, seed=0)


def tiny_drafter(target: TargetModel, attention: str = "dense", **overrides: Any) -> DFlashDrafter:
    """A 2-layer drafter (4 query / 2 KV heads of 8) on `target`, blocks of BLOCK, 64 anchors; `overrides` replace
    DrafterConfig fields. Seeded: the same weights every call."""
    fields = dict(hidden_size=HIDDEN, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                  vocab_size=VOCAB, target_layer_ids=target.layer_ids, target_num_layers=target.num_layers,
                  block_size=BLOCK, mask_id=MASK, num_anchors=64)
    torch.manual_seed(0)
    return DFlashDrafter(DrafterConfig(**(fields | overrides)), target, attention=attention)


def overfit_on_greedy(target: TargetModel, drafter: DFlashDrafter, prompts: list[list[int]], new_tokens: int,
                      steps: int, lr: float = 3e-3, losses: list[float] | None = None,
                      answers: list[list[int]] | None = None) -> tuple[Any, Any, list[list[int]], torch.Generator]:
    """Train `drafter` in place for `steps` AdamW steps on the target's own greedy continuations (`new_tokens`
    each) of `prompts` (or `answers`, one per prompt: another decoding's), labels on the continuations only (what
    the paper trains on). Returns (the padded batch, its target features, the continuations, the anchor generator
    as training left it). A drafter whose loss is kl or ce+kl gets the target's final states at its layout's
    target rows; `losses` collects each step's loss."""
    import numpy as np

    from dflash_lib.data.batch import collate_padded

    conts = [target.greedy(p, new_tokens) for p in prompts] if answers is None else [list(a) for a in answers]
    docs = [(np.array(p + c), np.arange(len(p) + len(c)) >= len(p)) for p, c in zip(prompts, conts)]
    batch = collate_padded(docs, pad_id=0)
    feats = target.features(batch)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=lr)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        anchors = drafter.sample_anchors(batch, gen)
        if drafter.cfg.loss == "ce":
            out = drafter.loss(batch, feats, anchors)
        else:
            layout = drafter.layout(batch, anchors)
            _, final = target.context_features_and_final(batch, layout.target_rows)
            out = drafter.loss(batch, feats, layout, target_hidden=final)
        if losses is not None:
            losses.append(out.loss.item())
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return batch, feats, conts, gen


# -- the decoding tests' models (test_evaluate, test_models_decode): 256 ids, the last one MASK -------------------


def decode_target(vocab: int = 256) -> TargetModel:
    """A random 4-layer Qwen3 of hidden 32 over `vocab` ids, one feature layer."""
    return TargetModel.from_hf_config(tiny_qwen3_config(hidden_size=32, num_layers=4, vocab_size=vocab), 1, seed=0)


def decode_drafter(target: TargetModel, block: int, seed: int = 0) -> DFlashDrafter:
    """A 2-layer drafter on `target` (its last id as MASK), blocks of `block` tokens; seeded by `seed`."""
    vocab = target.vocab_size
    cfg = DrafterConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=96,
                        vocab_size=vocab, target_layer_ids=target.layer_ids, target_num_layers=target.num_layers,
                        block_size=block, mask_id=vocab - 1, num_anchors=64, ce_chunk_blocks=4)
    torch.manual_seed(seed)
    return DFlashDrafter(cfg, target)


def random_prompts(n: int, seed: int, vocab: int = 256, longest: int = 8) -> list[list[int]]:
    """`n` prompts of 1 .. longest-1 ids below the MASK id (vocab - 1)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab - 1, int(rng.integers(1, longest))).tolist() for _ in range(n)]


def tiny_chatml_tokenizer():
    """A byte-level BPE of ~400 ids trained here on a few chat lines, as a Hugging Face fast tokenizer with the
    ChatML specials (<|endoftext|> pad, <|im_start|>, <|im_end|> eos); no chat template set."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = ["user\nHi there", "assistant\nHello! How can I help?", "system\nBe brief.", "2+2? 4"] * 20
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=["<|im_start|>"])
    return hf


def save_random_model(directory: Path | str, hf_config: Any, seed: int = 0,
                      spread: tuple[float, float] | None = None):
    """A model of `hf_config` with random weights seeded by `seed` (the global RNG left as it was), saved as a local
    Hugging Face folder; returns the model. `spread` (matrix std, other std): every matrix redrawn from N(0,
    matrix std) and every other parameter from N(0, other std), so that no layer is near the identity (a default
    init's 0.02 leaves it so) and every layer changes the answers."""
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
        if spread is not None:
            for p in model.parameters():
                p.data.normal_(0.0, spread[0] if p.dim() > 1 else spread[1])
    model.save_pretrained(directory)
    return model


def save_tiny_qwen3(directory: Path | str, seed: int = 0, **shape: Any):
    """A random Qwen3 of `tiny_qwen3_config(**shape)` (hidden_size and num_layers given) saved by
    `save_random_model`; returns the model."""
    return save_random_model(directory, tiny_qwen3_config(**shape), seed)


def save_tiny_run(directory: Path) -> tuple[str, Any]:
    """A trainer-like run folder in `directory`: config.json {"config": ...} of a tiny target (4 layers of hidden
    32, one feature layer, blocks of 4, SMALL_STORE) and drafter/ (a random drafter seeded 0, exported in fp32).
    Returns (the folder, its Config)."""
    from dflash_lib.config import from_params
    from dflash_lib.models.export import export_drafter

    config = from_params({"hidden_size": 32, "target_layers": 4, "num_features": 1, "block_size": 4, **SMALL_STORE})
    tgt = TargetModel.from_model_config(config.model, seed=config.train.seed)
    torch.manual_seed(0)
    export_drafter(DFlashDrafter(DrafterConfig.from_model_config(config.model, tgt), tgt), directory / "drafter",
                   torch.float32)
    (directory / "config.json").write_text(json.dumps({"config": config.to_dict()}))
    return str(directory), config


def train_two_steps(target_dir: Path | str, run_dir: Path) -> dict[str, Any]:
    """`train --preset smoke -p steps 2 -p target DIR` into `run_dir`, checked to have completed both steps with a
    finite loss; returns the exported drafter's config.json."""
    from dflash_lib.__main__ import main  # the CLI: only these tests need it

    assert main(["train", "--preset", "smoke", "--run-dir", str(run_dir), "-p", "steps", "2",
                 "-p", "target", str(target_dir)]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["complete"] and np.isfinite(summary["final_loss"])
    return json.loads((run_dir / "drafter" / "config.json").read_text())
