import dataclasses

import pytest

from dflash_lib import config as C


def test_flat_keys_unique_and_complete():
    cfg = C.Config()
    flat = cfg.to_params()
    n_fields = sum(len(dataclasses.fields(cls)) for cls in C.SECTION_CLASSES.values())
    assert len(flat) == n_fields == len(C.FLAT_FIELDS)
    assert C.from_params(flat) == cfg


@pytest.mark.parametrize("name", sorted(C.PRESETS))
def test_presets_still_match_the_code(name):
    cfg = C.preset(name)
    # a preset survives a round trip through flat parameters and validation unchanged
    assert C.from_params(cfg.to_params()) == cfg
    assert cfg.hash() == C.from_params(cfg.to_params()).hash()


def test_cli_strings_are_parsed_by_field_type():
    assert C.coerce("steps", "20") == 20
    assert C.coerce("lr", "1e-3") == pytest.approx(1e-3)
    assert C.coerce("lr", 1) == 1.0 and isinstance(C.coerce("lr", 1), float)
    assert C.coerce("edges", "[770, 1216, 8192]") == [770, 1216, 8192]
    assert C.coerce("source", "data/x.jsonl") == "data/x.jsonl"
    assert C.from_params({"steps": "7"}).train.steps == 7


@pytest.mark.parametrize(
    "params, message",
    [
        ({"stepz": 3}, "unknown parameter 'stepz'"),
        ({"steps": 1.5}, "parameter 'steps' must be int"),
        ({"steps": True}, "parameter 'steps' must be int"),
        ({"lr": "fast"}, "parameter 'lr': cannot parse"),
        ({"edges": [1, "a"]}, "parameter 'edges' must be int"),
        ({"edges": 5}, "parameter 'edges' must be a list"),
        ({"policy": "clip"}, "policy must be one of"),
        ({"cost": "quadratic"}, "needs q > 0"),
        ({"k_min": 5, "k_max": 2}, "k_max (2) must be >= k_min (5)"),
        ({"block_size": 1}, "block_size must be >= 2"),
        ({"edges": [10, 5]}, "strictly ascending"),
        ({"noise": 0.0}, "noise must be in (0, 1]"),
    ],
)
def test_bad_parameters_are_refused_naming_the_key(params, message):
    with pytest.raises(C.ConfigError) as e:
        C.from_params(params)
    assert message in str(e.value)


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(C.ConfigError, match="smoke"):
        C.preset("nope")


def test_hash_changes_with_any_setting():
    assert C.Config().hash() != C.from_params({"lr": 1e-4}).hash()
    assert C.Config().hash() == C.Config().hash()
