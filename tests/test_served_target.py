"""The target served by vLLM (`-p target_engine vllm`, `serve/hidden_states.py`, `target/served.py`): layer
numbering, the refusals before an engine starts, the client's checks of the engine's files (a stand-in server: a
missing, corrupt or mismatched file is retried, then stops the run), and with the real engine (vLLM's CPU build):
features equal `TargetModel`'s, a training run from the engine has the local run's losses."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dflash_lib.config import ConfigError, from_params, preset
from dflash_lib.serve.hidden_states import EngineFileError, EngineFiles, HiddenStatesClient, engine_layer_ids
from dflash_lib.serve.adapter import EngineSpec
from dflash_lib.serve.vllm import PLUGINS, server_args
from fp_tolerance import rounding_atol
from run_folder import metrics_rows
from tiny_models import save_random_model, save_tiny_qwen3


def test_our_layer_i_is_the_engines_aux_id_i_plus_one_sorted_once():
    """vLLM counts layer boundaries (aux id 0 = the embeddings): our layer i's output is its id i + 1, and its file
    holds the ids in ascending order, each once."""
    assert engine_layer_ids([1, 9, 17, 25, 33]) == [2, 10, 18, 26, 34]
    assert engine_layer_ids([5, 0, 5]) == [1, 6]


def test_the_server_flags_extract_the_hidden_states_through_our_connector(tmp_path):
    spec = EngineSpec(str(tmp_path), hidden_states=(1, 3), hidden_states_dir=str(tmp_path / "hs"))
    args = server_args(spec, 8000)
    speculative = json.loads(args[args.index("--speculative-config") + 1])
    assert speculative == {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                           "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 3]}}}
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "DFlashHiddenStatesConnector" and kv["kv_role"] == "kv_producer"
    assert (PLUGINS / (kv["kv_connector_module_path"] + ".py")).is_file()
    assert kv["kv_connector_extra_config"] == {"shared_storage_path": str(tmp_path / "hs")}
    assert "--kv-transfer-config" not in server_args(EngineSpec(str(tmp_path)), 8000)


@pytest.mark.parametrize("params,says", [
    ({"target": "tiny"}, "is a LOCAL model folder"),
    ({"static_shapes": True}, "static_shapes must be false"),
    ({"target_parallel": "fsdp"}, "target_parallel must not be fsdp"),
    ({"target_engine_url": "http://x:1"}, "target_engine_url and target_engine_dir go together"),
    ({"target_engine_dir": "/x"}, "target_engine_url and target_engine_dir go together")])
def test_what_a_served_target_cannot_do_is_refused_by_the_config(tmp_path, params, says):
    base = {"target": str(tmp_path), "target_engine": "vllm"}
    with pytest.raises(ConfigError, match=says):
        from_params({**base, **params}, preset("smoke"))


def test_a_served_target_that_is_no_folder_is_refused_before_a_run_folder(tmp_path):
    from dflash_lib.train.loop import train

    config = from_params({"target": "qwen3-8b", "target_engine": "vllm"}, preset("smoke"))  # the dry run's shape
    with pytest.raises(ConfigError, match="serves a LOCAL model folder, got target 'qwen3-8b'"):
        train(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_server_by_hand_whose_files_folder_is_no_folder_is_refused_before_a_run_folder(tmp_path):
    from dflash_lib.train.loop import train

    save_tiny_qwen3(tmp_path / "t")  # Qwen3's vocabulary: the smoke preset's tokenizer
    config = from_params({"target": str(tmp_path / "t"), "target_engine": "vllm", "target_engine_url": "http://x:1",
                          "target_engine_dir": str(tmp_path / "nowhere")}, preset("smoke"))
    with pytest.raises(ConfigError, match="target_engine_dir .*nowhere' is not a folder"):
        train(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_an_engine_url_without_the_engine_is_refused():
    with pytest.raises(ConfigError, match="target_engine_url 'http://x:1' is set but target_engine is 'local'"):
        from_params({"target_engine_url": "http://x:1"}, preset("smoke"))


IDENTITY = {"aux_layer_ids": "[1, 3]", "dtype": "float32", "model": "/models/t", "config_sha256": "c" * 64,
            "weights_fingerprint": "w" * 64}  # what the connector writes; `_files` expects the same


class _Engine:
    """A stand-in server: each completion writes the prompt's 'hidden states' (token id + layer, per hidden unit)
    to the file it was asked for, with the connector's metadata (`metadata`), and names it; `faults` (consumed in
    order) spoil the next files: no file, bad bytes, other ids, another file named."""

    def __init__(self, out: Path, layers: int, hidden: int, faults: list[str], metadata: dict[str, str] | None):
        self.out, self.layers, self.hidden, self.faults, self.calls = out, layers, hidden, list(faults), 0
        self.metadata, self.lock, self.names = metadata, threading.Lock(), []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "/models/t"}]})
        body = json.loads(request.content)
        assert body["max_tokens"] == 1 and request.url.path == "/v1/completions" and body["model"] == "/models/t"
        ids = body["prompt"]
        path = self.out / (body["kv_transfer_params"]["name"] + ".safetensors")
        with self.lock:
            self.calls += 1
            self.names.append(path.name)
            fault = self.faults.pop(0) if self.faults else ""
        states = torch.tensor(ids, dtype=torch.float32)[:, None, None] + torch.arange(self.layers)[None, :, None]
        states = states.expand(-1, -1, self.hidden).contiguous()
        if fault == "elsewhere":  # a file of its own choosing, by another name: never read, never deleted
            path = self.out / "theirs.safetensors"
        if fault == "corrupt":
            path.write_bytes(b"not a safetensors file")
        elif fault != "missing":
            save_file({"hidden_states": states, "token_ids": torch.tensor(ids[:-1] if fault == "ids" else ids)},
                      str(path), metadata=self.metadata)
        return httpx.Response(200, json={"kv_transfer_params": {"hidden_states_path": str(path)}})


def _files(folder: Path, **changes) -> EngineFiles:
    return EngineFiles(**{**dict(folder=folder, prefix="dflash-mine-", aux_layer_ids=(1, 3), dtype="float32",
                                 model="/models/t", config_sha256="c" * 64, weights_fingerprint="w" * 64), **changes})


def _client(tmp_path, faults, monkeypatch, metadata=IDENTITY, files=None):
    import dflash_lib.serve.hidden_states as hs

    monkeypatch.setattr(hs, "FILE_WAIT_S", 0.2)
    engine = _Engine(tmp_path, 2, 3, faults, metadata)
    return HiddenStatesClient("http://engine", files or _files(tmp_path), 3, concurrency=1,
                              transport=httpx.MockTransport(engine)), engine


def _others(folder: Path) -> list[str]:
    """Files of other clients and of other programs in the engine's folder: never this client's to delete."""
    for name in ("dflash-theirs-0-1.safetensors", "theirs.safetensors", "dflash-mine-0.safetensors.part"):
        (folder / name).write_bytes(b"x")
    return sorted(p.name for p in folder.iterdir())


def test_the_client_reads_each_documents_file_checks_it_and_deletes_it_alone(tmp_path, monkeypatch):
    """Each document's file is read, then deleted: that file and nothing else (another client's, another
    program's, an unfinished .part), named as this client asked, inside the folder it knows."""
    others = _others(tmp_path)
    client, engine = _client(tmp_path, [], monkeypatch)
    got = client.fetch([[5, 6, 7], [9]])
    assert [tuple(g.shape) for g in got] == [(3, 2, 3), (1, 2, 3)]
    assert got[0][:, 1, 0].tolist() == [6.0, 7.0, 8.0] and got[1][0, 0, 2] == 9.0
    assert all(n.startswith("dflash-mine-") for n in engine.names) and len(set(engine.names)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == others  # read once, deleted; the others left
    client.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == others


@pytest.mark.parametrize("fault", ["missing", "corrupt", "ids", "elsewhere"])
def test_a_missing_or_wrong_file_is_asked_again_then_stops_with_a_clear_error(tmp_path, monkeypatch, fault):
    client, engine = _client(tmp_path, [fault], monkeypatch)
    assert client.fetch([[1, 2, 3]])[0].shape == (3, 2, 3) and engine.calls == 2  # the retry was good
    if fault in ("corrupt", "ids"):  # a bad read: its file is kept until the client closes
        assert [p.name for p in tmp_path.iterdir()] == [engine.names[0]]
    if fault == "elsewhere":
        assert (tmp_path / "theirs.safetensors").is_file()  # named by the engine, not asked for: left alone
    client.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["theirs.safetensors"] if fault == "elsewhere" else [])
    client, engine = _client(tmp_path, [fault, fault], monkeypatch)
    with pytest.raises(RuntimeError, match=r"no usable hidden states for a document of 3 tokens after 2 tries"):
        client.fetch([[1, 2, 3]])


