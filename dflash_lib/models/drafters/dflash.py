"""The `dflash` drafter kind: `DFlashDrafter` (models/drafter.py) served as z-lab's `DFlashDraftModel`, a Qwen3
config.json with `dflash_config`, the layers' Qwen3 tensor names and, for a draft vocabulary, vLLM's `d2t` and
`lm_head.weight`. `KIND` declares it; the fields: docs/serving.md, "Export for serving".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from dflash_lib.config import ConfigError
from dflash_lib.models.causality import FIELDS, NESTED_FIELD, engine_layer_types, field_value, override_of, \
    write_causality
from dflash_lib.models.drafter import DFlashDrafter, DrafterConfig
from dflash_lib.models.drafters.kind import CONFIG_FILE, WEIGHTS_FILE, DrafterKind

ARCHITECTURE, MODEL_TYPE = "DFlashDraftModel", "qwen3"  # what the serving engines dispatch on
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}
TRAINING_KEYS = ("gamma", "num_anchors", "ce_chunk_blocks", "initializer_range",  # dflash_config.training
                 "loss", "kl_weight", "kl_temperature", "position_weight", "dpace_alpha", "loss_weighting")
TENSORS = {"draft_ids": "d2t", "draft_head": "lm_head.weight"}  # the drafter's buffers -> the file's names
ARCH_FIELDS = {  # DrafterConfig field -> the parameter a user changes to match it (init_from refusals)
    "hidden_size": "hidden_size", "num_layers": "drafter_layers", "num_heads": "num_attention_heads of the target",
    "num_kv_heads": "num_key_value_heads of the target", "head_dim": "head_dim of the target",
    "intermediate_size": "intermediate_size of the target", "vocab_size": "vocab_size of the target",
    "target_layer_ids": "target_layer_ids", "target_num_layers": "target_layers",
    "rms_norm_eps": "rms_norm_eps of the target", "rope_theta": "rope_theta of the target",
}


# -- writing -------------------------------------------------------------------------------------------------
def vllm_aux_layer_ids(target_layer_ids: list[int]) -> list[int]:
    """`eagle_aux_hidden_state_layer_ids` of 0-based target layers: vLLM numbers the residual stream by layer
    boundary (0 = the embeddings, j = the output of decoder layer j - 1), so layer id i is boundary i + 1."""
    return [int(i) + 1 for i in target_layer_ids]


def serving_config(cfg: DrafterConfig, dtype: torch.dtype, max_position_embeddings: int,
                   training: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json of a drafter `cfg` stored in `dtype`; `training`: dflash_config.training's record beside the
    training settings of `cfg`."""
    L = cfg.num_layers
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    doc = {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": L,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        # rope_theta + rope_scaling: what older transformers/SGLang read; rope_parameters: transformers >= 5
        "rope_theta": cfg.rope_theta, "rope_scaling": None, "rope_parameters": rope,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": int(max_position_embeddings),
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "initializer_range": cfg.initializer_range, "use_cache": True,
        # sliding layers (vLLM's DFlash takes the window from `sliding_window`); all full: none
        "use_sliding_window": bool(cfg.sliding_window), "sliding_window": cfg.sliding_window or None,
        "max_window_layers": L, "layer_types": list(cfg.layer_types) or ["full_attention"] * L,
        "block_size": cfg.block_size, "num_target_layers": cfg.target_num_layers,
        "eagle_aux_hidden_state_layer_ids": vllm_aux_layer_ids(cfg.target_layer_ids),
        "dflash_config": {"mask_token_id": cfg.mask_id, "target_layer_ids": list(cfg.target_layer_ids),
                          "block_size": cfg.block_size,
                          "training": {**{k: getattr(cfg, k) for k in TRAINING_KEYS}, **(training or {})}},
        "torch_dtype": DTYPE_NAMES[dtype], "dtype": DTYPE_NAMES[dtype],
        "transformers_version": transformers.__version__,
        # a draft vocabulary: vLLM's own lm_head of N rows and d2t (target id = draft id + d2t[draft id])
        **({"draft_vocab_size": cfg.draft_vocab_size} if cfg.draft_vocab_size else {}),
    }
    return write_causality(doc, cfg.layer_types, cfg.layer_causal, NESTED_FIELD)  # dflash_config.causal


