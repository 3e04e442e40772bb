"""The hidden-states cache (`serve/hidden_cache.py`, `capture` then `train -p hidden_cache DIR`) without vLLM: the
local target stands in for the engine; a run from the cache has the local run's losses (under torchrun:
tests/test_torchrun.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_lib.config import from_params, preset

LAYERS = [1, 3]  # the tiny target's feature layers (of 4)
CACHED = {"steps": 6, "ckpt_every": 3, "lr": 0.01, "warmup_steps": 1, "limit": 50, "target_layer_ids": LAYERS,
          "num_features": 2, "dist_timeout_s": 30.0}  # smoke steps on a 50-sample store


def tiny_target_folder(root: Path) -> Path:
    """A random 4-layer Qwen3 of hidden 64 on Qwen3's vocabulary (the bundled tokenizer's ids fit), saved to
    root/qwen3."""
    import transformers

    from dflash_lib.models.target import QWEN3_VOCAB
    from tiny_models import save_random_model

    cfg = transformers.Qwen3Config(vocab_size=QWEN3_VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=32, intermediate_size=128)
    save_random_model(root / "qwen3", cfg, spread=(0.1, 0.5))
    return root / "qwen3"


def capture_locally(config, out: Path) -> dict:
    """`capture` of `config`'s whole token store into `out`, the LOCAL target (fp32, on the CPU) standing in for
    the engine: each document's (len, F, H) states from its forward alone. Returns the manifest."""
    from dflash_lib.data.batch import collate_padded
    from dflash_lib.models import TargetModel
    from dflash_lib.serve.hidden_cache import CacheIdentity, capture
    from dflash_lib.train.build import load_training_data

    data = load_training_data(config)
    target = TargetModel.from_model_config(config.model)
    F, H = target.num_features, target.hidden_size
    assert target.layer_ids == sorted(target.layer_ids)  # the engine's aux order is ours: pick = 0 .. F-1
    identity = CacheIdentity.of(config, target.layer_ids, H, data.full_store.meta["key"], torch.device("cpu"))

    def fetch(documents):
        batch = [collate_padded([(np.asarray(d), np.ones(len(d), np.uint8))], 0) for d in documents]
        return [target.context_features(b).reshape(len(d), F, H) for b, d in zip(batch, documents)]

    return capture(data.full_store, identity, out, fetch, torch.arange(F), say=lambda _: None, progress=False)


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