def test_late_files_are_deleted_when_the_client_starts_and_when_it_closes(tmp_path, monkeypatch):
    """A file of this client's that came too late (a timeout gave up on it, a killed run of the same owner left
    it) is deleted at start and at close; a file that arrives after its request was given up is too."""
    (tmp_path / "dflash-mine-7-0a.safetensors").write_bytes(b"late, from a killed run")
    others = _others(tmp_path)
    client, engine = _client(tmp_path, ["missing"], monkeypatch)
    assert not (tmp_path / "dflash-mine-7-0a.safetensors").exists()
    client.fetch([[4, 5]])
    (tmp_path / engine.names[0]).write_bytes(b"arrived after the retry")
    client.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(others) - {"dflash-mine-7-0a.safetensors"})


@pytest.mark.parametrize("metadata, says", [
    (None, "holds no layer ids, dtype or model: not written by our connector"),
    ({**IDENTITY, "aux_layer_ids": "[0, 2]"}, r"writes aux layer ids \[0, 2\], this run reads \[1, 3\] \(vLLM counts "),
    ({**IDENTITY, "dtype": "bfloat16"}, "runs the target in bfloat16, this run reads float32"),
    ({**IDENTITY, "config_sha256": "d" * 64}, "whose config.json differ from this run's target '/models/t'"),
    ({**IDENTITY, "weights_fingerprint": "v" * 64}, "whose weights differ from this run's target")])