def trained_as(cfg: DrafterConfig, weights_sha256: str) -> dict[str, Any]:
    """What the engines read that training fixed, as the export wrote it: the fused target layers, the MASK id,
    the block size, the layers' causality and the weights file's SHA-256 (the doctor's `trained_as` and `causality`
    rules compare the folder with it)."""
    return {"target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_id,
            "block_size": cfg.block_size, "layer_causal": cfg.layer_causal, "weights_sha256": weights_sha256}


def training(doc: dict[str, Any]) -> dict[str, Any]:
    """dflash_config.training of a config.json less the training settings `serving_config` writes from a config."""
    return {k: v for k, v in doc["dflash_config"].get("training", {}).items() if k not in TRAINING_KEYS}


def readme(doc: dict[str, Any]) -> str:
    t = doc["dflash_config"]["training"]
    target = t.get("target", {})
    ids = doc["dflash_config"]["target_layer_ids"]
    return "\n".join([
        "# DFlash drafter", "",
        f"Trained for the target **{target.get('name') or 'unknown'}** ({target.get('model_type', '?')}, "
        f"{doc['num_target_layers']} layers, hidden size {doc['hidden_size']}, vocabulary {doc['vocab_size']}), "
        f"with the chat template **{t.get('template') or 'unknown'}**. Serve it only with that target and template: "
        "another template collapses acceptance.", "",
        f"- {doc['num_hidden_layers']} draft layers, block size {doc['block_size']}, mask token id "
        f"{doc['dflash_config']['mask_token_id']}, target layers {ids} (0-based; hidden_states[id + 1]).",
        f"- Weights: {WEIGHTS_FILE} in {doc['torch_dtype']}; no embedding (the target's is used); " + (
            f"an LM head of the {doc['draft_vocab_size']} target tokens `d2t` maps to (the target's rows)."
            if doc.get("draft_vocab_size") else "no LM head (the target's is used)."),
        f"- Source: {t.get('source') or 'unknown'}.", "",
        "Load it in SGLang with `--speculative-algorithm DFLASH --speculative-draft-model-path <this folder>`, "
        "or fine-tune it with `python -m dflash_lib train -p init_from <this folder>`.", ""])


# -- reading -------------------------------------------------------------------------------------------------
def check_doc(doc: dict[str, Any], path: Path) -> None:
    """Refuse a config.json (at `path`) whose fields this drafter does not implement, naming the field."""
    unsupported = {"model_type": (doc.get("model_type"), MODEL_TYPE),
                   "attention_bias": (doc.get("attention_bias", False), False),
                   "hidden_act": (doc.get("hidden_act", "silu"), "silu")}
    kinds = set(engine_layer_types(doc) or ["full_attention"])
    if not kinds <= {"full_attention", "sliding_attention"}:
        unsupported["layer_types"] = (sorted(kinds), ["full_attention", "sliding_attention"])
    if "sliding_attention" in kinds and not isinstance(engine_window(doc), int):
        raise ConfigError(f"{path}: layer_types has sliding_attention layers but their window (dflash_config."
                          f"swa_window_size, else sliding_window) is {engine_window(doc)!r}, not a whole number of "
                          "positions")
    if (doc.get("dflash_config") or {}).get("use_swa"):
        raise ConfigError(f"{path}: dflash_config.use_swa is not supported (it makes vLLM run every layer sliding "
                          "whatever layer_types says)")
    for field in FIELDS:  # vLLM reads bool(value): the string "false" would be causal
        if not isinstance(field_value(doc, field), (bool, type(None))):
            raise ConfigError(f"{path}: {field} {field_value(doc, field)!r} is not true, false or null")
    rope_type = (doc.get("rope_parameters") or doc.get("rope_scaling") or {}).get("rope_type", "default")
    unsupported["rope_type"] = (rope_type, "default")
    for key, (got, want) in unsupported.items():
        if got != want:
            raise ConfigError(f"{path}: {key} {got!r} is not supported (this drafter implements {want!r})")
    dc = doc.get("dflash_config")
    if not isinstance(dc, dict):
        raise ConfigError(f"{path}: no dflash_config object")
    for key in ("mask_token_id", "target_layer_ids"):
        if key not in dc:
            raise ConfigError(f"{path}: dflash_config.{key} is missing (it must be explicit: the loaders' "
                              "fallback guesses wrong layers)")


