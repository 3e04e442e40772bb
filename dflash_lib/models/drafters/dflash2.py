"""The `dflash2` drafter kind: `DFlash2Drafter` (models/dflash2.py) served as vLLM's `DFlash2DraftModel`: the
dflash kind's config.json (drafters/dflash.py) with the DFlash2 fields in `dflash_config`, the causality stated by
the top-level `is_causal` (z-lab's DFlash2 convention; vLLM reads it first), and the tensors
`layers.i.{attention,mlp}_conv.{base_kernel,kernel_projection.weight}` and
`candidate_selector.{predecessor_codebook,successor_codebook,hidden_projection.weight}`. The fields:
docs/serving.md, "Export for serving".
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from dflash_lib.config import ConfigError
from dflash_lib.models.causality import TOP_FIELD, write_causality
from dflash_lib.models.dflash2 import DFlash2Config, DFlash2Drafter
from dflash_lib.models.drafters import dflash
from dflash_lib.models.drafters.kind import DrafterKind

ARCHITECTURE = "DFlash2DraftModel"  # what vLLM dispatches on (its qwen3_dflash2 module)
SERVED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # dflash_config: engine reads
SCALES = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": 0.0}  # and defaults
TRAINING_KEYS = ("selector_weight", "selector_warmup")  # dflash_config.training, beside the dflash kind's


def serving_config(cfg: DFlash2Config, dtype: torch.dtype, max_position_embeddings: int,
                   training: dict[str, Any] | None = None) -> dict[str, Any]:
    """The dflash kind's config.json with the DFlash2 architecture and fields."""
    doc = dflash.serving_config(cfg, dtype, max_position_embeddings, training)
    doc["architectures"] = [ARCHITECTURE]
    write_causality(doc, list(cfg.layer_types), cfg.layer_causal, TOP_FIELD)  # DFlash2's convention (z-lab's)
    dc = doc["dflash_config"]
    dc.update({k: getattr(cfg, k) for k in (*SERVED, *SCALES)})
    dc["training"].update({k: getattr(cfg, k) for k in TRAINING_KEYS})
    return doc


def check_doc(doc: dict[str, Any], path: Path) -> None:
    """The dflash kind's refusals, a DFlash2 field missing, and a draft vocabulary (the candidate walk has no d2t)."""
    dflash.check_doc(doc, path)
    dc = doc["dflash_config"]
    for key in SERVED:
        if key not in dc:
            raise ConfigError(f"{path}: dflash_config.{key} is missing (a DFlash2DraftModel needs it)")
    if dflash._draft_vocab_size(doc):
        raise ConfigError(f"{path}: draft_vocab_size {doc['draft_vocab_size']} on a DFlash2DraftModel: vLLM's "
                          "candidate walk returns head rows as token ids with no d2t map")


def read_config(doc: dict[str, Any], where: str = "config.json") -> DFlash2Config:
    """DFlash2Config from a serving config.json `doc`."""
    base = dflash.read_config(doc, where)
    dc, training = doc["dflash_config"], doc["dflash_config"].get("training") or {}
    try:
        return DFlash2Config(**dataclasses.asdict(base), **{k: int(dc[k]) for k in SERVED},
                             **{k: float(dc.get(k) or v) for k, v in SCALES.items()},
                             **{k: training[k] for k in TRAINING_KEYS if k in training})
    except KeyError as e:
        raise ConfigError(f"{where}: required field dflash_config.{e.args[0]} is missing") from None


def training(doc: dict[str, Any]) -> dict[str, Any]:
    """dflash_config.training less what `serving_config` writes from a config."""
    return {k: v for k, v in dflash.training(doc).items() if k not in TRAINING_KEYS}


def readme(doc: dict[str, Any]) -> str:
    dc = doc["dflash_config"]
    text = dflash.readme(doc).replace("# DFlash drafter", "# DFlash2 drafter", 1)
    extra = (f"- DFlash2: block convolutions of {dc['conv_kernel_size']} taps over groups of {dc['conv_group_size']} "
             f"channels around each sublayer; a candidate selector reranking the head's top {dc['selector_top_k']} "
             f"with rank-{dc['selector_rank']} codebooks.\n")
    return text.replace("- Weights:", extra + "- Weights:", 1).replace(
        "--speculative-algorithm DFLASH", "--speculative-algorithm DFLASH (a DFlash2DraftModel)", 1)


KIND = dataclasses.replace(
    dflash.KIND, name="dflash2", architectures=(ARCHITECTURE,), config_class=DFlash2Config,
    module_class=DFlash2Drafter, serving_config=serving_config, check_doc=check_doc, read_config=read_config,
    training=training, readme=readme,
    arch_fields={**dflash.ARCH_FIELDS, "conv_kernel_size": "conv_kernel_size", "conv_group_size": "conv_group_size",
                 "selector_rank": "selector_rank"})