def test_a_file_of_other_layers_dtype_or_model_is_refused_at_once_never_trained_on(tmp_path, monkeypatch, metadata,
                                                                                   says):
    """What the engine's file says it holds is this run's, or the run stops at once (no retry: a server started
    with our layer ids instead of vLLM's, or serving other weights under the same path, is no passing fault), in
    one line naming the file and both values."""
    client, engine = _client(tmp_path, [], monkeypatch, metadata)
    with pytest.raises(EngineFileError, match=says) as e:
        client.fetch([[1, 2]])
    assert engine.calls == 1 and "\n" not in str(e.value) and engine.names[0] in str(e.value)


def test_the_target_folders_identity_is_its_config_and_sampled_weights(tmp_path):
    """`EngineFiles.of` names a folder by its config.json's sha256 and its weights' fingerprint: the same bytes
    give the same identity under another path; weights rewritten in place (same shapes) or another config do
    not; a change between the sampled ranges is not seen (it is a fingerprint, not a hash of every byte)."""
    import shutil

    from dflash_lib.serve.engine_plugins import model_identity as mi

    folder = tmp_path / "t"
    save_tiny_qwen3(folder, seed=0, vocab_size=512)
    files = EngineFiles.of(tmp_path, "run", folder, [1, 3], "float32")
    shutil.copytree(folder, tmp_path / "copy")
    assert EngineFiles.of(tmp_path, "run", tmp_path / "copy", [1, 3], "float32").weights_fingerprint == \
        files.weights_fingerprint
    save_tiny_qwen3(folder, seed=1, vocab_size=512)  # the same shapes, other values, in place
    assert mi.weights_fingerprint(folder) != files.weights_fingerprint
    assert mi.config_sha256(folder) == files.config_sha256
    doc = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**doc, "rope_theta": 1.0}))
    assert mi.config_sha256(folder) != files.config_sha256
    assert EngineFiles.of(tmp_path, "run", folder, [1, 3], "float32").prefix == files.prefix != \
        EngineFiles.of(tmp_path, "run#1", folder, [1, 3], "float32").prefix
    assert mi.weights_fingerprint(tmp_path / "nothing") == ""


def test_a_target_whose_untied_lm_head_is_missing_or_misshapen_is_refused(tmp_path):
    """A served or cached target reads the embedding and LM head from the folder as transformers builds them:
    tied -> the embedding; untied -> its own lm_head.weight, refused (never the embedding instead) when missing;
    either refused when not (vocab_size, hidden_size) of config.json."""
    from safetensors.torch import load_file

    from dflash_lib.models.target_config import local_hf_config
    from dflash_lib.target.served import shared_weights

    folder = tmp_path / "t"
    save_tiny_qwen3(folder, seed=0, vocab_size=512)  # Qwen3Config: untied
    weights = load_file(str(folder / "model.safetensors"))
    hf = local_hf_config(folder)
    embed, head = shared_weights(folder, hf)
    assert torch.equal(embed, weights["model.embed_tokens.weight"]) and torch.equal(head, weights["lm_head.weight"])
    assert not torch.equal(head, embed)
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match="tie_word_embeddings false.*hold no lm_head.weight"):
        shared_weights(folder, hf)
    save_file({**weights, "lm_head.weight": weights["lm_head.weight"][:-1]}, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"its LM head is \(\d+, \d+\), config.json says"):
        shared_weights(folder, hf)
    hf.tie_word_embeddings = True
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, str(folder / "model.safetensors"))
    embed, head = shared_weights(folder, hf)
    assert head is embed


