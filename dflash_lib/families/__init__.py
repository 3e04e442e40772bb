"""Target families, each declared once as a `TargetFamily` (family.py): the families the library trains and tests
(tests/test_target_families.py), their published shapes and named presets (qwen3.py, qwen3_5.py).
`family_of(hf_config)` finds a target's family; `text_config` is the text model of a vision-language wrapper.
How to add a family: docs/architecture.md, "How to add a target family".
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from dflash_lib.families.family import TargetFamily
from dflash_lib.families.qwen3 import QWEN3, QWEN3_MOE
from dflash_lib.families.qwen3_5 import QWEN3_5, QWEN3_5_MOE

__all__ = ["FAMILIES", "TargetFamily", "family_of", "named_presets", "named_shapes", "registry", "text_config"]


def registry(*families: TargetFamily) -> dict[str, TargetFamily]:
    """{model_type: family} of every model_type the families declare, refusing two families that share a name, a
    model_type, a shape name or a preset name (each is looked up by it)."""
    for what, keys in (("name", [f.name for f in families]),
                       ("model_type", [t for f in families for t in f.model_types]),
                       ("shape", [s for f in families for s in f.shapes]),
                       ("preset", [p for f in families for p in f.presets])):
        doubled = sorted({key for key in keys if keys.count(key) > 1})
        if doubled:
            raise RuntimeError(f"dflash_lib/families: two target families share the {what} {doubled[0]!r}")
    return {t: f for f in families for t in f.model_types}


FAMILIES: dict[str, TargetFamily] = registry(  # by model_type
    TargetFamily("llama", ("llama",)),
    TargetFamily("mistral", ("mistral",)),
    TargetFamily("qwen2", ("qwen2",)),
    QWEN3, QWEN3_MOE, QWEN3_5, QWEN3_5_MOE,
    TargetFamily("qwen3_next", ("qwen3_next",), linear_attention=True),
    TargetFamily("gpt_oss", ("gpt_oss",)),
    TargetFamily("gemma4", ("gemma4_text", "gemma4")),
    TargetFamily("deepseek_v3", ("deepseek_v3",)),
    TargetFamily("minimax_m2", ("minimax_m2",)),
)


def text_config(cfg: Any) -> Any:
    """The text model of a target's config: a vision-language wrapper's text config (Qwen3.5's checkpoints: the text
    weights under model.language_model.*, so the causal LM is the text model alone and the vision tower's weights
    are never built), else `cfg` itself. `cfg`: a transformers config (its `get_text_config()`) or a config.json
    document (its "text_config" object); anything else as it is."""
    if isinstance(cfg, Mapping):
        inner = cfg.get("text_config")
        return inner if isinstance(inner, Mapping) else cfg
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def family_of(hf_config: Any) -> TargetFamily:
    """The family of a target's config (a transformers config or a config.json document; a wrapper's text model),
    found by its model_type; a family not declared here is an empty record of that name (whether its layers run is
    target/local.py's rule, not a declaration)."""
    text = text_config(hf_config)
    mtype = text.get("model_type") if isinstance(text, Mapping) else getattr(text, "model_type", None)
    mtype = mtype if isinstance(mtype, str) else ""
    return FAMILIES.get(mtype) or TargetFamily(mtype, (mtype,))


def _unique() -> list[TargetFamily]:
    """Every declared family once, in declaration order."""
    return list({id(f): f for f in FAMILIES.values()}.values())


def named_shapes() -> dict[str, Mapping[str, Any]]:
    """{`-p target` name: published config.json fields} of every family's shapes."""
    return {name: fields for f in _unique() for name, fields in f.shapes.items()}


def named_presets() -> dict[str, Callable[[], dict[str, Any]]]:
    """{`--preset` name: its flat parameters' function} of every family's presets."""
    return {name: params for f in _unique() for name, params in f.presets.items()}
