"""The hidden-states cache (`target/cached.py`, `capture` then `train -p hidden_cache DIR`) without vLLM: the
local target stands in for the engine. What a cache vouches for: each shard's sha256 (checked at its first read),
the target's config and weights, the feature layers, the dtype it holds (the engine's), the token store; every
document's rows against its tokens; an older manifest refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from dflash_lib.config import ConfigError, from_params, preset

LAYERS = [1, 3]  # the tiny target's feature layers (of 4)
CACHED = {"steps": 6, "ckpt_every": 3, "lr": 0.01, "warmup_steps": 1, "limit": 50, "target_layer_ids": LAYERS,
          "num_features": 2, "dist_timeout_s": 30.0}  # smoke steps on a 50-sample store


def tiny_target_folder(root: Path) -> Path:
    """A random 4-layer Qwen3 of hidden 64 on Qwen3's vocabulary (the bundled tokenizer's ids fit), saved to
    root/qwen3."""
    import transformers

    from dflash_lib.families.qwen3 import QWEN3_VOCAB
    from tiny_models import save_random_model

    cfg = transformers.Qwen3Config(vocab_size=QWEN3_VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=32, intermediate_size=128)
    save_random_model(root / "qwen3", cfg, spread=(0.1, 0.5))
    return root / "qwen3"


def capture_locally(config, out: Path) -> dict:
    """`capture` of `config`'s whole token store into `out`, the LOCAL target (fp32, on the CPU) standing in for
    the engine: each document's (len, F, H) states from its forward alone (for a loss reading the final states,
    the last layer must be a feature layer: its output is then what the engine hands over). Returns the
    manifest."""
    from dflash_lib.data.batch import collate_padded
    from dflash_lib.target.cached import CacheIdentity
    from dflash_lib.target.capture import capture
    from dflash_lib.target.local import TargetModel
    from dflash_lib.target.facts import read_facts
    from dflash_lib.train.build import load_training_data

    data = load_training_data(config)
    target = TargetModel.from_model_config(config.model)
    F, H = target.num_features, target.hidden_size
    assert target.layer_ids == sorted(target.layer_ids)  # the engine's aux order is ours: pick = 0 .. F-1
    identity = CacheIdentity.of(config, target.layer_ids, H, data.full_store.meta["key"], torch.device("cpu"))
    facts = read_facts(config.model)
    final = identity.final_states
    assert facts.engine_layers(final) == [i + 1 for i in target.layer_ids]  # the stand-in holds the engine's layers

    def fetch(documents):
        batch = [collate_padded([(np.asarray(d), np.ones(len(d), np.uint8))], 0) for d in documents]
        return [target.context_features(b).reshape(len(d), F, H) for b, d in zip(batch, documents)]

    return capture(data.full_store, identity, out, fetch, torch.arange(F), vocab_size=target.vocab_size,
                   say=lambda _: None, progress=False,
                   last=facts.engine_last() if final else None)


@pytest.fixture(scope="module")
def cached_target(tmp_path_factory) -> tuple[Path, Path]:
    """(target folder, its cache of CACHED's token store), captured once for the module."""
    root = tmp_path_factory.mktemp("cached_target")
    folder = tiny_target_folder(root)
    capture_locally(from_params({**CACHED, "target": str(folder)}, preset("smoke")), root / "cache")
    return folder, root / "cache"


@pytest.mark.slow
def test_a_run_from_a_locally_captured_cache_has_the_local_runs_losses(cached_target, tmp_path):
    """6 smoke steps with the target's features read from the cache (no engine, no target forward) against the
    same run with the target local: the same losses within 1e-5 relative (measured equal here; the cache's features
    come from each document's forward alone, the local run's from its batches', and fp32 GEMMs may round by
    shape)."""
    from dflash_lib.train.loop import train
    from run_folder import metrics_rows

    folder, cache = cached_target
    params = {**CACHED, "target": str(folder)}
    train(from_params(params, preset("smoke")), tmp_path / "local")
    train(from_params({**params, "hidden_cache": str(cache)}, preset("smoke")), tmp_path / "cached")
    local, cached = ([r["loss"] for r in metrics_rows(tmp_path / d)] for d in ("local", "cached"))
    assert len(local) == 6 and min(local) > 1.0
    np.testing.assert_allclose(cached, local, rtol=1e-5)


@pytest.mark.slow
def test_a_loss_ce_kl_run_from_a_cache_has_the_local_runs_losses(tmp_path):
    """loss ce+kl, refused from a cache before: the cache holds the last layer's output (layer 3 of 4, a feature
    layer here), the served target passes it through the target's final norm read from the folder; 6 smoke steps
    from it have the local run's losses (and KL terms) within 1e-5 relative."""
    from dflash_lib.train.loop import train
    from run_folder import metrics_rows

    folder = tiny_target_folder(tmp_path)
    params = {**CACHED, "target": str(folder), "loss": "ce+kl"}
    capture_locally(from_params(params, preset("smoke")), tmp_path / "cache")
    train(from_params(params, preset("smoke")), tmp_path / "local")
    train(from_params({**params, "hidden_cache": str(tmp_path / "cache")}, preset("smoke")), tmp_path / "cached")
    local, cached = (metrics_rows(tmp_path / d) for d in ("local", "cached"))
    assert len(local) == 6 and min(r["loss"] for r in local) > 1.0
    np.testing.assert_allclose([r["loss"] for r in cached], [r["loss"] for r in local], rtol=1e-5)

# -- a cache of a stand-in store: documents of 3..12 token ids, states a function of them -----------------------

H = 8  # hidden size of the stand-in states and of the small target folders
VOCAB = 300  # token ids of the stand-in store and of the small target folders


class _Store:
    """A token store of `n` documents of 3..12 ids below VOCAB (ids and masks only), as `capture` reads one."""

    def __init__(self, n: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.docs = [rng.integers(0, VOCAB, int(k)).astype(np.uint32) for k in rng.integers(3, 13, n)]
        self.lengths = np.array([len(d) for d in self.docs])

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i):
        return self.docs[i], np.ones(len(self.docs[i]), np.uint8)


def _states(doc, dtype=torch.float32) -> torch.Tensor:
    """(len, 2 aux layers, H) stand-in hidden states of a document: token id / 7 + layer + unit / 10 (bf16 rounds
    most of them)."""
    ids = torch.tensor(np.asarray(doc, np.int64), dtype=torch.float64)[:, None, None] / 7
    return (ids + torch.arange(2.0)[None, :, None] + torch.arange(H)[None, None, :] / 10).to(dtype)


def _fetch(dtype=torch.float32, short=None):
    """A stand-in engine giving `_states` in `dtype`; the document `short` (token ids) one row short."""
    cut = [] if short is None else list(short)
    return lambda docs: [_states(d, dtype)[: len(d) - (list(d) == cut)] for d in docs]


def _identity(**changes):
    from dflash_lib.target.cached import CacheIdentity

    base = dict(target="/t", target_config_sha256="abc", layer_ids=(0, 1), hidden_size=H, dtype="float32",
                store_key="k1", target_weights_fingerprint="w", final_states=False)
    return CacheIdentity(**{**base, **changes})


def _capture(out: Path, store=None, identity=None, fetch=None, **kwargs) -> dict:
    from dflash_lib.target.capture import capture

    return capture(store or _Store(10), identity or _identity(), out, fetch or _fetch(), torch.tensor([0, 1]),
                   vocab_size=VOCAB, **kwargs,
                   say=lambda _: None, progress=False)


def _killable(calls: list[int], fail_after: int = -1):
    """A stand-in engine: hidden states (len, 3 aux layers, 2) that are functions of the token ids; raises (a killed
    capture) once `fail_after` requests have been answered."""
    def fetch(documents):
        if 0 <= fail_after <= len(calls):
            raise KeyboardInterrupt("killed")
        calls.append(len(documents))
        return [torch.tensor(d, dtype=torch.float32)[:, None, None] * torch.tensor([1.0, 10.0, 100.0])[None, :, None]
                + torch.tensor([0.0, 0.5])[None, None, :] for d in documents]
    return fetch


def test_a_killed_capture_resumes_without_a_duplicate_or_a_missing_sample(tmp_path, monkeypatch):
    """Shards of 4 samples; the capture is killed in its third shard and run again: every sample once, each
    document's features are its rows of the feature layers (aux 0 and 2 of 3), only the missing shards asked for."""
    import dflash_lib.target.cached as hc
    import dflash_lib.target.capture as cw

    monkeypatch.setattr(cw, "SHARD_SAMPLES", 4)
    store, pick = _Store(10), torch.tensor([0, 2])
    calls: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        cw.capture(store, _identity(layer_ids=(0, 2), hidden_size=2), tmp_path, _killable(calls, fail_after=2), pick,
                   vocab_size=VOCAB, say=lambda _: None, progress=False)
    assert calls == [4, 4] and [s["shard"] for s in hc.read_manifest(tmp_path)["shards"]] == [0, 1]
    assert not hc.read_manifest(tmp_path)["complete"]
    with pytest.raises(ConfigError, match="not a complete hidden-states cache"):
        hc.CapturedFeatures(tmp_path)
    cw.capture(store, _identity(layer_ids=(0, 2), hidden_size=2), tmp_path, _killable(calls), pick, vocab_size=VOCAB,
               say=lambda _: None, progress=False)
    assert calls == [4, 4, 2]  # the last shard only
    cache = hc.CapturedFeatures(tmp_path)
    assert len(cache.index) == len({hc.token_key(d) for d in store.docs}) == 10
    for doc in store.docs:
        want = torch.tensor(doc, dtype=torch.float32)[:, None] * torch.tensor([1.0, 1.0, 100.0, 100.0])[None] + \
            torch.tensor([0.0, 0.5, 0.0, 0.5])[None]
        torch.testing.assert_close(cache.get(doc), want, rtol=0, atol=0)
    assert cache.get(np.array([5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5], np.uint32)) is None


@pytest.mark.parametrize("change,says", [({"layer_ids": (1, 2)}, "another layer ids"),
                                         ({"store_key": "k2"}, "another store key"),
                                         ({"target_config_sha256": "def"}, "another target config sha256")])
def test_a_cache_of_another_target_layer_set_or_store_is_refused_in_one_line(tmp_path, change, says):
    import dflash_lib.target.cached as hc
    import dflash_lib.target.capture as cw

    cw.capture(_Store(3), _identity(layer_ids=(0, 2), hidden_size=2), tmp_path, _killable([]), torch.tensor([0, 2]),
               vocab_size=VOCAB, say=lambda _: None, progress=False)
    with pytest.raises(ConfigError, match=says) as e:
        _identity(**{"layer_ids": (0, 2), "hidden_size": 2, **change}).refuse_other(hc.CapturedFeatures(tmp_path).identity, tmp_path)
    assert "\n" not in str(e.value) and str(tmp_path) in str(e.value)
    with pytest.raises(ConfigError, match=says):  # capturing into it again, too
        cw.capture(_Store(3), _identity(**{"layer_ids": (0, 2), "hidden_size": 2, **change}), tmp_path, _killable([]),
                   torch.tensor([0, 2]), vocab_size=VOCAB, progress=False)


@pytest.fixture
def small_shards(monkeypatch):
    """Shards of 4 samples: 10 documents make 3 shards."""
    import dflash_lib.target.capture as cw

    monkeypatch.setattr(cw, "SHARD_SAMPLES", 4)


def _features_span(path: Path) -> tuple[int, int]:
    """The byte range [start, end) of a safetensors file's `features` data."""
    head = int.from_bytes(path.read_bytes()[:8], "little")
    lo, hi = json.loads(path.read_bytes()[8:8 + head])["features"]["data_offsets"]
    return 8 + head + lo, 8 + head + hi


def test_a_flipped_bit_in_a_shard_is_refused_at_the_first_read_of_that_shard_naming_it(tmp_path, small_shards,
                                                                                        monkeypatch):
    """One bit of shard 1's features flipped after capture: opening the cache hashes nothing (a shard is GBs); a
    document of shard 0 reads (its shard hashed once), a document of shard 1 is refused in one line naming the
    file; the flipped value is what would have been read."""
    import dflash_lib.target.cached as hc

    store = _Store(10)
    _capture(tmp_path, store)
    shard = tmp_path / "shard-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    start, _ = _features_span(shard)
    raw[start + 1] ^= 0x01  # a low mantissa bit of document 4's first feature
    shard.write_bytes(bytes(raw))
    hashed: list[str] = []
    real_sha = hc.file_sha256
    monkeypatch.setattr(hc, "file_sha256", lambda p: hashed.append(Path(p).name) or real_sha(p))
    cache = hc.CapturedFeatures(tmp_path)
    assert hashed == []
    want = _states(store.docs[0]).reshape(len(store.docs[0]), -1)
    torch.testing.assert_close(cache.get(store.docs[0]), want, rtol=0, atol=0)
    cache.get(store.docs[1])
    assert hashed == ["shard-00000.safetensors"]  # once per shard
    with pytest.raises(ConfigError, match=r"shard-00001\.safetensors: sha256 .* is not the manifest's") as e:
        cache.get(store.docs[4])
    assert "\n" not in str(e.value) and "capture again" in str(e.value)
    flipped = cache.files[1].get_slice("features")[0:1]  # read past the check: the bit really changed a value
    assert not torch.equal(flipped, _states(store.docs[4])[:1].reshape(1, -1))


def test_a_document_whose_rows_are_not_its_tokens_is_refused_naming_shard_and_document(tmp_path, small_shards):
    """Capture: an engine giving sample 5 one row short is refused before its shard is written. Read: shard 0's
    offsets rewritten so that documents 0 and 1 swap lengths (total unchanged, sha256 recomputed: only the rows
    are wrong): each is refused naming the shard and the document, documents 2 and 3 still read."""
    import dflash_lib.target.cached as hc
    from safetensors.torch import load_file, save_file

    store = _Store(10)
    with pytest.raises(ConfigError, match=rf"sample 5 has {len(store.docs[5])} tokens but the engine gave "
                                          rf"{len(store.docs[5]) - 1} rows") as e:
        _capture(tmp_path / "short", store, fetch=_fetch(short=store.docs[5]))  # in shard 1
    assert "\n" not in str(e.value)
    assert [s["shard"] for s in hc.read_manifest(tmp_path / "short")["shards"]] == [0]
    assert not (tmp_path / "short" / "shard-00001.safetensors").exists()

    _capture(tmp_path, store)
    shard = tmp_path / "shard-00000.safetensors"
    tensors = load_file(str(shard))
    n0, n1 = len(store.docs[0]), len(store.docs[1])
    assert n0 != n1
    tensors["offsets"][1] = n1  # [0, n1, n0 + n1, ...]: documents 0 and 1 swap lengths
    save_file(tensors, str(shard))
    doc = hc.read_manifest(tmp_path)
    doc["shards"][0]["sha256"] = hc.file_sha256(shard)
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    cache = hc.CapturedFeatures(tmp_path)
    for j, (rows, tokens) in enumerate([(n1, n0), (n0, n1)]):
        with pytest.raises(ConfigError, match=rf"shard-00000\.safetensors: document {j} of the shard has {rows} "
                                              rf"rows in its offsets but {tokens} tokens") as e:
            cache.get(store.docs[j])
        assert "\n" not in str(e.value)
    assert cache.get(store.docs[2]).shape == (len(store.docs[2]), 2 * H)



@pytest.mark.parametrize("spoil,says", [
    ("samples", r"keys \(4, 20\) and offsets \(5,\) for the manifest's 5 samples"),
    ("offsets", r"offsets 0 \.\. 1 not ascending from 0 to the manifest's \d+ tokens"),
    ("hidden_size", r"features \[\d+, 16\], the manifest's \[\d+, 18\]"),
    ("truncated", r"not a readable safetensors file \(\w+: .*\)")])
def test_a_shard_that_disagrees_with_its_manifest_is_refused_when_the_cache_opens(tmp_path, small_shards, spoil,
                                                                                  says):
    """Shard 0 against its manifest entry, checked at opening (headers, offsets and keys only): a sample count
    the shard does not hold, offsets that fall back (sha256 recomputed: only the offsets are wrong), a feature
    width other than the identity's F*H, a file cut short. Each refused in one line naming the shard file."""
    import dflash_lib.target.cached as hc
    from safetensors.torch import load_file, save_file

    _capture(tmp_path)
    doc = hc.read_manifest(tmp_path)
    shard = tmp_path / "shard-00000.safetensors"
    if spoil == "samples":
        doc["shards"][0]["samples"] = 5
    elif spoil == "offsets":
        tensors = load_file(str(shard))
        tensors["offsets"][-1] = 1
        save_file(tensors, str(shard))
        doc["shards"][0]["sha256"] = hc.file_sha256(shard)
    elif spoil == "hidden_size":
        doc["identity"]["hidden_size"] = H + 1
    else:  # a partial copy
        shard.write_bytes(shard.read_bytes()[:100])
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=rf"shard-00000\.safetensors: {says}: a broken shard") as e:
        hc.CapturedFeatures(tmp_path)
    assert "\n" not in str(e.value)

