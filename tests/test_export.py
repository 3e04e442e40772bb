"""The serving layout: export round-trips, config.json keys, tensor names, target refusals, a saved HF target,
the `export` command on a trainer run, and `init_from` training from exported weights."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from dflash_lib.__main__ import main
from dflash_lib.config import ConfigError, ModelConfig, from_params, preset
from dflash_lib.data.batch import collate_padded
from dflash_lib.models import DFlashDrafter, DrafterConfig, default_gamma, tiny_qwen3_config
from dflash_lib.target.local import TargetModel
from dflash_lib.models.export import export_drafter, export_folder, read_drafter, read_weights
from dflash_lib.rundir.checkpoints import list_checkpoints
from dflash_lib.train.resume import resume_config_hash
from tiny_models import save_tiny_qwen3

VOCAB, MASK, H, LAYERS = 300, 299, 32, 6


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_hf_config(tiny_qwen3_config(hidden_size=H, num_layers=LAYERS, vocab_size=VOCAB), 2, seed=0)


def _drafter(target: TargetModel, seed: int = 0) -> DFlashDrafter:
    cfg = DrafterConfig(hidden_size=target.hidden_size, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                        intermediate_size=64, vocab_size=target.vocab_size, target_layer_ids=target.layer_ids,
                        target_num_layers=target.num_layers, block_size=4, mask_id=MASK, num_anchors=5,
                        ce_chunk_blocks=3, gamma=3.5)
    torch.manual_seed(seed)
    return DFlashDrafter(cfg, target)


@pytest.fixture(scope="module")
def drafter(target) -> DFlashDrafter:
    return _drafter(target)


def _logits(drafter: DFlashDrafter, target: TargetModel, seed: int = 3) -> torch.Tensor:
    """(n, B, V) training-forward logits of a small two-document batch."""
    rng = np.random.default_rng(seed)
    docs = [(rng.integers(0, VOCAB - 1, n), np.arange(n) >= 2) for n in (17, 11)]
    batch = collate_padded(docs, 0)
    anchors = drafter.sample_anchors(batch, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return drafter.block_logits(batch, target.features(batch), anchors).float()


def _expected_names(layers: int) -> set[str]:
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight"] + [
        f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
    return {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{n}" for i in range(layers) for n in per_layer}


# -- round trips -----------------------------------------------------------------------------------------
def test_fp32_export_reloads_to_identical_logits(target, drafter, tmp_path):
    export_drafter(drafter, tmp_path, torch.float32, template="chatml", source="a test")
    loaded = read_drafter(tmp_path, target)
    assert loaded.fc.weight.dtype == torch.float32
    torch.testing.assert_close(_logits(loaded, target), _logits(drafter, target), rtol=0, atol=0)
    assert loaded.cfg == drafter.cfg  # training settings (gamma 3.5, num_anchors 5, ce_chunk_blocks 3) too
    readme = (tmp_path / "README.md").read_text()
    assert "chatml" in readme and f"{LAYERS} layers, hidden size {H}" in readme and "a test" in readme


def test_bf16_export_is_bf16_on_disk_and_close_after_reload(target, drafter, tmp_path):
    export_drafter(drafter, tmp_path)  # default dtype: bf16
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    want = _logits(drafter, target)
    as_fp32 = read_drafter(tmp_path, target, dtype=torch.float32)  # bf16 weights, fp32 compute
    got = _logits(as_fp32, target)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    assert not torch.equal(got, want)  # the weights really were rounded
    as_bf16 = read_drafter(tmp_path, target)  # stored dtype: bf16 weights and compute
    assert as_bf16.fc.weight.dtype == torch.bfloat16 and as_bf16.rotary.inv_freq.dtype == torch.float32
    got16 = _logits(as_bf16, target)
    assert (got16.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    torch.testing.assert_close(got16, want, rtol=5e-2, atol=5e-2 * want.abs().max().item())


def test_config_json_has_the_serving_keys(target, drafter, tmp_path):
    export_drafter(drafter, tmp_path)
    doc = json.loads((tmp_path / "config.json").read_text())
    c = drafter.cfg
    assert doc["architectures"] == ["DFlashDraftModel"] and doc["model_type"] == "qwen3"
    assert {k: doc[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "head_dim", "vocab_size", "block_size", "num_target_layers",
                                "rms_norm_eps", "rope_theta")} == dict(
        hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=VOCAB, block_size=4, num_target_layers=LAYERS, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta)
    assert doc["rope_parameters"] == {"rope_theta": c.rope_theta, "rope_type": "default"}
    assert (doc["hidden_act"], doc["attention_bias"], doc["tie_word_embeddings"]) == ("silu", False, False)
    assert doc["max_position_embeddings"] == target.model.config.max_position_embeddings
    dc = doc["dflash_config"]
    assert dc["mask_token_id"] == MASK and dc["target_layer_ids"] == target.layer_ids == [1, 3]
    assert doc["eagle_aux_hidden_state_layer_ids"] == [2, 4]  # vLLM's layer boundaries: ids + 1
    assert {k: dc["training"][k] for k in ("gamma", "num_anchors", "ce_chunk_blocks")} == dict(
        gamma=3.5, num_anchors=5, ce_chunk_blocks=3)
    # transformers reads it as a Qwen3 config with the drafter's shapes (what serving code builds on)
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(hf).__name__ == "Qwen3Config" and hf.num_hidden_layers == 2 and hf.hidden_size == H
    assert hf.rope_parameters["rope_theta"] == c.rope_theta and hf.dflash_config["target_layer_ids"] == [1, 3]


def test_tensor_names_are_exactly_the_qwen3_set(drafter, tmp_path):
    export_drafter(drafter, tmp_path)
    weights = read_weights(tmp_path)
    assert set(weights) == _expected_names(2)
    assert weights["fc.weight"].shape == (H, 2 * H)
    assert weights["layers.1.self_attn.k_proj.weight"].shape == (2 * 8, H)


# -- refusals ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape, field", [
    (dict(hidden_size=48), "hidden_size is 32, the target has 48"),
    (dict(vocab_size=VOCAB + 100), "vocab_size is 300, the target has 400"),
    (dict(num_layers=8), "num_target_layers is 6, the target has 8"),
])
def test_load_refuses_another_target_naming_the_field(drafter, tmp_path, shape, field):
    export_drafter(drafter, tmp_path)
    kw = {**dict(hidden_size=H, num_layers=LAYERS, vocab_size=VOCAB), **shape}
    other = TargetModel.from_hf_config(tiny_qwen3_config(**kw), 2, layer_ids=[1, 3])
    with pytest.raises(ConfigError, match=field):
        read_drafter(tmp_path, other)


def test_load_refuses_bad_layer_ids_mask_and_old_format(target, drafter, tmp_path):
    export_drafter(drafter, tmp_path)
    path = tmp_path / "config.json"
    doc = json.loads(path.read_text())

    def load_with(**dflash):
        path.write_text(json.dumps({**doc, "dflash_config": {**doc["dflash_config"], **dflash}}))
        return read_drafter(tmp_path, target)

    with pytest.raises(ConfigError, match=r"target layer ids \[7\] are outside \[0, 6\)"):
        load_with(target_layer_ids=[1, 7])
    with pytest.raises(ConfigError, match=r"target_layer_ids \[1, 2\] differ from the target's feature layers"):
        load_with(target_layer_ids=[1, 2])
    with pytest.raises(ConfigError, match="mask_id 300 is outside the target vocabulary"):
        load_with(mask_token_id=VOCAB)
    dc = {k: v for k, v in doc["dflash_config"].items() if k != "target_layer_ids"}
    path.write_text(json.dumps({**doc, "dflash_config": dc}))
    with pytest.raises(ConfigError, match="dflash_config.target_layer_ids is missing"):
        read_drafter(tmp_path, target)
    path.write_text(json.dumps({**doc, "attention_bias": True}))
    with pytest.raises(ConfigError, match="attention_bias True is not supported"):
        read_drafter(tmp_path, target)
    path.write_text(json.dumps({"format": "dflash-drafter", "format_version": 1}))
    with pytest.raises(ConfigError, match="old dflash-lab drafter format"):
        read_drafter(tmp_path, target)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        read_drafter(tmp_path, target)


def test_a_published_config_without_our_training_keys_loads_with_defaults(target, drafter, tmp_path):
    export_drafter(drafter, tmp_path)
    path = tmp_path / "config.json"
    doc = json.loads(path.read_text())
    for key in ("rope_parameters", "rope_scaling", "dtype", "max_window_layers", "layer_types"):
        doc.pop(key)
    doc["dflash_config"] = {k: doc["dflash_config"][k] for k in ("mask_token_id", "target_layer_ids")}
    doc.pop("eagle_aux_hidden_state_layer_ids")
    path.write_text(json.dumps(doc))  # the z-lab Qwen3-8B-DFlash-b16 shape of config: top-level block_size
    loaded = read_drafter(tmp_path, target)
    assert (loaded.cfg.block_size, loaded.cfg.num_anchors, loaded.cfg.gamma) == (4, 64, default_gamma(4))
    torch.testing.assert_close(loaded.fc.weight, drafter.fc.weight.to(torch.bfloat16))
    export_folder(tmp_path, tmp_path / "again")  # exported again: with the ids vLLM reads
    assert json.loads((tmp_path / "again" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 4]


# -- a real Hugging Face target folder ------------------------------------------------------------------------
def test_a_saved_tiny_qwen3_and_its_exported_drafter_load_back_from_folders(tmp_path):
    save_tiny_qwen3(tmp_path / "target", seed=1, hidden_size=H, num_layers=LAYERS, vocab_size=VOCAB)
    model_cfg = ModelConfig(target=str(tmp_path / "target"), num_features=2, block_size=4, mask_id=MASK)
    target = TargetModel.from_model_config(model_cfg)
    drafter = _drafter(target, seed=2)
    export_drafter(drafter, tmp_path / "drafter", torch.float32, template="chatml")
    target2 = TargetModel.from_model_config(model_cfg)  # everything again from the two folders
    loaded = read_drafter(tmp_path / "drafter", target2)
    torch.testing.assert_close(_logits(loaded, target2), _logits(drafter, target), rtol=0, atol=0)
    assert str(tmp_path / "target") in (tmp_path / "drafter" / "README.md").read_text()


# -- the export command and init_from ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    from dflash_lib.train.loop import train

    run_dir = tmp_path_factory.mktemp("run")
    config = from_params({"steps": 2, "wandb_mode": "disabled"}, preset("smoke"))
    train(config, run_dir)
    return run_dir, config


def _smoke_target(config) -> TargetModel:
    return TargetModel.from_model_config(config.model, seed=config.train.seed)


def test_cli_exports_a_run_folder_a_checkpoint_and_a_drafter(smoke_run, tmp_path, capsys):
    run_dir, config = smoke_run
    target = _smoke_target(config)
    final = read_weights(run_dir / "drafter")
    assert json.loads((run_dir / "drafter" / "config.json").read_text())["torch_dtype"] == "float32"
    assert "chatml" in (run_dir / "drafter" / "README.md").read_text()  # the run's template is recorded
    ckpt = list_checkpoints(run_dir / "checkpoints")[-1]
    for src, dtype in ((run_dir, "fp32"), (ckpt, "fp32"), (run_dir / "drafter", "fp32"), (run_dir, "bf16")):
        out = tmp_path / f"{src.name}_{dtype}"
        assert main(["export", str(src), str(out), "--dtype", dtype]) == 0
        assert capsys.readouterr().out.strip() == str(out)
        loaded = read_drafter(out, target)
        weights = read_weights(out)
        assert set(weights) == _expected_names(config.model.drafter_layers)
        for name, w in final.items():  # the run's final weights, exactly (or rounded to bf16)
            assert torch.equal(weights[name], w.to(weights[name].dtype)), name
        assert loaded.cfg.num_anchors == config.model.num_anchors and loaded.cfg.block_size == config.model.block_size
    readme = (tmp_path / f"{run_dir.name}_bf16" / "README.md").read_text()
    assert "tiny (a random Qwen3 built from seed 0" in readme and "step 2" in readme
    training = json.loads((tmp_path / f"{ckpt.name}_fp32" / "config.json").read_text())["dflash_config"]["training"]
    assert {k: training[k] for k in ("template", "tokenizer", "thinking", "corpus")} == dict(
        template=config.data.template, tokenizer=config.data.tokenizer, thinking=config.data.thinking,
        corpus=config.data.source)  # a checkpoint's export records its data settings (the doctor reads them)


def test_cli_errors_are_one_line_naming_the_path(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert main(["export", str(missing), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and str(missing) in err and "\n" not in err
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds no checkpoint" in err and str(tmp_path / "empty") in err and "\n" not in err


def _snapshot(folder) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def test_cli_export_never_overwrites_without_force_nor_a_run_folders_own_files(smoke_run, tmp_path, capsys):
    run_dir, _ = smoke_run
    before = _snapshot(run_dir)
    ckpt = list_checkpoints(run_dir / "checkpoints")[-1]
    for src, out, why in ((run_dir, run_dir, "is the source itself"),  # `export RUN RUN`: its config.json
                          (run_dir / "drafter", run_dir, "is a training run folder"),
                          (run_dir, run_dir / "drafter", f"is drafter of the training run {run_dir}"),
                          (run_dir, ckpt, f"is checkpoints of the training run {run_dir}"),
                          (run_dir, run_dir / "checkpoints" / "new", f"is checkpoints of the training run {run_dir}")):
        assert main(["export", str(src), str(out), "--force"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and f"destination {out} {why}" in err, err
    other = tmp_path / "other_run"  # another training run folder: not written into even with --force
    shutil.copytree(run_dir, other)
    assert main(["export", str(run_dir), str(other), "--force"]) == 2
    assert f"destination {other} is a training run folder" in capsys.readouterr().err
    assert _snapshot(run_dir) == before == _snapshot(other)

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    (mine / "config.json").write_text("{}")
    assert main(["export", str(run_dir), str(mine)]) == 2
    err = capsys.readouterr().err
    assert f"destination {mine} is not empty (it holds config.json, notes.txt)" in err and "--force" in err
    assert (mine / "config.json").read_text() == "{}" and sorted(p.name for p in mine.iterdir()) == ["config.json",
                                                                                                        "notes.txt"]
    assert main(["export", str(run_dir), str(mine), "--force"]) == 0
    assert capsys.readouterr().out.strip() == str(mine)
    assert sorted(p.name for p in mine.iterdir()) == ["README.md", "config.json", "model.safetensors", "notes.txt"]
    assert (mine / "notes.txt").read_text() == "keep" and "dflash_config" in json.loads((mine / "config.json").read_text())
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(run_dir), str(empty)]) == 0  # an empty folder needs no --force
    capsys.readouterr()


def test_init_from_starts_training_from_the_exported_weights(smoke_run, tmp_path):
    from dflash_lib.train.build import build_parts

    run_dir, config = smoke_run
    exported = tmp_path / "exported"
    assert main(["export", str(run_dir), str(exported), "--dtype", "fp32"]) == 0
    cfg = from_params({"init_from": str(exported)}, config)
    assert resume_config_hash(cfg) != resume_config_hash(config)  # another starting point is another run
    parts = build_parts(cfg, torch.device("cpu"))
    want = read_weights(exported)
    got = {n: p for n, p in parts.drafter.named_parameters()}
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert parts.drafter.fc.weight.dtype == torch.float32
    fresh = build_parts(config, torch.device("cpu")).drafter  # without init_from: the seeded random init
    assert not torch.equal(fresh.fc.weight, want["fc.weight"])
    with pytest.raises(ConfigError, match="num_layers is 1 there, this config builds 2 .set drafter_layers"):
        build_parts(from_params({"init_from": str(exported), "drafter_layers": 2}, config), torch.device("cpu"))
    shutil.rmtree(exported)
    with pytest.raises(ConfigError, match="is not a folder"):
        build_parts(cfg, torch.device("cpu"))


def test_a_sliding_window_drafter_exports_what_vllm_reads_and_reloads(target, tmp_path):
    """Sliding drafter layers: config.json holds `layer_types` (per layer) and `sliding_window` (the window
    vLLM's DFlash reads when dflash_config.swa_window_size is absent; a folder with one is read with it), the
    reload is the same drafter, and a
    config vLLM would read otherwise (no window, a use_swa override, a causality field that is no bool) is refused
    in one line."""
    base = _drafter(target).cfg
    cfg = DrafterConfig(**{**base.to_dict(), "layer_types": ["sliding_attention", "full_attention"],
                           "sliding_window": 6})
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, target)
    export_drafter(drafter, tmp_path, torch.float32)
    doc = json.loads((tmp_path / "config.json").read_text())
    assert doc["layer_types"] == ["sliding_attention", "full_attention"] and doc["sliding_window"] == 6
    assert doc["use_sliding_window"] is True and "swa_window_size" not in doc["dflash_config"]
    loaded = read_drafter(tmp_path, target)
    assert loaded.cfg == drafter.cfg and loaded.cfg.layer_windows == [6, 0]
    torch.testing.assert_close(_logits(loaded, target), _logits(drafter, target), rtol=0, atol=0)
    assert float((_logits(_drafter(target), target) - _logits(drafter, target)).abs().max()) > 1e-4
    swa = {**doc, "dflash_config": {**doc["dflash_config"], "swa_window_size": 3}}  # vLLM takes this one first
    (tmp_path / "config.json").write_text(json.dumps(swa))
    assert read_drafter(tmp_path, target).cfg.layer_windows == [3, 0]
    for bad, why in [({"sliding_window": None}, "swa_window_size, else sliding_window\\) is None"),
                     ({"use_sliding_window": False}, "is None"),  # transformers then holds no window: vLLM refuses
                     ({"dflash_config": {**doc["dflash_config"], "use_swa": True}}, "dflash_config.use_swa"),
                     ({"is_causal": "false"}, "is_causal 'false' is not true, false or null"),
                     ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types")]:
        (tmp_path / "config.json").write_text(json.dumps({**doc, **bad}))
        with pytest.raises(ConfigError, match=why) as e:
            read_drafter(tmp_path, target)
        assert "\n" not in str(e.value)
    full = json.loads(json.dumps(doc).replace('"sliding_attention"', '"full_attention"'))
    (tmp_path / "config.json").write_text(json.dumps({**full, "sliding_window": None}))
    assert read_drafter(tmp_path, target).cfg.layer_windows == [0, 0]  # all full: no window needed
