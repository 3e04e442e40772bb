import dataclasses
import typing

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
        ({"lr": "1e9"}, "lr must be in (0, 1], got 1000000000.0"),  # a typo, not a learning rate
        ({"lr": 0.0}, "lr must be in (0, 1], got 0.0"),
        ({"precision": "fp16"}, "precision must be one of ['auto', 'bf16', 'fp32'], got 'fp16'"),
        ({"drafter_layer_types": ["sliding_attention"]}, "drafter_window must be >= 1, got 0"),
        ({"drafter_window": 4}, "drafter_window 4 is set but no drafter layer is sliding_attention"),
        ({"drafter_layer_types": ["full_attention"] * 2}, "names 2 layers but drafter_layers is 1"),
        ({"drafter_layer_types": ["local"]}, "drafter_layer_types ['local'] are not drafter layer kinds"),
        ({"drafter_causal": "bidirectional"}, "drafter_causal must be one of ['auto', 'causal', 'non_causal']"),
    ],
)
def test_bad_parameters_are_refused_naming_the_key(params, message):
    with pytest.raises(C.ConfigError) as e:
        C.from_params(params)
    assert message in str(e.value)


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(C.ConfigError, match="smoke"):
        C.preset("nope")


# A valid value besides the default, for the flat fields whose generic change (see _other) validation refuses.
OTHER_VALUE = {"policy": "drop", "objective": "batch_max", "cost": "quadratic", "strategy": "random",
               "device": "cpu", "wandb_mode": "disabled", "attn_backend": "sdpa", "drafter_attention": "dense",
               "drafter_checkpointing": "true", "edges": [8, 16], "target_layer_ids": [0, 1],
               "thinking": "on", "backend": "openai", "top_p": 0.5, "base_url": "http://127.0.0.1:1/v1",
               "parallel": "fsdp", "target_parallel": "fsdp",
               "regen_leading_assistant": "skip", "regen_on_error": "abort",
               "prompts_from": "humaneval", "enable_thinking": "on", "engine": "vllm",
               "engine_url": "http://127.0.0.1:1"}
OTHER_VALUE |= {"loss": "kl", "position_weight": "dpace"}  # issue 25 part 4 (the loss settings)
OTHER_VALUE |= {"loss_weighting": "document"}  # issue 52 (each conversation weighs alike)
OTHER_VALUE |= {"precision": "bf16", "drafter_layer_types": ["full_attention"]}
OTHER_VALUE |= {"target_engine": "vllm", "target_engine_url": "http://127.0.0.1:1"}  # issue 40
OTHER_VALUE |= {"optimizer": "muon", "lr_schedule": "wsd"}  # issue 52 (the levers)
OTHER_VALUE |= {"drafter_kind": "dflash2"}  # issue 54
OTHER_VALUE |= {"drafter_causal": "non_causal"}  # issue 54 (causality as the engines apply it)
OTHER_VALUE |= {"hidden_cache_dtype": "float8_e4m3fn"}  # issue 55 (the capture on a real disk)
BY_HAND = {"target": "models/t", "target_engine": "vllm", "target_engine_url": "http://e:1", "target_engine_dir": "/e"}
COUPLED = {"drafter_window": {"drafter_layer_types": ["sliding_attention"], "drafter_window": 3},  # window >= 1
           # needs a sliding layer and a sliding layer a window: changed from this base instead of the defaults
           "target_engine": {"target": "models/t"}, "hidden_cache": {"target": "models/t"},  # a served target: a
           "target_engine_url": BY_HAND, "target_engine_dir": BY_HAND}  # folder, the url its engine's, given with
# the folder of its files
COUPLED |= {k: {"drafter_kind": "dflash2"} for k in C.DFLASH2_SETTINGS}  # a dflash2 drafter's settings alone
ONE_CHOICE: set[str] = set()  # choices of a single value: nothing to change them to
HASH_BASE = {"q": 64.0}  # the defaults, with q set so that `cost` may turn quadratic on its own


def _other(key: str, value):
    if key in OTHER_VALUE:
        return OTHER_VALUE[key]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value / 2 if value else 0.5
    if isinstance(value, str):
        return value + "x"
    raise AssertionError(f"no other value for {key}={value!r}: add one to OTHER_VALUE")


def test_hash_changes_with_any_setting():
    """Every flat field of every section, changed alone, changes the hash."""
    base = C.from_params(HASH_BASE)
    flat = base.to_params()
    assert set(flat) == set(C.FLAT_FIELDS)
    hashes = {base.hash()}
    assert all(len(typing.get_args(typing.get_type_hints(C.ModelConfig)[k])) == 1 for k in ONE_CHOICE), \
        "a second value: give it in OTHER_VALUE instead of ONE_CHOICE"
    for key, value in flat.items():
        if key in ONE_CHOICE:
            continue
        here = C.from_params(COUPLED[key], base) if key in COUPLED else base  # a key valid only beside another
        value = here.to_params()[key]
        changed = C.from_params({key: _other(key, value)}, here)  # a ConfigError here names the key
        assert [k for k, v in changed.to_params().items() if v != here.to_params()[k]] == [key]
        assert changed.hash() != here.hash(), f"{key} does not enter the hash"
        hashes.add(changed.hash())
    assert len(hashes) == len(flat) + 1 - len(ONE_CHOICE)  # no two single changes collide either


