"""Whether each draft layer attends causally inside its block: vLLM's reading of a drafter's config.json
(`engine_causal`) and the fields that make it read what a drafter trained (`write_causality`, the one call a kind's
`serving_config` makes). The rules, where vLLM resolves them and the masks they give: docs/dflash.md ("The
drafter", causal and non-causal layers).

vLLM 0.32 (`qwen3_dflash._dflash_layer_causal`), per layer: a top-level `is_causal` that is not null decides every
layer, else a `dflash_config.causal` that is not null does, else a `sliding_attention` layer is causal and any
other is not, and no layer kinds at all make every layer non-causal. A value is read as Python's `bool(value)`.
"""

from __future__ import annotations

from typing import Any

from dflash_lib.config import ConfigError

TOP_FIELD = "is_causal"  # top level: decides every layer, read first (z-lab's DFlash2 writes it)
NESTED_FIELD = "dflash_config.causal"  # decides every layer when is_causal is absent or null (the dflash kind's)
FIELDS = (TOP_FIELD, NESTED_FIELD)  # vLLM's order: the first one set wins
SLIDING = "sliding_attention"


def default_causal(layer_types: list[str], num_layers: int) -> list[bool]:
    """vLLM's rule without an override, per layer of `num_layers`: sliding_attention causal, any other kind not;
    no layer kinds (empty): none causal."""
    if not layer_types:
        return [False] * num_layers
    return [kind == SLIDING for kind in layer_types]


def layer_causal(layer_types: list[str], num_layers: int, override: bool | None) -> list[bool]:
    """Per layer: attends causally inside its block. `override` True / False sets every layer, None leaves each
    to `default_causal`."""
    return [override] * num_layers if override is not None else default_causal(layer_types, num_layers)


def field_value(doc: dict[str, Any], field: str) -> Any:
    """The value of `field` (TOP_FIELD or NESTED_FIELD) in config.json `doc`; None when absent."""
    if field == TOP_FIELD:
        return doc.get(TOP_FIELD)
    section = doc.get("dflash_config")
    return section.get("causal") if isinstance(section, dict) else None


def override_of(doc: dict[str, Any]) -> bool | None:
    """The value every layer takes, read as vLLM reads it (the first of FIELDS that is not null, as bool), or
    None when neither is set."""
    for field in FIELDS:
        value = field_value(doc, field)
        if value is not None:
            return bool(value)
    return None


def engine_layer_types(doc: dict[str, Any]) -> list[str]:
    """The layer kinds vLLM's Qwen3 config holds for `doc`: its `layer_types` when present (even empty), else
    transformers' Qwen3Config default: sliding_attention from layer `max_window_layers` (default 28) on when
    `use_sliding_window` is set and `sliding_window` (default 4096) is not null, full_attention before."""
    if doc.get("layer_types") is not None:
        return [str(kind) for kind in doc["layer_types"]]
    windowed = bool(doc.get("use_sliding_window", False)) and doc.get("sliding_window", 4096) is not None
    first = int(doc.get("max_window_layers", 28))
    layers = int(doc.get("num_hidden_layers") or 0)
    return [SLIDING if windowed and i >= first else "full_attention" for i in range(layers)]


def engine_causal(doc: dict[str, Any]) -> list[bool]:
    """Per draft layer of config.json `doc`: whether vLLM runs it causal inside its block."""
    return layer_causal(engine_layer_types(doc), int(doc["num_hidden_layers"]), override_of(doc))


def write_causality(doc: dict[str, Any], layer_types: list[str], causal: list[bool], field: str) -> dict[str, Any]:
    """Make config.json `doc` (edited in place and returned) state the per-layer `causal` of a drafter with
    `layer_types`: `field` (one of FIELDS) set for every layer alike, the explicit form, and the other field
    removed; nothing set where the layers differ as vLLM's default has them (sliding causal, full not). Any other
    pattern has no config.json form: ConfigError."""
    if field not in FIELDS:
        raise ConfigError(f"causality field {field!r} is not one vLLM reads ({' or '.join(FIELDS)})")
    if isinstance(doc.get("dflash_config"), dict):
        doc["dflash_config"].pop("causal", None)
    doc.pop(TOP_FIELD, None)
    if len(set(causal)) == 1:
        if field == TOP_FIELD:
            doc[TOP_FIELD] = causal[0]
        else:
            doc.setdefault("dflash_config", {})["causal"] = causal[0]
    elif causal != default_causal(layer_types, len(causal)):
        raise ConfigError(f"causal layers {causal} with layer_types {layer_types}: config.json states every layer "
                          "causal, none, or sliding layers causal and full ones not (vLLM's default)")
    return doc
