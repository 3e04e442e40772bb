"""TargetModel: feature layers, document isolation in packed rows, frozen weights, verification logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_lib.config import ConfigError, ModelConfig
from dflash_lib.data.batch import collate_packed, collate_padded
from dflash_lib.models import feature_layer_ids, segment_cu_seqlens, tiny_qwen3_config
from dflash_lib.target.attention import resolve_backend
from dflash_lib.target.local import TargetModel
from tiny_models import save_tiny_qwen3, train_two_steps

VOCAB = 300


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_hf_config(tiny_qwen3_config(hidden_size=32, num_layers=6, vocab_size=VOCAB), 3, seed=0)


def _docs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, VOCAB, n), rng.random(n) < 0.7) for n in lengths]


def test_feature_layer_rule():
    assert feature_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, docs/dflash.md
    assert feature_layer_ids(36, 1) == [18]
    assert feature_layer_ids(6, 3) == [1, 2, 3]
    assert feature_layer_ids(28, 2) == [1, 25]
    with pytest.raises(ConfigError, match="target_layer_ids"):
        feature_layer_ids(3, 2)


def test_configured_layer_ids_win_over_the_rule():
    from dflash_lib.models.target_config import chosen_layer_ids

    assert chosen_layer_ids([], 36, 5) == [1, 9, 17, 25, 33]  # none configured: the rule
    assert chosen_layer_ids(None, 36, 1) == [18]
    assert chosen_layer_ids((2, 7), 3, 2) == [2, 7]  # configured: as given, even where the rule would refuse


def test_features_are_hf_hidden_states_of_the_selected_layers(target):
    assert target.layer_ids == [1, 2, 3] and target.num_features == 3
    (doc,) = _docs([11])
    feats = target.features(collate_padded([doc], pad_id=0))[0]  # (T, 3H)
    with torch.no_grad():
        hs = target.model.model(torch.as_tensor(doc[0])[None], output_hidden_states=True).hidden_states
    want = torch.cat([hs[i + 1][0] for i in target.layer_ids], dim=-1)
    torch.testing.assert_close(feats, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("packed", [False, True])
def test_batched_features_equal_each_document_alone(target, packed):
    docs = _docs([9, 4, 13])
    batch = collate_packed(docs, 0, row_len=30) if packed else collate_padded(docs, 0)
    feats = target.features(batch)
    assert torch.isfinite(feats).all()
    for d, (tok, lm) in enumerate(docs):
        alone = target.features(collate_padded([(tok, lm)], 0))[0]  # (L, F*H)
        slots = batch.doc_ids == d
        torch.testing.assert_close(feats[slots], alone, atol=1e-5, rtol=0)
    assert feats[batch.doc_ids < 0].abs().max() == 0  # padding slots are zeroed


def test_target_is_frozen(target):
    assert all(not p.requires_grad for p in target.parameters())
    target.train()
    assert not target.training and not target.model.training
    assert target.embed_tokens.weight is target.model.get_input_embeddings().weight


def test_step_logits_match_hf_and_greedy_matches_generate(target):
    ids = torch.as_tensor(_docs([10])[0][0])
    step = target.step(ids, logits_from=6)
    with torch.no_grad():
        full = target.model(ids[None]).logits[0]
    assert step.logits.shape == (4, VOCAB) and step.features.shape == (10, 3 * 32)
    torch.testing.assert_close(step.logits, full[6:], atol=1e-5, rtol=0)
    with torch.no_grad():
        gen = target.model.generate(ids[None], max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 10:]
    assert target.greedy(ids.tolist(), 8) == gen.tolist()


def test_segment_boundaries_for_varlen():
    doc = torch.tensor([[0, 0, 1, 1, 1, -1], [2, 2, 2, 3, -1, -1]])
    cu, longest = segment_cu_seqlens(doc)
    assert cu.tolist() == [0, 2, 5, 6, 9, 10, 12] and longest == 3 and cu.dtype == torch.int32


def test_backend_choice_and_bad_target_path(tmp_path):
    assert resolve_backend("auto", "cpu") == "sdpa"
    with pytest.raises(ConfigError, match="CUDA"):
        resolve_backend("flash", "cpu")
    with pytest.raises(ConfigError, match="local model directory"):
        TargetModel.from_model_config(ModelConfig(target=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match=r"outside \[0, 6\)"):
        TargetModel.from_hf_config(tiny_qwen3_config(hidden_size=32, num_layers=6, vocab_size=VOCAB), 2, [1, 6])


def test_model_config_refuses_contradictions():
    with pytest.raises(ConfigError, match="block_size"):
        ModelConfig(block_size=1)
    with pytest.raises(ConfigError, match="num_features"):
        ModelConfig(num_features=2, target_layer_ids=[1, 2, 3])
    with pytest.raises(ConfigError, match="attn_backend"):
        ModelConfig(attn_backend="xformers")


# -- a local Hugging Face folder: loaded onto its device in its dtype, and trained from ------------------------------


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory):
    """A tiny random Qwen3 (real Qwen3 vocabulary, so the bundled corpus' ids fit) saved with save_pretrained."""
    directory = tmp_path_factory.mktemp("qwen3_tiny")
    return directory, save_tiny_qwen3(directory, seed=3, hidden_size=32, num_layers=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_local_target_loads_on_its_device_in_its_dtype_with_the_saved_weights(saved_target, dtype):
    directory, model = saved_target
    cfg = ModelConfig(target=str(directory), num_features=2)
    loaded = TargetModel.from_model_config(cfg, device="cpu", dtype=dtype)
    tensors = list(loaded.model.parameters())
    assert len(tensors) == len(list(model.parameters()))
    assert {t.dtype for t in tensors} == {dtype} and {t.device.type for t in tensors} == {"cpu"}
    assert loaded.layer_ids == [1, 1] and loaded.name_or_path == str(directory)  # 4 layers, 2 features: the rule
    for (name, got), want in zip(loaded.model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(got, want.to(dtype)), name
    in_memory = TargetModel(model, [1, 1])  # the same weights, never saved
    docs = _docs([7, 12], seed=4)
    batch = collate_padded(docs, 0)
    want = in_memory.features(batch)
    got = loaded.features(batch)
    assert got.dtype == dtype and got.shape == (2, 12, 64)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    else:  # bf16 weights: the same forward within bf16 rounding of every layer
        torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.05)


def test_local_target_refuses_missing_weights_and_pickles(saved_target, tmp_path):
    from safetensors.torch import load_file, save_file

    directory, _ = saved_target
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    cfg = ModelConfig(target=str(tmp_path), num_features=2)
    with pytest.raises(ConfigError, match="only safetensors"):
        TargetModel.from_model_config(cfg)
    weights = load_file(str(directory / "model.safetensors"))
    weights.pop("model.norm.weight")
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"missing from the checkpoint \['model.norm.weight'\]"):
        TargetModel.from_model_config(cfg)
    with pytest.raises(ConfigError, match="-p target DIR"):
        TargetModel.from_model_config(ModelConfig(target="qwen3-8b"))


def test_features_keep_only_the_feature_layers_alive(target):
    """While the deepest feature layer runs, no earlier layer's output is kept but its input (the one before it):
    the features are copied out as they are produced, not stacked up to the deepest layer."""
    import weakref

    outputs, alive_at_deepest = [], []

    def keep_ref(module, args, out):
        outputs.append(weakref.ref(out))

    def count_alive(module, args):
        alive_at_deepest.append(sum(r() is not None for r in outputs))

    deepest = target.base.layers[max(target.layer_ids)]
    handles = [layer.register_forward_hook(keep_ref) for layer in target.base.layers]
    handles.append(deepest.register_forward_pre_hook(count_alive))
    try:
        feats = target.features(collate_padded(_docs([40, 33]), 0))
    finally:
        for h in handles:
            h.remove()
    assert max(target.layer_ids) == 3 and len(outputs) == 4  # features() stops at the deepest feature layer
    assert alive_at_deepest == [1]  # only the input of the deepest layer (3 outputs came before it)
    assert feats.shape == (2, 40, 3 * 32)


def test_train_two_steps_from_a_local_target_directory(saved_target, tmp_path):
    directory, _ = saved_target
    drafter = train_two_steps(directory, tmp_path / "run")
    assert drafter["hidden_size"] == 32 and drafter["num_target_layers"] == 4  # the saved target's shapes
    assert drafter["dflash_config"]["target_layer_ids"] == [2]  # smoke: one feature, the middle layer of 4


def test_a_bad_target_folder_is_one_line_naming_its_file_and_leaves_no_run_folder(saved_target, tmp_path, capsys,
                                                                                   monkeypatch):
    """An invalid config.json, a model_type transformers does not know, one that is not a causal LM, no
    safetensors: `error: ...` naming the file (the folder), exit 2, and no run folder (the target is checked
    before it is made, --run-dir given or not)."""
    import json
    import shutil

    from dflash_lib.__main__ import main

    directory, _ = saved_target
    good = json.loads((directory / "config.json").read_text())
    cases = {"not_json": ("{\"model_type\": \"qwen3\",", "not valid JSON"),
             "unknown_type": (json.dumps({**good, "model_type": "qwen99"}), "model_type 'qwen99' is not a model type "
                                                                            "transformers"),
             "not_causal": (json.dumps({"model_type": "t5", "vocab_size": good["vocab_size"]}),
                            "model_type 't5' has no causal LM in transformers"),
             "no_weights": (json.dumps(good), "no model.safetensors")}
    runs_root = tmp_path / "runs"
    monkeypatch.setattr("dflash_lib.rundir.RUNS_ROOT", runs_root)
    for name, (text, why) in cases.items():
        folder = tmp_path / name
        shutil.copytree(directory, folder)
        (folder / "config.json").write_text(text)
        if name == "no_weights":
            (folder / "model.safetensors").unlink()
        for run_dir in (["--run-dir", str(tmp_path / "run")], []):
            assert main(["train", "--preset", "smoke", *run_dir, "-p", "target", str(folder)]) == 2
            err = capsys.readouterr().err
            assert err.startswith("error: ") and err.count("\n") == 1 and why in err, err
            assert str(folder / "config.json") in err if name in ("not_json", "unknown_type") else str(folder) in err
            assert not (tmp_path / "run").exists() and not (runs_root.exists() and list(runs_root.iterdir()))