def test_hash_is_the_same_in_another_interpreter():
    """What a resumed run computes in a new process (other PYTHONHASHSEED) equals what the first one stored."""
    import json
    import os
    import subprocess
    import sys

    altered = {"lr": 1e-4, "edges": [8, 16], "source": "données ü.json", "gamma": 0.1}
    here = [C.from_params(altered).hash()] + [C.preset(name).hash() for name in sorted(C.PRESETS)]
    code = ("import json, sys; from dflash_lib import config as C; altered = json.loads(sys.argv[1]); "
            "print(json.dumps([C.from_params(altered).hash()] + [C.preset(n).hash() for n in sorted(C.PRESETS)]))")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(altered)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == here
    assert len(set(here)) == len(here)


def test_params_table_lists_every_field_with_its_type_default_and_comment():
    table = C.params_table()
    rows = {line.split()[0]: line for line in table.splitlines() if line.startswith("  ")}
    assert set(rows) == set(C.FLAT_FIELDS)  # every -p key, once
    headers = [line for line in table.splitlines() if not line.startswith("  ")]
    assert headers == [f"[{sec}]" for sec in C.SECTION_CLASSES]
    assert rows["lr"].split()[1:4] == ["float", "0.0006", "peak"]
    assert rows["edges"].split()[1:3] == ["list[int]", "[]"] and rows["static_shapes"].split()[1:3] == ["bool", "false"]
    # a comment continued on the lines below its field is read whole
    assert rows["static_shapes"].endswith("(k fixed shapes, as CUDA graphs / torch.compile want; what the \"edge\" "
                                          "objective prices exactly)")
    assert rows["heldout_fraction"].endswith("(dflash_lib.data.split: stable across runs and corpus order); 0 = none")
    docs = {k: v for cls in C.SECTION_CLASSES.values() for k, v in C.field_docs(cls).items()}
    assert [k for k in C.FLAT_FIELDS if not docs.get(k)] == []  # every setting has its comment
    train = C.params_table("train").splitlines()
    assert train[0] == "[train]" and {line.split()[0] for line in train[1:]} == {
        f.name for f in dataclasses.fields(C.TrainConfig)}
    with pytest.raises(C.ConfigError, match="unknown section 'trian'; sections: data, buckets, sampler"):
        C.params_table("trian")


def test_choices_are_literal_types_shown_in_params_and_checked_by_value():
    rows = {line.split()[0]: line for line in C.params_table().splitlines() if line.startswith("  ")}
    assert rows["policy"].split()[1:3] == ["'truncate'|'drop'", '"truncate"']
    assert rows["drafter_layer_types"].split()[1] == "list['full_attention'|'sliding_attention']"
    assert C.coerce("policy", "drop") == "drop" and C.coerce("thinking", "on") == "on"  # a CLI string, not JSON
    with pytest.raises(C.ConfigError, match="parameter 'policy' must be str, got int: 5"):
        C.from_params({"policy": 5})
    # every Literal field refuses a value outside its type, naming the field and the allowed values
    for cls in C.SECTION_CLASSES.values():
        for name, allowed in C._choices(cls).items():
            with pytest.raises(C.ConfigError) as e:
                C.from_params({name: "nope"})
            assert str(e.value) == f"{name} must be one of {list(allowed)}, got 'nope'"
    assert C.LOSSES == ("ce", "kl", "ce+kl") and C.PRECISIONS == ("auto", "bf16", "fp32")


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_draft_vocabulary_as_large_as_the_targets_is_refused_before_a_run_folder(tmp_path, wrapped):
    """-p draft_vocab N for a target folder of 300 ids (a vision-language wrapper's in its text config, as the
    target loader reads it): N = 300 and 301 are refused by the config in one line naming the parameter and the
    vocabulary size, N = 299 is a draft vocabulary; the command line exits 2 and makes no run folder."""
    import transformers

    from dflash_lib.__main__ import main
    from dflash_lib.models.target_config import local_hf_config
    from dflash_lib.serve.vllm import linear_attention_target

    text = transformers.Qwen3Config(vocab_size=300, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=4, intermediate_size=16)
    if wrapped:
        text = transformers.Qwen3_5Config(text_config={**text.to_dict(), "model_type": "qwen3_5_text"},
                                          vision_config=dict(depth=1, hidden_size=16, intermediate_size=32,
                                                             num_heads=2, out_hidden_size=32))
    text.save_pretrained(tmp_path / "target")  # config.json alone: nothing reads a weight
    folder = str(tmp_path / "target")
    assert C.folder_vocab_size(folder) == local_hf_config(folder).vocab_size == 300
    # the wrapper's text model read from the JSON: qwen3_5_text, served by the engine's hybrid model whatever its
    # layer types; the plain Qwen3 folder is not
    assert linear_attention_target(folder) == wrapped
    assert C.from_params({"target": folder, "draft_vocab": 299}).model.draft_vocab == 299
    for n in (300, 301):
        with pytest.raises(C.ConfigError) as e:
            C.from_params({"target": folder, "draft_vocab": n})
        assert str(e.value) == (f"draft_vocab {n} is not below target {folder!r}'s vocab_size 300: pass -p "
                                f"draft_vocab N with N < 300 (0: the whole head)")
    assert main(["train", "--preset", "smoke", "--run-dir", str(tmp_path / "run"), "-p", "target", folder,
                 "-p", "draft_vocab", "300"]) == 2
    assert not (tmp_path / "run").exists()