# -- with the real engine ----------------------------------------------------------------------------------------

LAYERS = [1, 3]  # the tiny target's feature layers (of 4)
# two fp32 kernel orders of its features (fp_tolerance.rounding_atol): its widest sum (intermediate 128 > the longest
# document's 120 positions > hidden 64) and its layers up to the deepest feature layer
TERMS, DEPTH = 128, max(LAYERS) + 1
RUN = {"steps": 20, "target_layer_ids": LAYERS, "num_features": 2, "limit": 50}  # 20 steps: 2+ epochs


def _tiny_target(root: Path, family: str, seed: int = 0) -> Path:
    """A tiny random target of `family` (qwen3, or qwen3_moe: 4 experts, 2 a token) on Qwen3's vocabulary, saved;
    head_dim 32 (the CPU build has no kernel for 16)."""
    import transformers

    from dflash_lib.families.qwen3 import QWEN3_VOCAB

    shape = dict(vocab_size=QWEN3_VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, intermediate_size=128)
    cfg = (transformers.Qwen3Config(**shape) if family == "qwen3" else
           transformers.Qwen3MoeConfig(**shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64))
    save_random_model(root / family, cfg, seed, spread=(0.1, 0.5))  # layers far from identity: every layer matters
    return root / family


@pytest.fixture(scope="module")
def served_target(request, installed_engine_python, tmp_path_factory):
    """(family, target folder, engine url, its files' folder): a tiny target saved, and vLLM's CPU build started
    by the trainer's own code (`target_engine_url`) in fp32, writing the hidden states of LAYERS."""
    from dflash_lib.target.facts import read_facts
    from dflash_lib.target.served import target_engine_url
    root = tmp_path_factory.mktemp("served_target")
    folder = _tiny_target(root, request.param)
    config = from_params({**RUN, "target": str(folder), "target_engine": "vllm"}, preset("smoke"))
    with target_engine_url(config, read_facts(config.model), root / "run", torch.device("cpu")) as url:
        yield request.param, folder, url, root / "run" / "engine_hidden_states"


@pytest.mark.engine
@pytest.mark.parametrize("served_target", ["qwen3", "qwen3_moe"], indirect=True)
def test_features_from_the_engine_equal_the_local_targets(served_target):
    """The engine's hidden states of a padded batch's documents, as the trainer's context, equal `TargetModel`'s
    forward of them in fp32 within rounding_atol (2 eps sqrt(TERMS) DEPTH = 1.1e-5 of the features' magnitude;
    another kernel order: measured 2.7e-7 for Qwen3); its embedding and LM head are the folder's."""
    from dflash_lib.config import ModelConfig
    from dflash_lib.data.batch import collate_padded
    from dflash_lib.target.local import TargetModel
    from dflash_lib.target.facts import read_facts
    from dflash_lib.target.served import ServedTarget

    _, folder, url, out = served_target
    model_cfg = ModelConfig(target=str(folder), target_layer_ids=LAYERS, num_features=2)
    local = TargetModel.from_model_config(model_cfg)
    files = EngineFiles.of(out, "features", folder, engine_layer_ids(LAYERS), "float32")
    served = ServedTarget(read_facts(model_cfg), url, "cpu", torch.float32, files=files)
    rng = np.random.default_rng(0)
    docs = [(rng.integers(0, 150_000, n), np.ones(n, bool)) for n in (37, 5, 120, 64)]
    batch = collate_padded(docs, 0)  # a row each, padded: the real tokens gathered
    try:
        want, got = local.context_features(batch), served.context_features(batch)
    finally:
        served.close()
    assert got.shape == want.shape == (226, 2 * 64) and want.abs().max() > 1.0
    torch.testing.assert_close(got, want, rtol=0, atol=rounding_atol(want, terms=TERMS, depth=DEPTH))
    assert torch.equal(served.embed_tokens.weight, local.embed_tokens.weight)
    assert torch.equal(served.lm_head.weight, local.lm_head.weight)