def test_an_older_manifest_is_refused_saying_to_capture_again(tmp_path, small_shards):
    """A format-1 manifest (no shard sha256, no weights fingerprint) is refused by the reader and by a capture
    into its folder, in one line that says to capture again; so is one naming no format."""
    import dflash_lib.target.cached as hc

    _capture(tmp_path)
    doc = hc.read_manifest(tmp_path)
    assert doc["format"] == hc.FORMAT == 4
    old = {**doc, "format": 1, "identity": {k: v for k, v in doc["identity"].items()
                                            if k != "target_weights_fingerprint"},
           "shards": [{k: v for k, v in s.items() if k != "sha256"} for s in doc["shards"]]}
    (tmp_path / "manifest.json").write_text(json.dumps(old))
    for attempt in (lambda: hc.CapturedFeatures(tmp_path), lambda: _capture(tmp_path)):
        with pytest.raises(ConfigError, match=r"manifest\.json: cache format 1, this version reads format 4 only "
                                              r".*: capture again into another folder") as e:
            attempt()
        assert "\n" not in str(e.value)
    (tmp_path / "manifest.json").write_text(json.dumps({k: v for k, v in old.items() if k != "format"}))
    with pytest.raises(ConfigError, match="cache format None, this version reads format 4 only"):
        hc.CapturedFeatures(tmp_path)


