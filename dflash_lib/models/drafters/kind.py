"""The drafter-kind interface: what one kind of drafter (`-p drafter_kind NAME`) declares, once, for every site
that builds it or writes and reads its serving folder: the trainer's build, the dry run, the evaluation, the engine
check, export, `read_drafter` and `init_from` (models/export.py); the doctor takes its names. The kinds:
models/drafters/__init__.py; how to add one: docs/architecture.md, "How to add a drafter kind".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

CONFIG_FILE, WEIGHTS_FILE, README_FILE = "config.json", "model.safetensors", "README.md"  # a serving folder's files


@dataclass(frozen=True)
class DrafterKind:
    """One drafter kind: its module and its serving format (config.json fields, tensor names, dtypes)."""

    name: str  # the drafter_kind setting's value
    architectures: tuple[str, ...]  # config.json `architectures` the engines dispatch on (the first is written)
    model_type: str  # config.json `model_type` written beside them
    config_class: type  # its config dataclass: `config_class.from_model_config(ModelConfig, target)`
    module_class: type  # its nn.Module: `module_class(cfg, target, attention, checkpointing)`
    serving_config: Callable[..., dict[str, Any]]  # (cfg, dtype, max positions, training record) -> config.json
    check_doc: Callable[[dict[str, Any], Path], None]  # refuse a config.json it cannot run (ConfigError naming it)
    read_config: Callable[[dict[str, Any], str], Any]  # a checked config.json -> config_class (errors name `where`)
    trained_as: Callable[[Any, str], dict[str, Any]]  # (cfg, the weights' SHA-256) -> what the doctor compares
    training: Callable[[dict[str, Any]], dict[str, Any]]  # config.json's training record, less what cfg rewrites
    readme: Callable[[dict[str, Any]], str]  # README.md of a config.json
    tensors: Mapping[str, str]  # buffers saved with the weights -> their file names (parameters keep their own)
    dtypes: Mapping[torch.dtype, str]  # dtypes its weights may be stored in -> config.json's torch_dtype
    arch_fields: Mapping[str, str]  # config fields the weights' shapes fix -> the setting that changes each

    def build(self, model: Any, target: Any, attention: str = "auto", checkpointing: bool | int = False) -> Any:
        """A fresh drafter of this kind for the model section `model` on `target` (weights from torch's seed)."""
        return self.module_class(self.config_class.from_model_config(model, target), target, attention, checkpointing)
