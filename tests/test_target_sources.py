"""Every source of the target's features behind one interface (`dflash_lib/target/`): the facts read once from the
target's config, vLLM's layer numbering in one place, and each source (local, sharded, served from a captured
cache) a `FeatureSource` whose features agree with the local target's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_lib.config import ConfigError, ModelConfig, from_params, preset
from dflash_lib.data.batch import collate_padded
from dflash_lib.models.target_parts import TargetParts
from dflash_lib.target.cached import CacheIdentity, CapturedFeatures
from dflash_lib.target.capture import capture
from dflash_lib.target.facts import read_facts
from dflash_lib.target.local import TargetModel
from dflash_lib.target.protocol import FeatureSource
from dflash_lib.target.served import ServedTarget
from dflash_lib.target.sharded import ShardedTarget
from tiny_models import save_tiny_qwen3

LAYERS = [1, 3]  # feature layers of the 4-layer tiny target


class _Store:
    """A token store of `docs` (what `capture` reads: len, lengths, store[i] -> (ids, loss mask))."""

    def __init__(self, docs: list[np.ndarray]) -> None:
        self.docs, self.lengths = docs, [len(d) for d in docs]

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.docs[i], np.ones(len(self.docs[i]), np.uint8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("target")
    save_tiny_qwen3(root / "t", seed=0, vocab_size=512)
    return root / "t"


def test_the_facts_read_from_the_folder_are_what_the_loaded_target_reports(folder):
    cfg = ModelConfig(target=str(folder), target_layer_ids=LAYERS, num_features=2)
    facts, local = read_facts(cfg), TargetModel.from_model_config(cfg)
    assert (facts.num_layers, facts.hidden_size, facts.vocab_size, list(facts.layer_ids), facts.num_features) == \
        (local.num_layers, local.hidden_size, local.vocab_size, local.layer_ids, local.num_features) == (4, 64, 512,
                                                                                                         LAYERS, 2)
    assert list(facts.layer_kinds) == local.layer_kinds and facts.target == local.name_or_path == str(folder)
    assert facts.tied_head == (local.lm_head.weight is local.embed_tokens.weight)


def test_vllms_numbering_of_the_feature_layers_and_the_refused_ids():
    """vLLM counts layer boundaries: our layer i is its id i + 1; the file holds them sorted and unique, and each
    feature picks its layer of the file."""
    facts = read_facts(ModelConfig(target="tiny", target_layers=6, hidden_size=32, target_layer_ids=[5, 0, 5],
                                   num_features=3))
    assert facts.engine_layers() == [1, 6] and facts.engine_pick().tolist() == [1, 0, 1]
    assert facts.engine_layers(final=True) == [1, 6] and facts.engine_last() == 1  # layer 5 is the last
    with pytest.raises(ConfigError, match=r"target layer ids \[0, 9\]: \[9\] outside \[0, 6\)"):
        read_facts(ModelConfig(target="tiny", target_layers=6, hidden_size=32, target_layer_ids=[0, 9],
                               num_features=2))


def test_every_source_is_a_feature_source_and_the_cached_one_gives_the_local_features(folder, tmp_path):
    """The local target and the served one reading a cache captured from it answer `FeatureSource`; the served
    one's context features of a padded batch are the cached ones bit for bit (fp32) and the local target's forward
    of that batch within fp32 rounding;
    the sharded target's class defines every member (it needs a process group to be built)."""
    config = from_params({"target": str(folder), "target_layer_ids": LAYERS, "num_features": 2,
                          "hidden_cache": str(tmp_path / "cache"), "precision": "fp32"}, preset("smoke"))
    facts = read_facts(config.model)
    local = TargetModel.from_model_config(config.model)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 512, n).astype(np.int64) for n in (9, 3, 14)]
    F, H = facts.num_features, facts.hidden_size

    def fetch(documents):  # the local target stands in for the engine: one document a forward
        return [local.context_features(collate_padded([(np.asarray(d), np.ones(len(d), np.uint8))], 0))
                .reshape(len(d), F, H) for d in documents]

    identity = CacheIdentity.of(config, facts.layer_ids, H, "k1", torch.device("cpu"))
    capture(_Store(docs), identity, tmp_path / "cache", fetch, facts.engine_pick(), vocab_size=facts.vocab_size,
            say=lambda _: None, progress=False)
    served = ServedTarget(facts, "", "cpu", torch.float32, cache=CapturedFeatures(tmp_path / "cache"))
    try:
        assert isinstance(local, FeatureSource) and isinstance(served, FeatureSource)
        batch = collate_padded([(d, np.ones(len(d), np.uint8)) for d in docs], 0)  # padded rows: real tokens only
        got, batched = served.context_features(batch), local.context_features(batch)
        alone = torch.cat([s.reshape(len(d), F * H) for s, d in zip(fetch(docs), docs)])  # what the cache holds
        assert got.shape == batched.shape == (sum(len(d) for d in docs), F * H) and torch.equal(got, alone)
        torch.testing.assert_close(got, batched)  # another batch of the same documents: fp32 rounding apart
        assert torch.equal(served.embed_tokens.weight, local.embed_tokens.weight)
        assert served.hf is facts.hf and local.hf is local.model.config  # the config a drafter is shaped from
        assert torch.equal(served.lm_head.weight, local.lm_head.weight)
    finally:
        served.close()
    members = [m for proto in (TargetParts, FeatureSource)  # FeatureSource extends what the drafter shares
               for m in [*proto.__annotations__,
                         *(n for n, v in vars(proto).items()
                           if not n.startswith("_") and callable(v) or isinstance(v, property))]]
    assert len(members) == 14 and [m for m in members if not hasattr(ShardedTarget, m)] == []
    assert not isinstance(object(), FeatureSource)  # the check can fail