# -- the identity against a real target folder --------------------------------------------------------------------

def _small_folder(root: Path, seed: int = 0, family: str = "qwen3") -> Path:
    """A random 4-layer target of hidden H and VOCAB ids saved to root/family (qwen3, or qwen3_next: gated-delta-net
    layers between full attention ones, which vLLM's CPU build runs in bf16 only)."""
    import transformers

    from tiny_models import save_random_model

    shape = dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=4, intermediate_size=16)
    cfg = (transformers.Qwen3Config(**shape) if family == "qwen3" else transformers.Qwen3NextConfig(
        **shape, layer_types=["linear_attention", "full_attention"] * 2, linear_num_value_heads=2,
        linear_num_key_heads=1, linear_key_head_dim=4, linear_value_head_dim=4, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=8, shared_expert_intermediate_size=8))
    save_random_model(root / family, cfg, seed=seed)
    return root / family


def _config(folder: Path, cache: Path, **params):
    """The smoke preset on `folder`'s layers 1 and 3 (the stand-in's aux layers 0 and 1) reading `cache`."""
    return from_params({"target": str(folder), "hidden_cache": str(cache), "target_layer_ids": [1, 3],
                        "num_features": 2, **params}, preset("smoke"))


def _capture_for(config, store=None, fetch=None, device: str = "cpu") -> dict:
    """`config`'s identity (store key "k1") captured into its hidden_cache folder from the stand-in engine."""
    from dflash_lib.target.cached import CacheIdentity

    identity = CacheIdentity.of(config, [1, 3], H, "k1", torch.device(device))
    return _capture(Path(config.model.hidden_cache), store or _Store(3), identity, fetch)


