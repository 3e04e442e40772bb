"""The target feature cache (`pipeline.target_cache_gib`): a batch of cached samples gets the features (and loss kl's
final states) a fresh target forward of THAT batch gives, without running the target; a run with the cache trains
as one without it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_lib.config import ConfigError, from_params
from dflash_lib.data.batch import collate_packed, collate_padded
from dflash_lib.models import tiny_qwen3_config
from dflash_lib.target.local import TargetModel
from dflash_lib.target.feature_cache import FeatureCache
from dflash_lib.train.feed import Collated, Work, make_target_workers
from run_folder import metrics_rows
from test_loss_kl import _docs
from test_train import run_loop
from tiny_models import HIDDEN, VOCAB, tiny_drafter


def _target(gather: bool) -> TargetModel:
    hf = tiny_qwen3_config(hidden_size=HIDDEN, num_layers=4, vocab_size=VOCAB)
    return TargetModel.from_hf_config(hf, 2, dtype=torch.float64, seed=0, gather=gather)


def _collated(drafter, batch, seed=0):
    layout = drafter.layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(seed)))
    return Collated(Work(0, 0, 0, True, list(batch.indices)), batch, (), layout)


class _Counting:
    """The target, counting its forwards."""

    def __init__(self, target):
        self.target, self.forwards = target, 0

    def __getattr__(self, name):
        return getattr(self.target, name)

    def context_features(self, *a, **k):
        self.forwards += 1
        return self.target.context_features(*a, **k)

    def context_features_and_final(self, *a, **k):
        self.forwards += 1
        return self.target.context_features_and_final(*a, **k)


@pytest.mark.parametrize("loss", ["ce", "kl"])
@pytest.mark.parametrize("gather", [True, False])
def test_a_cached_batch_gets_a_fresh_forwards_features_without_running_the_target(loss, gather):
    """Fill the cache from a padded batch of docs 0-3; a packed batch of docs 2, 0, 3 (another layout, order and
    composition) then comes from the cache, equal to the target's own forward of it (gather off: the padding slots
    run and are zero, as the target gives them)."""
    target = _target(gather)
    counted = _Counting(target)
    drafter = tiny_drafter(target, loss=loss).to(torch.float64)
    docs = _docs((21, 13, 9, 17))
    cache = FeatureCache(2**30)
    cached = make_target_workers([counted], 1, torch.device("cpu"), cache=cache)[0]
    plain = make_target_workers([target], 1, torch.device("cpu"))[0]
    first = collate_padded(docs, 0, [10, 11, 12, 13])
    c = _collated(drafter, first)
    got, want = cached(c), plain(c)
    assert torch.equal(got.features, want.features) and counted.forwards == 1  # a miss: the target ran
    if loss == "kl":
        assert torch.equal(got.target_hidden, want.target_hidden)
    second = collate_packed([docs[2], docs[0], docs[3]], 0, 64, [12, 10, 13])
    c = _collated(drafter, second, seed=1)
    got, want = cached(c), plain(c)
    assert counted.forwards == 1  # a hit: no forward
    assert got.features.shape == want.features.shape
    torch.testing.assert_close(got.features, want.features, rtol=1e-10, atol=1e-10)
    if loss == "kl":
        torch.testing.assert_close(got.target_hidden, want.target_hidden, rtol=1e-10, atol=1e-10)
    else:
        assert got.target_hidden is None
    assert (cache.stats.hit_batches, cache.stats.miss_batches, cache.stats.samples) == (1, 1, 4)
    third = collate_padded([docs[1], _docs((11,), seed=5)[0]], 0, [11, 99])  # sample 99 never seen: a miss
    cached(_collated(drafter, third))
    assert counted.forwards == 2 and cache.stats.samples == 5


def test_the_budget_bounds_what_is_kept():
    target = _target(True)
    drafter = tiny_drafter(target).to(torch.float64)
    docs = _docs((21, 13, 9, 17))
    width = 2 * HIDDEN * 8  # features per token: 2 layers x hidden, float64
    cache = FeatureCache(width * (21 + 13))  # room for docs 0 and 1 only
    worker = make_target_workers([target], 1, torch.device("cpu"), cache=cache)[0]
    worker(_collated(drafter, collate_padded(docs, 0, [0, 1, 2, 3])))
    assert (cache.stats.samples, cache.stats.refused, cache.stats.bytes) == (2, 2, width * 34)
    worker(_collated(drafter, collate_padded(docs[:2], 0, [0, 1])))
    worker(_collated(drafter, collate_padded(docs[1:3], 0, [1, 2])))
    assert (cache.stats.hit_batches, cache.stats.miss_batches) == (1, 2)


def test_a_sharded_target_refuses_the_cache():
    with pytest.raises(ConfigError, match="target_cache_gib"):
        from_params({"target_cache_gib": 1.0, "target_parallel": "fsdp"})
    with pytest.raises(ConfigError, match="target_cache_gib"):
        make_target_workers([_target(True)], 1, torch.device("cpu"), passes_per_step=2, cache=FeatureCache(1))
    with pytest.raises(ConfigError, match="target_cache_gib"):
        from_params({"target_cache_gib": -1.0})


@pytest.mark.parametrize("loss", ["ce", pytest.param("kl", marks=pytest.mark.slow)])  # kl: ~11 s, make test
def test_a_run_with_the_cache_trains_as_one_without(tmp_path, loss):
    """Three epochs of 8 batches: the first runs the target, the next two come from the cache; the losses equal
    those of a run without it (float32: the same sample's features in another batch differ by rounding at most)."""
    from test_train import make_store

    data = make_store()
    runs = {}
    for gib in (0.0, 0.01):
        out = tmp_path / str(gib)
        summary, _, _ = run_loop(out, data, steps=24, target_cache_gib=gib, loss=loss)
        runs[gib] = [r["loss"] for r in metrics_rows(out)], summary
    (plain, s0), (cached, s1) = runs[0.0], runs[0.01]
    assert s0.target_cache is None
    stats = s1.target_cache  # the pipeline reads ahead of the steps: more hits than the steps took
    assert (stats["miss_batches"], stats["samples"], stats["refused"]) == (8, 32, 0)
    assert stats["hit_batches"] >= 16 and stats["bytes"] > 0
    assert len(cached) == len(plain) == 24
    np.testing.assert_allclose(cached, plain, rtol=1e-5)