def _train_losses(folder: Path, run_dir: Path, *extra: str) -> list[float]:
    """`train --preset smoke` with RUN's settings (and `extra`) on the target `folder`: each step's loss."""
    from dflash_lib.__main__ import main

    args = [a for k, v in RUN.items() for a in ("-p", k, json.dumps(v) if isinstance(v, list) else str(v))]
    assert main(["train", "--preset", "smoke", "--run-dir", str(run_dir), "-p", "target", str(folder), *args,
                 *extra]) == 0
    rows = metrics_rows(run_dir)
    return [r["loss"] for r in rows if "loss" in r]


def _loss_rtol() -> float:
    """The losses of a run on the engine's features against the local run's, relative: the features' own relative
    bound (rounding_atol of a unit magnitude, 1.1e-5) carried with gain 1. Each step's loss is the drafter's (fc,
    then normalised blocks) of the features, which changes by no more than they do, relative; AdamW's updates
    m / sqrt(v) are scale-free and carry that along the 20 steps (features moved at random by the whole bound move
    these losses by 1.1e-7; every row's features one token late, by 6e-4)."""
    return rounding_atol(torch.ones(()), terms=TERMS, depth=DEPTH)


@pytest.fixture(scope="module")
def local_losses(served_target, tmp_path_factory) -> list[float]:
    """The losses of RUN on the served target's folder with the target local: what every run through the engine
    or its cache must equal (trained once for the module)."""
    folder = served_target[1]
    losses = _train_losses(folder, tmp_path_factory.mktemp("local_run"))
    assert len(losses) == 20
    return losses


@pytest.mark.engine
@pytest.mark.parametrize("served_target", ["qwen3"], indirect=True)
def test_training_from_the_engine_has_the_local_runs_losses(served_target, local_losses, tmp_path):
    """20 smoke steps with the target served (the same engine, by its url) and with it local: the same losses
    within the features' relative bound (`_loss_rtol`; measured 8e-8 for Qwen3); served with its features kept
    after their first request (`target_cache_gib`: epochs after the first ask the engine nothing) too."""
    _, folder, url, out = served_target
    losses = {"local": local_losses}
    engine = ["-p", "target_engine", "vllm", "-p", "target_engine_url", url, "-p", "target_engine_dir", str(out)]
    for name, extra in (("served", engine), ("kept", [*engine, "-p", "target_cache_gib", "1"])):
        losses[name] = _train_losses(folder, tmp_path / name, *extra)
    assert len(losses["local"]) == 20
    np.testing.assert_allclose(losses["served"], losses["local"], rtol=_loss_rtol())
    np.testing.assert_allclose(losses["kept"], losses["local"], rtol=_loss_rtol())
    kept = json.loads((tmp_path / "kept" / "summary.json").read_text())["target_cache"]
    assert kept["hit_batches"] > 0 and kept["samples"] > 0  # later epochs from host memory, not the engine


@pytest.mark.engine
@pytest.mark.parametrize("served_target", ["qwen3"], indirect=True)
def test_loss_ce_kl_from_the_engine_has_the_local_runs_losses(served_target, tmp_path):
    """loss ce+kl, refused from an engine before: the engine hands over the last layer's output (here layer 3 of 4
    is a feature layer too: the same engine's files), passed through the target's final norm read from the folder;
    20 smoke steps have the local ce+kl run's losses within the features' relative bound (`_loss_rtol`: the
    last layer is within the bound's depth)."""
    _, folder, url, out = served_target
    engine = ["-p", "target_engine", "vllm", "-p", "target_engine_url", url, "-p", "target_engine_dir", str(out)]
    local = _train_losses(folder, tmp_path / "local", "-p", "loss", "ce+kl")
    served = _train_losses(folder, tmp_path / "served", "-p", "loss", "ce+kl", *engine)
    assert len(local) == 20 and min(local) > 1.0
    np.testing.assert_allclose(served, local, rtol=_loss_rtol())


# -- the cache captured through the engine (the cache itself: tests/test_hidden_cache.py) --------------------

