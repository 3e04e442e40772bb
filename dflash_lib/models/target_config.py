"""The target's config without its weights: a folder's config.json as transformers reads it (`local_hf_config`, the
text model of a vision-language wrapper: `text_config`), the config of `-p target` ("tiny", a named shape or a
folder: `target_hf_config`), the tiny random Qwen3 of tests and the demo, a folder's safetensors files, and which
layers feed the drafter (`feature_layer_ids`, `chosen_layer_ids`; docs/dflash.md). The model itself:
`target.local.TargetModel`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import transformers

from dflash_lib.config import ConfigError
from dflash_lib.families import text_config
from dflash_lib.families.qwen3 import QWEN3_VOCAB
from dflash_lib.models.shapes import NAMED_SHAPES
from dflash_lib.rundir import read_json_object

if TYPE_CHECKING:
    from dflash_lib.config import ModelConfig


def tiny_qwen3_config(hidden_size: int = 64, num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
                      intermediate_size: int | None = None, vocab_size: int = QWEN3_VOCAB,
                      max_position_embeddings: int = 4096) -> transformers.Qwen3Config:
    """A small Qwen3 config for tests and the demo; `intermediate_size` None = 3 * hidden_size."""
    if hidden_size % num_heads:
        raise ConfigError(f"tiny target: hidden_size {hidden_size} is not a multiple of num_heads {num_heads}")
    if num_heads % num_kv_heads:
        raise ConfigError(f"tiny target: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    return transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=hidden_size // num_heads,
        intermediate_size=intermediate_size or 3 * hidden_size, max_position_embeddings=max_position_embeddings,
        attn_implementation="sdpa",
    )


def target_hf_config(cfg: "ModelConfig") -> transformers.PretrainedConfig:
    """The target's Hugging Face config for `cfg.target`: "tiny" (cfg.target_layers, cfg.hidden_size), a name in
    NAMED_SHAPES (shapes only), or a LOCAL model directory (its config.json; no weight is read)."""
    if cfg.target == "tiny":
        return tiny_qwen3_config(hidden_size=cfg.hidden_size, num_layers=cfg.target_layers)
    if cfg.target in NAMED_SHAPES:
        return NAMED_SHAPES[cfg.target]()
    if not os.path.isdir(cfg.target):
        raise ConfigError(f"target {cfg.target!r} is neither 'tiny', a named shape {sorted(NAMED_SHAPES)} nor a local "
                          "model directory (give a local Hugging Face folder with -p target DIR; nothing is downloaded)")
    return local_hf_config(cfg.target)


def local_hf_config(directory: str | Path) -> transformers.PretrainedConfig:
    """The config of the local Hugging Face model folder `directory` (its config.json; no weight is read), the
    text model's for a vision-language wrapper. ConfigError naming the file when it is missing, is not a JSON
    object, or names a model_type that this transformers does not know."""
    path = Path(directory) / "config.json"
    doc = read_json_object(path, f"target {str(directory)!r}: no config.json (not a Hugging Face model folder)")
    model_type = doc.get("model_type")
    if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
        raise ConfigError(f"{path}: model_type {model_type!r} is not a model type transformers "
                          f"{transformers.__version__} knows (a newer transformers, or not a causal LM folder?)")
    try:
        cfg = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as e:  # what transformers raises for a config it cannot build
        raise ConfigError(f"{path}: {' '.join(str(e).split())}") from None
    text = text_config(cfg)
    if text is not cfg:
        text._name_or_path = cfg._name_or_path
    return text


def weight_files(directory: str | Path) -> list[str]:
    """The safetensors files of a local model folder (from model.safetensors.index.json, else model.safetensors);
    ConfigError when there is none (pickled .bin checkpoints are never loaded)."""
    root = Path(directory)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{index}: not an index of safetensors files ({type(e).__name__}: {e})") from None
    if (root / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise ConfigError(f"target {str(root)!r}: no model.safetensors(.index.json); only safetensors checkpoints "
                      "are loaded (pickled .bin files are not)")


def feature_layer_ids(num_layers: int, num_features: int) -> list[int]:
    """Target layers whose outputs feed the drafter (docs/dflash.md): spread evenly over 1 .. num_layers-3.

    One feature: the middle layer. Python's `round` (half to even). A target too shallow for `num_features`
    distinct layers in that range gets repeated ids (e.g. 4 layers, 2 features -> [1, 1]); pass explicit ids
    to choose otherwise.
    """
    if num_features < 1:
        raise ConfigError(f"num_features must be >= 1, got {num_features}")
    if num_features == 1:
        return [num_layers // 2]
    if num_layers < 4:
        raise ConfigError(f"the layer-id rule needs a target of >= 4 layers for {num_features} features, "
                          f"got {num_layers}; set target_layer_ids explicitly")
    span = num_layers - 4
    return [round(1 + i * span / (num_features - 1)) for i in range(num_features)]


def chosen_layer_ids(ids: Sequence[int] | None, num_layers: int, num_features: int) -> list[int]:
    """The target layers whose outputs feed the drafter: the configured `ids` (`-p target_layer_ids`) when there
    are any, else `feature_layer_ids`' rule (docs/dflash.md) for a target of `num_layers` decoder layers."""
    return list(ids) if ids else feature_layer_ids(int(num_layers), num_features)