def test_weights_replaced_in_place_are_refused_naming_the_setting(tmp_path):
    """A cache captured for a folder whose model.safetensors is then replaced by other random weights of the same
    shapes (config.json byte for byte the same): refused in one line naming the weights fingerprint."""
    from dflash_lib.serve.engine_plugins.model_identity import config_sha256
    from dflash_lib.target.cached import open_cache
    from dflash_lib.target.facts import read_facts

    folder = _small_folder(tmp_path)
    config = _config(folder, tmp_path / "cache")
    _capture_for(config)
    facts = read_facts(config.model)
    assert open_cache(config, facts, "k1", torch.device("cpu")).identity.target_weights_fingerprint != ""
    sha = config_sha256(folder)
    _small_folder(tmp_path, seed=1)  # the same shapes, other weights, in place
    assert config_sha256(folder) == sha
    with pytest.raises(ConfigError, match=r"cache: captured for another target weights fingerprint \('[0-9a-f]{64}'; "
                                          r"this run: '[0-9a-f]{64}'\): capture again") as e:
        open_cache(config, facts, "k1", torch.device("cpu"))
    assert "\n" not in str(e.value)


def _stored(cache: Path) -> tuple[str, str]:
    """(the manifest's dtype, the dtype of shard 0's features as safetensors names it)."""
    from dflash_lib.target.cached import read_manifest

    with safe_open(str(cache / "shard-00000.safetensors"), framework="pt") as f:
        return read_manifest(cache)["identity"]["dtype"], f.get_slice("features").get_dtype()