def read_config(doc: dict[str, Any], where: str = CONFIG_FILE) -> DrafterConfig:
    """DrafterConfig from a serving config.json `doc`; training settings default when the folder has none."""
    dc = doc["dflash_config"]
    rope = doc.get("rope_parameters") or {}
    try:
        heads = int(doc["num_attention_heads"])
        return DrafterConfig(
            hidden_size=int(doc["hidden_size"]), num_layers=int(doc["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(doc.get("num_key_value_heads") or heads),
            head_dim=int(doc.get("head_dim") or int(doc["hidden_size"]) // heads),
            intermediate_size=int(doc["intermediate_size"]), vocab_size=int(doc["vocab_size"]),
            target_layer_ids=[int(i) for i in dc["target_layer_ids"]],
            target_num_layers=int(doc["num_target_layers"]),
            block_size=int(dc.get("block_size", doc.get("block_size", 0))), mask_id=int(dc["mask_token_id"]),
            rms_norm_eps=float(doc.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", doc.get("rope_theta", 1_000_000.0))),
            **_layer_kinds(doc), causal=override_of(doc), draft_vocab_size=_draft_vocab_size(doc),
            **{k: v for k, v in (dc.get("training") or {}).items() if k in TRAINING_KEYS},
        )
    except KeyError as e:
        raise ConfigError(f"{where}: required field {e.args[0]!r} is missing") from None


def _draft_vocab_size(doc: dict[str, Any]) -> int:
    """N of a draft vocabulary (config.json's draft_vocab_size below vocab_size), else 0."""
    n = int(doc.get("draft_vocab_size") or 0)
    return n if n < int(doc["vocab_size"]) else 0


def _layer_kinds(doc: dict[str, Any]) -> dict[str, Any]:
    """DrafterConfig's layer_types and sliding_window from a config.json, the kinds as vLLM's config holds them
    (`causality.engine_layer_types`): none for an all-full drafter."""
    kinds = engine_layer_types(doc)
    if "sliding_attention" not in kinds:
        return {}
    return dict(layer_types=kinds, sliding_window=int(engine_window(doc)))


def engine_window(doc: dict[str, Any]) -> Any:
    """The window vLLM gives a config.json's sliding layers: dflash_config.swa_window_size when present, else the
    top-level sliding_window as transformers' Qwen3Config holds it (None unless use_sliding_window is set; vLLM
    0.32's `qwen3_dflash` then refuses to start)."""
    dc = doc.get("dflash_config") if isinstance(doc.get("dflash_config"), dict) else {}
    return dc.get("swa_window_size", doc.get("sliding_window") if doc.get("use_sliding_window") else None)


KIND = DrafterKind(
    name="dflash", architectures=(ARCHITECTURE,), model_type=MODEL_TYPE, config_class=DrafterConfig,
    module_class=DFlashDrafter, serving_config=serving_config, check_doc=check_doc, read_config=read_config,
    trained_as=trained_as, training=training, readme=readme, tensors=TENSORS, dtypes=DTYPE_NAMES,
    arch_fields=ARCH_FIELDS)