@pytest.mark.engine
@pytest.mark.parametrize("served_target", ["qwen3"], indirect=True)
def test_a_run_from_the_captured_cache_has_the_local_runs_losses(served_target, local_losses, tmp_path, capsys):
    """`capture` through the engine, then 20 smoke steps from the cache alone (no engine): the local run's losses
    within the features' relative bound (`_loss_rtol`), as from the engine online; the bytes per token printed
    first. Captured again once complete, it asks no engine."""
    from dflash_lib.__main__ import main

    _, folder, url, out_dir = served_target
    args = [a for k, v in RUN.items() for a in ("-p", k, json.dumps(v) if isinstance(v, list) else str(v))]
    common = ["--preset", "smoke", "-p", "target", str(folder), *args]
    assert main(["capture", *common, "-p", "target_engine", "vllm", "-p", "target_engine_url", url,
                 "-p", "target_engine_dir", str(out_dir),
                 "--out", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    assert "2 layers x 64 in float32 = 512 bytes a token" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["samples"] > 0 and summary["tokens"] > 0
    # a complete cache captured again: nothing asked of any engine (this URL answers nothing)
    assert main(["capture", *common, "-p", "target_engine", "vllm", "-p", "target_engine_url", "http://127.0.0.1:9",
                 "-p", "target_engine_dir", str(out_dir), "--out", str(tmp_path / "cache")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    cached = _train_losses(folder, tmp_path / "cached", "-p", "hidden_cache", str(tmp_path / "cache"))
    assert len(local_losses) == 20
    np.testing.assert_allclose(cached, local_losses, rtol=_loss_rtol())


# -- a server started by hand -------------------------------------------------------------------------------------

@pytest.mark.engine
@pytest.mark.slow  # its own engine start (~30 s)
def test_a_server_started_by_hand_is_checked_before_a_run_folder(installed_engine_python, tmp_path, capsys):
    """`engine-command` prints the `vllm serve` line for a run (layers 0 and 2 of a tiny target: vLLM's ids 1 and
    3); started by hand as printed, the run's probe passes. A run of layers 1 and 3 sees that server as one
    started with OUR numbering for its layers (ids 1 and 3 instead of 2 and 4): refused in one line, exit 2, no run
    folder; so is the first run once the folder's weights are replaced in place under the running server."""
    import os
    import signal
    import subprocess
    import time

    from dflash_lib.__main__ import main
    from dflash_lib.target.facts import read_facts
    from dflash_lib.target.served import probe_engine
    from loopback import free_port

    folder = _tiny_target(tmp_path, "qwen3")
    out = tmp_path / "engine_files"
    out.mkdir()
    served = ["--preset", "smoke", "-p", "target", str(folder), "-p", "target_layer_ids", "[0, 2]", "-p",
              "num_features", "2"]
    assert main(["engine-command", *served, "--dir", str(out)]) == 0
    command = capsys.readouterr().out.strip()
    assert '"eagle_aux_hidden_state_layer_ids": [1, 3]' in command and "--dtype float32" in command
    port = free_port()
    command = command.replace(" python -m ", f" {installed_engine_python} -m ", 1)  # `python`: the engine's
    with open(tmp_path / "engine.log", "wb") as log:
        proc = subprocess.Popen(["bash", "-c", f"{command} --host 127.0.0.1 --port {port} --enforce-eager "
                                 "--kv-cache-memory-bytes 268435456"], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "engine.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.5)
        by_hand = ["-p", "target_engine", "vllm", "-p", "target_engine_url", url, "-p", "target_engine_dir", str(out)]
        params = {"target": str(folder), "target_engine": "vllm", "target_engine_url": url,
                  "target_engine_dir": str(out), "num_features": 2}
        probed = from_params({**params, "target_layer_ids": [0, 2]}, preset("smoke"))
        probe_engine(probed, read_facts(probed.model), torch.device("cpu"))
        code = main(["train", "--preset", "smoke", "--run-dir", str(tmp_path / "run"), "-p", "target", str(folder),
                     "-p", "target_layer_ids", "[1, 3]", "-p", "num_features", "2", *by_hand])
        err = capsys.readouterr().err
        assert code == 2 and "writes aux layer ids [1, 3], this run reads [2, 4] (vLLM counts layer boundaries" in err
        assert not (tmp_path / "run").exists() and len(err.strip().splitlines()) == 1
        _tiny_target(tmp_path, "qwen3", seed=1)  # other weights of the same shapes, in place, the server running on
        with pytest.raises(EngineFileError, match="whose weights differ from this run's target"):
            probe_engine(probed, read_facts(probed.model), torch.device("cpu"))
        assert [p.name for p in out.iterdir()] == []  # the probes' files read and deleted, or cleaned
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=30)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
