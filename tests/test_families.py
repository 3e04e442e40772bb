"""The target families (dflash_lib/families/): `family_of` finds each tested family's record through a
vision-language wrapper, and the engine's linear-attention rule reads the record."""

from __future__ import annotations

import pytest
import transformers

from dflash_lib import families
from dflash_lib.families import TargetFamily, family_of, text_config
from test_target_families import FAMILIES as TESTED

VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)


@pytest.mark.parametrize("name", sorted(TESTED))
def test_every_tested_family_is_declared_and_found_by_its_config(name):
    """Each family tests/test_target_families.py trains is a declared record of that name, found from its
    transformers config and from the same config as a config.json document; gated-delta-net layers iff declared."""
    cfg = TESTED[name]()
    found = family_of(cfg)
    assert found.name == name and found is family_of(cfg.to_dict()) and cfg.model_type in families.FAMILIES
    assert found.linear_attention == ("linear_attention" in (getattr(cfg, "layer_types", None) or ()))


def test_a_vision_language_wrapper_is_its_text_models_family():
    """Qwen3.5's checkpoints wrap the text model (model_type qwen3_5, the text config inside): the family and the
    text config are the text model's, from the transformers config and from its config.json alike."""
    text = TESTED["qwen3_5"]()
    wrapper = transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=VISION)
    doc = wrapper.to_dict()
    assert wrapper.model_type == doc["model_type"] == "qwen3_5"
    assert text_config(wrapper).model_type == text_config(doc)["model_type"] == "qwen3_5_text"
    assert text_config(doc) is doc["text_config"] and text_config(text) is text
    assert family_of(wrapper) is family_of(doc) is family_of(text) is families.FAMILIES["qwen3_5_text"]


def test_an_undeclared_family_is_an_empty_record_of_its_name():
    """A model type no family declares still runs when its layers do (target/local.py): its record declares
    nothing, whatever it is given."""
    assert family_of({"model_type": "olmo2"}) == TargetFamily("olmo2", ("olmo2",))
    assert family_of({"model_type": 3}).name == family_of(["not", "a", "config"]).name == ""
    assert not family_of({"model_type": "olmo2"}).linear_attention


def test_two_families_sharing_a_model_type_or_a_preset_are_refused():
    with pytest.raises(RuntimeError, match="two target families share the model_type 'qwen3'"):
        families.registry(TargetFamily("a", ("qwen3",)), TargetFamily("b", ("x", "qwen3")))
    with pytest.raises(RuntimeError, match="two target families share the preset 'p'"):
        families.registry(TargetFamily("a", ("a",), presets={"p": dict}),
                          TargetFamily("b", ("b",), presets={"p": dict}))


def _declared() -> list[TargetFamily]:
    return list({id(f): f for f in families.FAMILIES.values()}.values())


def test_each_family_holds_its_shapes_and_presets_and_the_settings_find_them():
    """A published shape is built as its own family's config, each family preset trains on one of its family's
    shapes, and the settings' registry holds the generic presets and exactly the families' others."""
    from dflash_lib import config
    from dflash_lib.models.shapes import NAMED_SHAPES

    assert sorted(NAMED_SHAPES) == sorted(families.named_shapes()) and len(NAMED_SHAPES) == 8
    assert sorted(config.PRESETS) == sorted(["smoke", "demo", "default", *families.named_presets()])
    for family in _declared():
        for name in family.shapes:
            assert family_of(NAMED_SHAPES[name]()) is family, name
        for name in family.presets:
            assert config.preset(name).model.target in family.shapes, name


def test_a_built_shape_shares_no_list_with_the_declaration():
    """Each build is a fresh config: changing one's layer kinds changes neither the declaration nor the next one."""
    from dflash_lib.models.shapes import NAMED_SHAPES

    first = NAMED_SHAPES["qwen3.5-9b"]()
    first.layer_types[0] = "full_attention"
    assert NAMED_SHAPES["qwen3.5-9b"]().layer_types[0] == "linear_attention"
    assert families.named_shapes()["qwen3.5-9b"]["layer_types"][0] == "linear_attention"
