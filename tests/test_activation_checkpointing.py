"""Partial activation checkpointing: the first k drafter layers recomputed in the backward give the loss and
gradients of none or all (fp32), the dry run's peak falls with k, and a bad setting names its range."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_lib.config import ConfigError, from_params
from dflash_lib.data.batch import collate_packed
from dflash_lib.models import DFlashDrafter, DrafterConfig, tiny_qwen3_config
from dflash_lib.target.local import TargetModel
from dflash_lib import dryrun
from dflash_lib.train.build import drafter_checkpointing

VOCAB, MASK, H, LAYERS = 300, 299, 32, 3


def test_k_checkpointed_layers_give_the_loss_and_gradients_of_none_and_all():
    target = TargetModel.from_hf_config(tiny_qwen3_config(hidden_size=H, num_layers=4, vocab_size=VOCAB), 2, seed=0)
    cfg = DrafterConfig(hidden_size=H, num_layers=LAYERS, num_heads=4, num_kv_heads=2, head_dim=8,
                        intermediate_size=64, vocab_size=VOCAB, target_layer_ids=target.layer_ids,
                        target_num_layers=target.num_layers, block_size=4, mask_id=MASK, num_anchors=6)
    rng = np.random.default_rng(0)
    docs = [(rng.integers(0, VOCAB - 1, n), np.arange(n) >= 2) for n in (40, 17, 9)]
    batch = collate_packed(docs, 0, row_len=70)
    feats = target.features(batch)
    results = {}
    for k in range(LAYERS + 1):
        torch.manual_seed(0)
        drafter = DFlashDrafter(cfg, target, attention="blocks", checkpointing=k)
        assert drafter.checkpointing == k
        layout = drafter.layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(3)))
        out = drafter.loss(batch, feats, layout)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
        results[k] = (float(out.loss.detach()), grads)
    loss0, grads0 = results[0]
    assert len(grads0) > 0
    for k, (loss, grads) in results.items():
        assert loss == pytest.approx(loss0, abs=1e-6), k
        for name, g in grads0.items():
            torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-6, msg=f"{k} layers: {name}")
    assert DFlashDrafter(cfg, target, checkpointing=True).checkpointing == LAYERS  # True = every layer
    assert DFlashDrafter(cfg, target, checkpointing=False).checkpointing == 0


@pytest.mark.slow  # one fake step per layer count (~15 s)
def test_the_dry_run_peak_falls_with_every_checkpointed_layer():
    cfg = from_params(dict(hidden_size=64, target_layers=4, num_features=2, drafter_layers=LAYERS, block_size=4,
                           num_anchors=16, token_budget=512, max_len=128, mask_id=VOCAB - 1))
    hf = tiny_qwen3_config(hidden_size=64, num_layers=4, vocab_size=VOCAB)
    worst = dryrun.worst_bucket_batch(0, 0, 128, cfg, block_budget=None)
    peaks, flops = [], []
    for k in range(LAYERS + 1):
        models = dryrun.build_step_models(cfg, hf, dryrun.StepSettings("blocks", k), fake=True)
        fig = dryrun.measure_step(models, dryrun.host_batch(worst, VOCAB, cfg.model.mask_id))
        peaks.append(fig.peak_bytes)
        flops.append(fig.flops["drafter_layers"])
    # each layer recomputed frees its activations, but the last one's: its recomputation starts the backward,
    # where the peak of none checkpointed is too
    assert all(a > b for a, b in zip(peaks[:-1], peaks[1:-1])) and peaks[-1] == peaks[-2], peaks
    steps = [b - a for a, b in zip(flops, flops[1:])]  # each one costs one more forward of a layer
    assert steps[0] > 0 and all(s == steps[0] for s in steps), flops


def test_checkpointing_setting_resolves_to_a_layer_count():
    assert drafter_checkpointing("auto", torch.device("cuda"), 5) == 5
    assert drafter_checkpointing("auto", torch.device("cpu"), 5) == 0
    assert drafter_checkpointing("true", torch.device("cpu"), 5) == 5
    assert drafter_checkpointing("false", torch.device("cuda"), 5) == 0
    assert drafter_checkpointing("3", torch.device("cuda"), 5) == 3
    assert dryrun.for_cuda(from_params({"drafter_layers": 5, "drafter_checkpointing": "2"})).checkpointing == 2


@pytest.mark.parametrize("value", ["6", "-1", "yes", "2.5", ""])
def test_a_bad_checkpointing_setting_names_the_parameter_and_the_range(value):
    with pytest.raises(ConfigError, match=r"drafter_checkpointing must be auto, true, false or a layer count in "
                                          r"0\.\.5 \(drafter_layers\)"):
        from_params({"drafter_layers": 5, "drafter_checkpointing": value})