def test_the_cached_targets_final_states_equal_the_local_targets(folder, tmp_path):
    """Loss kl from a cache: the capture holds the last layer's output beside the feature layers (0 and 2 of 4: the
    last, 3, is not one of them), and the served target passes it through the target's own final norm read from
    the folder: its features and final-normed states at the scored rows equal the local target's forward of the
    batch within fp32 rounding. Opened for loss ce, a served target refuses them in one line."""
    config = from_params({"target": str(folder), "target_layer_ids": [0, 2], "num_features": 2, "loss": "kl",
                          "hidden_cache": str(tmp_path / "cache"), "precision": "fp32"}, preset("smoke"))
    facts = read_facts(config.model)
    H = facts.hidden_size
    assert facts.engine_layers(final=True) == [1, 3, 4] and facts.engine_last() == 2
    assert facts.engine_pick(final=True).tolist() == [0, 1]
    local = TargetModel.from_model_config(config.model)
    engine = TargetModel.from_model_config(ModelConfig(target=str(folder), target_layer_ids=[0, 2, 3],
                                                       num_features=3))  # what vLLM's file holds: ids 1, 3, 4
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 512, n).astype(np.int64) for n in (11, 4, 17)]

    def fetch(documents):
        return [engine.context_features(collate_padded([(np.asarray(d), np.ones(len(d), np.uint8))], 0))
                .reshape(len(d), 3, H) for d in documents]

    identity = CacheIdentity.of(config, facts.layer_ids, H, "k1", torch.device("cpu"))
    assert identity.final_states
    capture(_Store(docs), identity, tmp_path / "cache", fetch, facts.engine_pick(True), vocab_size=facts.vocab_size,
            say=lambda _: None, progress=False, last=facts.engine_last())
    cache = CapturedFeatures(tmp_path / "cache")
    served = ServedTarget(facts, "", "cpu", torch.float32, cache=cache, final=True)
    batch = collate_padded([(d, np.ones(len(d), np.uint8)) for d in docs], 0)
    rows = torch.tensor([0, 10, 11, 14, 20, 31])  # context entries (real tokens, row-major) a loss scores
    (feats, final), (want_feats, want_final) = (t.context_features_and_final(batch, rows) for t in (served, local))
    assert final.shape == want_final.shape == (6, H) and feats.shape == want_feats.shape == (32, 2 * H)
    torch.testing.assert_close(feats, want_feats)
    torch.testing.assert_close(final, want_final)
    raw = torch.cat([cache.get_last(d) for d in docs])[rows]  # before the final norm: far from the normed states
    assert (raw - want_final).abs().max() > 100 * (final - want_final).abs().max()
    assert torch.equal(served.norm.weight, local.base.norm.weight)
    with pytest.raises(ConfigError, match="opened for loss ce .* open it with final=True"):
        ServedTarget(facts, "", "cpu", torch.float32, cache=cache).context_features_and_final(batch, rows)
