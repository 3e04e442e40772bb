"""The target's facts, read once from its config (`read_facts`) into the record every source of features takes:
its Hugging Face config, layer count and kinds, width, vocabulary, whether the LM head is the embedding, and the
feature layers the drafter reads (`models.target_config.chosen_layer_ids`; what an engine hands over of them, and of the
last layer for a loss reading the target's final states, in vLLM's numbering: `engine_layers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import transformers

from dflash_lib.config import ConfigError
from dflash_lib.models.target_config import chosen_layer_ids, target_hf_config
from dflash_lib.serve.hidden_states import engine_layer_ids, engine_pick

if TYPE_CHECKING:
    from dflash_lib.config import ModelConfig


@dataclass(frozen=True)
class TargetFacts:
    """What a run knows of its target before a weight is read: one record, read once (`read_facts`)."""

    target: str  # `model.target`: "tiny", a named shape, or a local Hugging Face folder
    hf: transformers.PretrainedConfig  # its config (the text model's for a vision-language wrapper)
    num_layers: int  # decoder layers
    hidden_size: int  # H: width of one layer's output
    vocab_size: int  # V: rows of the embedding and of the LM head
    layer_kinds: tuple[str, ...]  # per decoder layer: "full_attention" | "sliding_attention" | "linear_attention"
    layer_ids: tuple[int, ...]  # the F feature layers (0-based), in concatenation order
    tied_head: bool  # the LM head is the input embedding (`tie_word_embeddings`)

    @property
    def num_features(self) -> int:
        return len(self.layer_ids)

    def engine_layers(self, final: bool = False) -> list[int]:
        """What the engine's files hold, in vLLM's numbering, sorted and unique: the feature layers and, with
        `final` (loss kl / ce+kl), the last layer (its output before the final norm)."""
        return engine_layer_ids(self._held(final))

    def engine_pick(self, final: bool = False) -> torch.Tensor:
        """(F,) int64: the layer of an engine file (`engine_layers(final)`) that holds each feature layer."""
        return engine_pick(self.layer_ids, self._held(final))

    def engine_last(self) -> int:
        """The layer of an engine file (`engine_layers(True)`) that holds the last layer's output."""
        return int(engine_pick([self.num_layers - 1], self._held(True))[0])

    def _held(self, final: bool) -> list[int]:
        return [*self.layer_ids, *([self.num_layers - 1] if final else [])]


def read_facts(cfg: "ModelConfig") -> TargetFacts:
    """The facts of `cfg.target` (`models.target_config.target_hf_config`: config.json only) and its feature layers
    (`cfg.target_layer_ids`, else the rule of docs/dflash.md). ConfigError when an id is outside the target."""
    hf = target_hf_config(cfg)
    num_layers = int(hf.num_hidden_layers)
    ids = [int(i) for i in chosen_layer_ids(cfg.target_layer_ids, num_layers, cfg.num_features)]
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad or not ids:
        raise ConfigError(f"target layer ids {ids}: {bad or 'none given'} outside [0, {num_layers})")
    kinds = tuple(getattr(hf, "layer_types", None) or ["full_attention"] * num_layers)
    return TargetFacts(str(cfg.target), hf, num_layers, int(hf.hidden_size), int(hf.vocab_size), kinds, tuple(ids),
                       bool(getattr(hf, "tie_word_embeddings", False)))