def test_a_bf16_runs_cache_is_stored_and_labelled_bf16_and_refused_by_an_fp32_run_and_vice_versa(tmp_path):
    """The same target and store captured for a bf16 and an fp32 run (the engine's states in fp32 both times):
    each cache holds and names its run's dtype, holds the states rounded to it, is read by its run and refused in
    one line by the other."""
    from dflash_lib.target.cached import CapturedFeatures, open_cache
    from dflash_lib.target.facts import read_facts

    folder = _small_folder(tmp_path)
    store = _Store(3)
    runs = {p: _config(folder, tmp_path / p, precision=p) for p in ("bf16", "fp32")}
    for p, config in runs.items():
        _capture_for(config, store)
    assert _stored(tmp_path / "bf16") == ("bfloat16", "BF16")
    assert _stored(tmp_path / "fp32") == ("float32", "F32")
    for p, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        got = CapturedFeatures(tmp_path / p).get(store.docs[0])
        assert torch.equal(got, _states(store.docs[0]).to(dtype).reshape(len(store.docs[0]), -1))
    assert not torch.equal(_states(store.docs[0]).bfloat16().float(), _states(store.docs[0]))  # bf16 rounds them
    for mine, other, held, theirs in (("bf16", "fp32", "bfloat16", "float32"), ("fp32", "bf16", "float32", "bfloat16")):
        open_cache(runs[mine], read_facts(runs[mine].model), "k1", torch.device("cpu"))
        reader = _config(folder, tmp_path / mine, precision=other)
        with pytest.raises(ConfigError, match=rf"{mine}: captured for another dtype \('{held}'; this run: "
                                              rf"'{theirs}'\)") as e:
            open_cache(reader, read_facts(reader.model), "k1", torch.device("cpu"))
        assert "\n" not in str(e.value)


class _Engines:
    """Stands in for `EngineServer` in `target_engine_url`: records each spec it is started with."""

    def __init__(self):
        self.specs = []

    def __call__(self, spec, *args, **kwargs):
        self.specs.append(spec)
        return self

    def __enter__(self):
        return type("Server", (), {"url": "http://engine"})()

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("family,precision,device,want", [
    ("qwen3", "fp32", "cpu", "float32"), ("qwen3", "bf16", "cpu", "bfloat16"),
    ("qwen3_next", "fp32", "cpu", "bfloat16"),  # vLLM's CPU gated-delta-net kernel runs bf16 only
    ("qwen3_next", "bf16", "cpu", "bfloat16"), ("qwen3", "fp32", "cuda", "bfloat16")])
def test_the_cache_is_labelled_the_dtype_its_engine_is_started_in(tmp_path, monkeypatch, family, precision, device,
                                                                  want):
    """A cache's identity names the dtype `target_engine_url` starts the engine in, for a bf16 and an fp32 run, a
    linear-attention target on the CPU and a target on a GPU."""
    import transformers

    import dflash_lib.target.served as hs
    from dflash_lib.target.cached import CacheIdentity
    from dflash_lib.target.facts import read_facts

    shape = dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1)
    cfg = (transformers.Qwen3Config(**shape) if family == "qwen3" else
           transformers.Qwen3NextConfig(**shape, layer_types=["linear_attention", "full_attention"] * 2))
    cfg.save_pretrained(tmp_path / family)  # config.json alone: no weight is read
    config = _config(tmp_path / family, tmp_path / "cache", precision=precision)
    engines = _Engines()
    monkeypatch.setattr(hs, "EngineServer", engines)
    with hs.target_engine_url(config, read_facts(config.model), tmp_path / "run", torch.device(device)) as url:
        assert url == "http://engine"
    assert [s.dtype for s in engines.specs] == [want]
    assert CacheIdentity.of(config, [1, 3], H, "k1", torch.device(device)).dtype == want


