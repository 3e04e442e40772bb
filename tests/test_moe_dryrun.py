"""A mixture-of-experts target: the dry run's balanced-routing stand-in and the grouped_mm FLOP formula count what
the real experts compute, a fake MoE step runs, and the dense drafter rule (`drafter_shape`) builds a drafter
that exports and loads back."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from dflash_lib.config import from_params
from dflash_lib.data.batch import collate_padded
from dflash_lib.models import DFlashDrafter, DrafterConfig
from dflash_lib.target.local import TargetModel
from dflash_lib.models.drafter import DrafterShape, drafter_shape
from dflash_lib.models.export import export_drafter, read_drafter
from dflash_lib import dryrun
from dflash_lib.dryrun.balanced_experts import balanced_counts, grouped_mm_flops, install_balanced_experts

VOCAB, H, I_MOE, E, K, LAYERS = 512, 32, 16, 8, 2, 4


def _moe_config(**kw) -> transformers.Qwen3MoeConfig:
    args = dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, intermediate_size=96, moe_intermediate_size=I_MOE, num_experts=E,
                num_experts_per_tok=K, mlp_only_layers=[], attn_implementation="sdpa")
    return transformers.Qwen3MoeConfig(**{**args, **kw})


def _flops(model: torch.nn.Module, ids: torch.Tensor) -> int:
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten._grouped_mm: grouped_mm_flops})
    with counter, torch.no_grad():
        model(ids)
    return counter.get_total_flops()


@pytest.fixture(scope="module")
def moe():
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_moe_config())


def test_balanced_counts_share_every_assignment():
    assert balanced_counts(74, 8) == [10, 10, 9, 9, 9, 9, 9, 9] and sum(balanced_counts(5, 8)) == 5


@pytest.mark.parametrize("tokens", [37, 64])
def test_stand_in_and_grouped_mm_count_the_eager_experts_flops(moe, tokens):
    """Linear FLOPs are linear in each expert's tokens, so any routing of tokens x top_k assignments costs the
    same: the eager loop (the real routing, random weights), transformers' grouped_mm path (our formula) and
    the balanced stand-in count equal FLOPs, and the experts' share is 2 x T x k x (H x 2I + I x H) per layer."""
    ids = torch.randint(0, VOCAB, (1, tokens))
    eager = copy.deepcopy(moe)
    eager.set_experts_implementation("eager")
    standin = copy.deepcopy(moe)
    assert install_balanced_experts(standin, force=True) == LAYERS
    figures = {name: _flops(m, ids) for name, m in (("grouped", moe), ("eager", eager), ("standin", standin))}
    assert figures["grouped"] == figures["eager"] == figures["standin"]
    dense = copy.deepcopy(moe)
    for layer in dense.model.layers:  # the experts' FLOPs: what is left when they compute nothing
        layer.mlp.experts.forward = lambda h, *_: torch.zeros_like(h)
    per_layer = 2 * tokens * K * (H * 2 * I_MOE + I_MOE * H)
    assert figures["eager"] - _flops(dense, ids) == LAYERS * per_layer
    # the stand-in keeps the module's parameters: same names, shapes and values
    assert {n: p.shape for n, p in standin.named_parameters()} == {n: p.shape for n, p in moe.named_parameters()}
    assert all(torch.equal(a, b) for a, b in zip(standin.parameters(), moe.parameters()))


def test_eager_experts_get_the_stand_in_and_grouped_mm_runs_as_it_is(moe):
    eager = copy.deepcopy(moe)
    eager.set_experts_implementation("eager")
    assert install_balanced_experts(eager) == LAYERS and install_balanced_experts(copy.deepcopy(moe)) == 0


def _fake_step(cfg, hf, force: bool) -> dryrun.StepFigures:
    settings = dryrun.StepSettings("blocks", 0)
    models = dryrun.build_step_models(cfg, hf, settings, fake=True)
    if force:
        models.balanced_experts = install_balanced_experts(models.target.model, force=True)
        assert models.balanced_experts == LAYERS
    worst = dryrun.worst_bucket_batch(0, 0, 64, cfg, block_budget=80)
    return dryrun.measure_step(models, dryrun.host_batch(worst, VOCAB, cfg.model.mask_id), seed=0)


@pytest.mark.slow  # a fake training step of a Qwen3-MoE target (make test runs it)
def test_a_fake_moe_step_runs_and_both_paths_count_the_same_flops():
    """The dry run's step on a Qwen3-MoE target in fake mode: grouped_mm as it is, or the balanced stand-in (what
    an implementation with data-dependent routing gets): the same FLOPs; grouped_mm holds all assignments at
    once, so its peak is not below the stand-in's one-expert-at-a-time loop."""
    cfg = from_params(dict(num_features=2, drafter_layers=1, block_size=4, num_anchors=8, token_budget=256,
                           max_len=128, mask_id=VOCAB - 1))
    hf = _moe_config()
    grouped, standin = _fake_step(cfg, hf, False), _fake_step(cfg, hf, True)
    assert grouped.flops == standin.flops and grouped.flops["target_forward"] > 0
    assert grouped.peak_bytes >= standin.peak_bytes


# -- the drafter of an MoE target -------------------------------------------------------------------------------
def test_drafter_shape_is_dense_at_the_targets_width():
    assert drafter_shape(_moe_config()) == drafter_shape(_moe_config(moe_intermediate_size=4))  # experts ignored
    shape = drafter_shape(_moe_config())
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate_size) == (4, 2, 8, 96)
    only_moe = _moe_config(intermediate_size=0)  # a config that lists no dense width
    assert drafter_shape(only_moe).intermediate_size == 3 * H
    llama_like = SimpleNamespace(hidden_size=64, num_attention_heads=4, intermediate_size=128)  # no head_dim, kv
    assert drafter_shape(llama_like) == DrafterShape(num_heads=4, num_kv_heads=4, head_dim=16, intermediate_size=128)


def test_shipped_moe_presets_get_the_dense_drafter_of_their_shapes():
    from dflash_lib.models.shapes import NAMED_SHAPES

    a3b, a22b = drafter_shape(NAMED_SHAPES["qwen3-30b-a3b"]()), drafter_shape(NAMED_SHAPES["qwen3-235b-a22b"]())
    assert (a3b.num_heads, a3b.num_kv_heads, a3b.head_dim, a3b.intermediate_size) == (32, 4, 128, 6144)
    assert (a22b.num_heads, a22b.num_kv_heads, a22b.head_dim, a22b.intermediate_size) == (64, 4, 128, 12288)


def test_a_moe_targets_drafter_exports_and_loads_back(tmp_path):
    torch.manual_seed(1)
    target = TargetModel.from_hf_config(_moe_config(), 2, seed=0)
    model_cfg = from_params(dict(num_features=2, drafter_layers=2, block_size=4, mask_id=VOCAB - 1,
                                 num_anchors=5)).model
    cfg = DrafterConfig.from_model_config(model_cfg, target)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (4, 2, 8, 96)
    torch.manual_seed(2)
    drafter = DFlashDrafter(cfg, target)
    export_drafter(drafter, tmp_path / "drafter", torch.float32, template="chatml")
    loaded = read_drafter(tmp_path / "drafter", target)
    assert loaded.cfg == drafter.cfg
    rng = np.random.default_rng(3)
    batch = collate_padded([(rng.integers(0, VOCAB - 1, n), np.arange(n) >= 2) for n in (17, 11)], 0)
    anchors = drafter.sample_anchors(batch, torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = drafter.block_logits(batch, target.features(batch), anchors)
        got = loaded.block_logits(batch, target.features(batch), anchors)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
