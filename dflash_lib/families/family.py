"""The target-family record: what the library declares of one family of target models, once: the config.json
`model_type` values it answers to, what the engine's rules read of it, its published shapes and its named presets.
The families and `family_of`: families/__init__.py; how to add one: docs/architecture.md, "How to add a target
family". Nothing here imports torch or transformers: the settings (config.py) read the presets from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class TargetFamily:
    """One family of target models (a text model's architecture, whatever its size)."""

    name: str  # the family's name: its text model's model_type
    model_types: tuple[str, ...]  # config.json `model_type` values of its text model and of a wrapper around it
    linear_attention: bool = False  # gated-delta-net layers between full attention: vLLM serves it by its hybrid
    # model, in bf16 on CPU and without prefix caching (serve/vllm.py)
    shapes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # `-p target NAME` -> the published
    # config.json fields of that model (model_type included; built by models/shapes.py, no weights)
    presets: Mapping[str, Callable[[], dict[str, Any]]] = field(default_factory=dict)  # `--preset NAME` -> its flat
    # parameters (config.py makes the Config)