def test_a_linear_attention_targets_cache_holds_bf16_and_an_fp32_run_reads_it_converted(tmp_path):
    """An fp32 run on the CPU with a gated-delta-net target: its engine runs bf16, so its cache holds and names
    bfloat16; the run reads it and its served target hands the drafter the stored values in fp32, as from the
    engine online. An engine's bf16 states under a cache labelled float32 are refused in one line."""
    from dflash_lib.data.batch import collate_padded
    from dflash_lib.target.cached import open_cache
    from dflash_lib.target.facts import read_facts
    from dflash_lib.target.served import ServedTarget

    folder = _small_folder(tmp_path, family="qwen3_next")
    config = _config(folder, tmp_path / "cache", precision="fp32")
    store = _Store(3)
    _capture_for(config, store, fetch=_fetch(torch.bfloat16))
    assert _stored(tmp_path / "cache") == ("bfloat16", "BF16")
    facts = read_facts(config.model)
    cache = open_cache(config, facts, "k1", torch.device("cpu"))
    served = ServedTarget(facts, "", "cpu", torch.float32, cache=cache)
    batch = collate_padded([(d.astype(np.int64), np.ones(len(d), np.uint8)) for d in store.docs], 0)
    got = served.context_features(batch)
    want = torch.cat([_states(d, torch.bfloat16).reshape(len(d), -1) for d in store.docs]).float()
    assert got.dtype == torch.float32 and torch.equal(got, want)
    with pytest.raises(ConfigError, match=r"the engine gave torch\.bfloat16 hidden states \(sample 0\) for a cache of "
                                          r"float32: serve the target in float32") as e:
        _capture(tmp_path / "labelled_fp32", store, fetch=_fetch(torch.bfloat16))
    assert "\n" not in str(e.value)


# -- the capture on a real disk: free space, a full disk, the samples training reads, one writer, one copy, fp8 -----

def _shard_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("shard-"))


def test_the_free_space_is_checked_against_the_projected_total_before_the_first_shard(tmp_path, small_shards,
                                                                                     monkeypatch):
    """The projection (tokens x bytes a token, keys and offsets) against `shutil.disk_usage`: a byte short is
    refused in one line naming the folder before the engine is asked for anything or a shard is written; exactly
    enough captures, and the shards take the projected bytes plus their headers."""
    import shutil

    import dflash_lib.target.cached as hc
    import dflash_lib.target.capture as cw

    store, asked = _Store(10), []
    plan = cw.plan_capture(store, _identity(), "float32", VOCAB, 4)
    projected = sum(plan.shard_bytes(k) for k in range(plan.shards))
    assert plan.bytes_per_token == 2 * H * 4 and projected == int(store.lengths.sum()) * 64 + 10 * 28 + 3 * 8
    real = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real._replace(free=projected - 1))
    fetch = lambda docs: asked.append(len(docs)) or _fetch()(docs)  # noqa: E731
    with pytest.raises(ConfigError, match=rf"capture into {tmp_path}: 0\.00 GiB free on its disk, the capture writes "
                                          r"0\.00 GiB more \(\d+ tokens x 64 bytes a token in all\): make room") as e:
        _capture(tmp_path, store, fetch=fetch)
    assert "\n" not in str(e.value) and asked == [] and _shard_files(tmp_path) == []
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real._replace(free=projected))
    _capture(tmp_path, store, fetch=fetch)
    assert asked == [4, 4, 2] and hc.read_manifest(tmp_path)["complete"]
    written = sum((tmp_path / name).stat().st_size for name in _shard_files(tmp_path))
    assert projected < written < projected + 3 * 1024  # each shard's safetensors header: under 1 KiB here


