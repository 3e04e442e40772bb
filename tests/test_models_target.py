"""TargetModel: feature layers, document isolation in packed rows, frozen weights, verification logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_lib.batch import collate_packed, collate_padded
from dflash_lib.config import ConfigError, ModelConfig
from dflash_lib.models import (TargetModel, document_segments, feature_layer_ids, resolve_backend,
                               segment_cu_seqlens, tiny_qwen3_config)

VOCAB = 300


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_hf_config(tiny_qwen3_config(hidden_size=32, num_layers=6, vocab_size=VOCAB), 3, seed=0)


def _docs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, VOCAB, n), rng.random(n) < 0.7) for n in lengths]


def test_feature_layer_rule():
    assert feature_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, dflash.md
    assert feature_layer_ids(36, 1) == [18]
    assert feature_layer_ids(6, 3) == [1, 2, 3]
    assert feature_layer_ids(28, 2) == [1, 25]
    with pytest.raises(ConfigError, match="target_layer_ids"):
        feature_layer_ids(3, 2)


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
    assert document_segments(doc) == [(0, 2), (2, 5), (6, 9), (9, 10)]  # padding runs left out


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
