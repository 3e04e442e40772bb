"""Published model shapes, no weights: the transformers configs the dry run and the plan build when no model
folder is at hand (`-p target NAME`), from the config.json fields each family declares (dflash_lib/families/:
qwen3.py, qwen3_5.py), attention by SDPA."""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Mapping

import transformers

from dflash_lib.families import named_shapes


def shape_config(fields: Mapping[str, Any]) -> transformers.PretrainedConfig:
    """The transformers config of published config.json `fields` (the class of their model_type), a copy of them."""
    kw = copy.deepcopy(dict(fields))
    return transformers.CONFIG_MAPPING[kw.pop("model_type")](**kw, attn_implementation="sdpa")


NAMED_SHAPES: dict[str, Callable[[], transformers.PretrainedConfig]] = {  # `target` values naming shapes only
    name: functools.partial(shape_config, fields) for name, fields in named_shapes().items()}