class _DiskFull:
    """Stands in for safetensors' `save_file` on a disk that fills while shard `at` is written: half its bytes
    reach the temporary file, then OSError ENOSPC, or SafetensorError as safetensors words it."""

    def __init__(self, at: int, kind: str):
        from safetensors.torch import save_file

        self.at, self.kind, self.save, self.calls = at, kind, save_file, 0

    def __call__(self, tensors, path, metadata=None):
        import errno

        from safetensors import SafetensorError

        self.calls += 1
        if self.calls - 1 != self.at:
            return self.save(tensors, path, metadata)
        self.save(tensors, path, metadata)
        Path(path).write_bytes(Path(path).read_bytes()[: Path(path).stat().st_size // 2])
        if self.kind == "safetensors":
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("kind", ["oserror", "safetensors", "manifest"])
def test_a_disk_that_fills_stops_the_capture_in_one_line_and_the_capture_resumes(tmp_path, small_shards,
                                                                                monkeypatch, kind):
    """The disk fills while shard 1 of 3 is written (its file half written, then ENOSPC: from the OS, as
    safetensors words it, or from the manifest's write once the shard is whole): one line naming the folder and
    what is whole; no shard 1, no temporary file; the manifest names shard 0 and is not complete. The same capture
    run again resumes at shard 1 and every sample reads back."""
    import errno

    import dflash_lib.target.cached as hc
    import dflash_lib.target.capture as cw

    store = _Store(10)
    if kind == "manifest":
        real_write, writes = Path.write_text, []

        def write_text(self, text, *args, **kwargs):
            if self.name == "manifest.json.part":
                writes.append(self.name)
                if len(writes) == 3:  # the new manifest's, shard 0's, then shard 1's: the disk is full
                    real_write(self, text[: len(text) // 2])
                    raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(self, text, *args, **kwargs)

        monkeypatch.setattr(Path, "write_text", write_text)
    else:
        monkeypatch.setattr(cw, "save_file", _DiskFull(1, kind))
    with pytest.raises(ConfigError, match=rf"capture into {tmp_path}: writing shard-00001\.safetensors failed "
                                          r"\((OSError|SafetensorError)"
                                          r": .*No space left on device.*\); 1 of 3 shards are whole and named in its "
                                          r"manifest\.json, [\d.]+ GiB free: make room and capture again") as e:
        _capture(tmp_path, store)
    assert "\n" not in str(e.value)
    assert _shard_files(tmp_path) == ["shard-00000.safetensors"] and not list(tmp_path.glob("*.part"))
    doc = hc.read_manifest(tmp_path)
    assert [s["shard"] for s in doc["shards"]] == [0] and not doc["complete"]
    monkeypatch.undo()
    monkeypatch.setattr(cw, "SHARD_SAMPLES", 4)
    asked = []
    _capture(tmp_path, store, fetch=lambda docs: asked.append(len(docs)) or _fetch()(docs))
    assert asked == [4, 2]
    cache = hc.CapturedFeatures(tmp_path)
    for d in store.docs:
        assert torch.equal(cache.get(d), _states(d).reshape(len(d), -1))


class _MaskedStore(_Store):
    """`_Store` with loss masks: sample 2 holds the id VOCAB, sample 6 the id VOCAB + 5 (outside the target's
    vocabulary) and sample 8 scores no token."""

    def __init__(self, n: int):
        super().__init__(n)
        self.docs[2][1], self.docs[6][0] = VOCAB, VOCAB + 5
        self.masks = [np.ones(len(d), np.uint8) for d in self.docs]
        self.masks[8][:] = 0

    def __getitem__(self, i):
        return self.docs[i], self.masks[i]


def test_samples_training_skips_are_not_captured_and_counted_as_training_counts_them(tmp_path, small_shards):
    """Two samples with an id outside the target's vocabulary and one without a scored token: the engine is never
    asked for them, the manifest counts them by the reasons (and counts) the trainer's collate gives the same
    store, and the cache holds the other 7 (two shards)."""
    import dflash_lib.target.cached as hc
    from dflash_lib.train.feed import Work, make_collate

    store, asked = _MaskedStore(10), []
    doc = _capture(tmp_path, store, fetch=lambda docs: asked.extend(docs) or _fetch()(docs))
    assert max(max(d) for d in asked) < VOCAB and len(asked) == 7
    trainer = make_collate(store, False, 0, 64, vocab_size=VOCAB)(Work(0, 0, 0, True, list(range(10)))).skips
    assert sorted(i for _, i, _ in trainer) == [2, 6, 8]
    counted: dict[str, int] = {}
    for reason, _, _ in trainer:
        counted[reason] = counted.get(reason, 0) + 1
    assert doc["skipped"] == counted == {"token_out_of_vocab": 2, "no_assistant_token": 1}
    assert doc["samples"] == 7 and [s["samples"] for s in doc["shards"]] == [4, 3]
    cache = hc.CapturedFeatures(tmp_path)
    assert [i for i, d in enumerate(store.docs) if cache.get(d) is None] == [2, 6, 8]


def test_a_second_capture_into_the_same_folder_is_refused_in_one_line_and_a_dead_holders_lock_is_taken(
        tmp_path, small_shards):
    """While a capture writes the folder (its fetch of shard 1 running), a second capture into it is refused in one
    line naming the lock file and its holder (pid, host); the first finishes and removes its lock. A lock file left
    by a holder that died (its pid written, no lock held: the kernel dropped it) does not stop the next capture."""
    import json
    import os
    import socket

    store, refusals = _Store(10), []

    def fetch(documents):
        if not refusals:
            with pytest.raises(ConfigError) as e:
                _capture(tmp_path, store)
            refusals.append(str(e.value))
        return _fetch()(documents)

    _capture(tmp_path, store, fetch=fetch)
    assert len(refusals) == 1 and "\n" not in refusals[0]
    assert refusals[0].startswith(f"{tmp_path / 'capture.lock'}: another capture into {tmp_path} holds this lock "
                                  f"(pid {os.getpid()} on {socket.gethostname()} since ")
    assert not (tmp_path / "capture.lock").exists()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "capture.lock").write_text(json.dumps({"pid": 2**22 + 1, "host": socket.gethostname(),
                                                                 "since": "2026-01-01T00:00:00Z"}))
    assert _capture(tmp_path / "other", store)["complete"]


def test_a_resume_with_another_shard_size_or_stored_dtype_is_refused_naming_the_setting(tmp_path, small_shards,
                                                                                       monkeypatch):
    """A capture killed after shard 0 of shards of 4, resumed with shards of 5 or into float8_e4m3fn: each refused in
    one line naming the setting (shard_samples, hidden_cache_dtype) before the engine is asked for anything; the
    same settings resume it."""
    import dflash_lib.target.capture as cw

    store, calls = _Store(10), []
    with pytest.raises(KeyboardInterrupt):
        cw.capture(store, _identity(layer_ids=(0, 2), hidden_size=2), tmp_path, _killable(calls, fail_after=1),
                   torch.tensor([0, 2]), vocab_size=VOCAB, say=lambda _: None, progress=False)
    for change, says in (({"shard_samples": 5}, r"captured in shards of 4 samples, this version writes shards of 5 "
                                                r"\(shard_samples\)"),
                         ({"stored": "float8_e4m3fn"}, r"its shards hold float32, this capture writes float8_e4m3fn "
                                                       r"\(hidden_cache_dtype\): resume with -p hidden_cache_dtype "
                                                       r"engine")):
        monkeypatch.setattr(cw, "SHARD_SAMPLES", change.get("shard_samples", 4))
        with pytest.raises(ConfigError, match=rf"manifest\.json: {says}") as e:
            cw.capture(store, _identity(layer_ids=(0, 2), hidden_size=2), tmp_path, _killable(calls),
                       torch.tensor([0, 2]), vocab_size=VOCAB, stored=change.get("stored"), say=lambda _: None,
                       progress=False)
        assert "\n" not in str(e.value) and calls == [4]
    monkeypatch.setattr(cw, "SHARD_SAMPLES", 4)
    cw.capture(store, _identity(layer_ids=(0, 2), hidden_size=2), tmp_path, _killable(calls), torch.tensor([0, 2]),
               vocab_size=VOCAB, say=lambda _: None, progress=False)
    assert calls == [4, 4, 2]


def test_a_shard_is_held_once_in_host_memory():
    """benchmarks/capture_memory.py in a fresh process, one shard of 64 documents x 256 tokens x 2 layers x 512 in
    bf16 (32 MiB): the capture's peak resident memory above its start is under 1.5 shards (the shard's buffer:
    measured 1.0; a concatenation of per-document picks held it 3 times, 2.0 shards above the engine's states)."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-P", str(root / "benchmarks" / "capture_memory.py"), "--child",
                          "--samples", "64", "--tokens", "256", "--layers", "2", "--hidden", "512", "--case",
                          "bfloat16:bfloat16"], capture_output=True, text=True, check=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(root)})
    got = json.loads(out.stdout)
    assert got["shard_mib"] == pytest.approx(32.0, abs=0.1) and got["times_the_shard"] < 1.5, got


def test_an_fp8_cache_holds_half_the_bytes_of_bf16_and_reads_back_within_e4m3s_rounding(tmp_path):
    """The same bf16 states (hidden 256, feature layers and the last layer's output) captured into bfloat16 and
    float8_e4m3fn: (H + 4) / 2H of the bytes a token (0.508 here; the shard's data is the projection), the scales
    beside the rows in the shard; read
    back in bf16, each value within e4m3's rounding of the bf16 one (1/16 of itself, or 2^-10 of its row's
    maximum over 448 near 0)."""
    import dflash_lib.target.cached as hc
    import dflash_lib.target.capture as cw

    Hs, store = 256, _Store(6)
    states = {hc.token_key(d): torch.randn(len(d), 3, Hs, generator=torch.Generator().manual_seed(i)).mul_(
        torch.logspace(-2, 2, Hs)).bfloat16() for i, d in enumerate(store.docs)}  # rows spanning 4 decades
    fetch = lambda docs: [states[hc.token_key(d)].clone() for d in docs]  # noqa: E731
    identity = _identity(layer_ids=(0, 1), hidden_size=Hs, dtype="bfloat16", final_states=True)
    for stored in ("bfloat16", "float8_e4m3fn"):
        cw.capture(store, identity, tmp_path / stored, fetch, torch.tensor([0, 1]), vocab_size=VOCAB, stored=stored,
                   say=lambda _: None, progress=False, last=2)
    plans = {s: cw.plan_capture(store, identity, s, VOCAB, 256) for s in ("bfloat16", "float8_e4m3fn")}
    assert plans["bfloat16"].bytes_per_token == 3 * 2 * Hs and plans["float8_e4m3fn"].bytes_per_token == 3 * (Hs + 4)
    for s, plan in plans.items():  # the shard's data after its header: exactly the projection
        raw = (tmp_path / s / "shard-00000.safetensors").read_bytes()
        assert len(raw) - 8 - int.from_bytes(raw[:8], "little") == plan.shard_bytes(0)
    with safe_open(str(tmp_path / "float8_e4m3fn" / "shard-00000.safetensors"), framework="pt") as f:
        assert {k: f.get_slice(k).get_dtype() for k in f.keys()} == {
            "features": "F8_E4M3", "features_scale": "F32", "last": "F8_E4M3", "last_scale": "F32", "offsets": "I64",
            "keys": "U8"}
    bf16, fp8 = hc.CapturedFeatures(tmp_path / "bfloat16"), hc.CapturedFeatures(tmp_path / "float8_e4m3fn")
    for d in store.docs:
        for got, want in ((fp8.get(d), bf16.get(d)), (fp8.get_last(d), bf16.get_last(d))):
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            rows = want.float().view(len(d), -1, Hs)
            bound = rows.abs() * (2**-4 + 2**-8) + rows.abs().amax(-1, keepdim=True) * 2**-10 / 448
            err = (got.float().view_as(rows) - rows).abs()
            assert bool((err <= bound).all()) and float(err.max()) > 0  # rounded, within e4m3's step
