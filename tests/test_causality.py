"""Each draft layer's causality as vLLM applies it (models/causality.py): our reading of a config.json against
vLLM's own resolution and its CPU kernel's masks (called in the engine's Python), a planted flip of any rule caught,
training equal to both inference paths for causal full and non-causal sliding layers on every backend, and what
export writes read back as trained."""

from __future__ import annotations

import itertools
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_lib.config import ConfigError, from_params
from dflash_lib.data.batch import collate_packed, collate_padded
from dflash_lib.models import DrafterConfig
from dflash_lib.models.attention import position_mask
from dflash_lib.models.causality import (FIELDS, NESTED_FIELD, TOP_FIELD, default_causal, engine_causal,
                                         engine_layer_types, field_value, layer_causal, override_of, write_causality)
from dflash_lib.models.drafters import dflash
from dflash_lib.models.export import export_drafter, read_drafter
from dflash_lib.models.layout import build_layout
from fp_tolerance import rounding_atol
from tiny_models import BLOCK, MASK, VOCAB, tiny_drafter, tiny_target

S, F = "sliding_attention", "full_attention"
LAYERS = 3
KINDS = {"full": [F] * 3, "sliding": [S] * 3, "mixed": [S, F, S], "qwen3 default, sliding from layer 1": None,
         "qwen3 default, no window": None}
UNSET = object()  # the field absent from config.json (None: present, null)


def _doc(kinds: str, top, nested) -> dict:
    """A drafter config.json of LAYERS layers: layer kinds `kinds` (a KINDS key), is_causal `top` and
    dflash_config.causal `nested` (UNSET: absent)."""
    doc = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": LAYERS, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
           "vocab_size": 300, "max_position_embeddings": 256, "use_sliding_window": True, "sliding_window": 6,
           "max_window_layers": 1, "dflash_config": {"mask_token_id": 5, "target_layer_ids": [0]}}
    if KINDS[kinds] is not None:
        doc["layer_types"] = KINDS[kinds]
    elif kinds.endswith("no window"):
        doc["use_sliding_window"] = False
    if top is not UNSET:
        doc[TOP_FIELD] = top
    if nested is not UNSET:
        doc["dflash_config"]["causal"] = nested
    return doc


VALUES = (UNSET, None, True, False)
GRID = [_doc(k, t, n) for k, t, n in itertools.product(KINDS, VALUES, VALUES)]  # 80 folders
GENERIC = [{"num_hidden_layers": LAYERS, **({TOP_FIELD: t} if t is not UNSET else {}),
            **({"dflash_config": {"causal": n}} if n is not UNSET else {})}
           for t, n in itertools.product(VALUES, VALUES)]  # no layer kinds at all (a non-Qwen3 config)
MASKS = [(12, 4, c, w) for c, w in itertools.product((True, False), (-1, 1, 3, 6))]  # S keys, last Q queries


@pytest.fixture(scope="module")
def vllm_reads(installed_engine_python, tmp_path_factory):
    """What the installed vLLM decides for GRID (folders, through the config it builds), GENERIC and MASKS: one run
    of tests/engine_causality.py in the engine's Python (~10 s)."""
    root = tmp_path_factory.mktemp("causality")
    folders = []
    for i, doc in enumerate(GRID):
        (root / str(i)).mkdir()
        (root / str(i) / "config.json").write_text(json.dumps(doc))
        folders.append(str(root / str(i)))
    job = json.dumps({"folders": folders, "docs": GENERIC, "masks": MASKS})
    run = subprocess.run([str(installed_engine_python), str(Path(__file__).parent / "engine_causality.py")],
                         input=job, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _resolve(doc: dict, order=FIELDS, sliding=True, full=False, none=False, qwen3_fill=True) -> list[bool]:
    """The rules written out once more, each one a parameter a planted flip changes: the override fields in
    `order`, what a sliding / full layer is without one, what every layer is without layer kinds, and whether the
    kinds of a config without layer_types are Qwen3's default (else: none)."""
    n = int(doc["num_hidden_layers"])
    for field in order:
        if field_value(doc, field) is not None:
            return [bool(field_value(doc, field))] * n
    kinds = engine_layer_types(doc) if qwen3_fill else doc.get("layer_types") or []
    if not kinds:
        return [none] * n
    return [sliding if k == S else full for k in kinds]


def _generic(doc: dict) -> list[bool]:
    """Our rules on a config that holds its layer kinds as given (no Qwen3 default)."""
    return layer_causal(doc.get("layer_types") or [], doc["num_hidden_layers"], override_of(doc))


@pytest.mark.engine
def test_our_reading_of_every_doc_is_vllms(vllm_reads):
    """Every combination of layer kinds and override fields (absent, null, true, false): `engine_causal` equals
    vLLM's `_dflash_layer_causal` on the config vLLM builds from the folder, and on a config without layer kinds;
    the grid meets every rule (each one decides some doc)."""
    assert vllm_reads["folders"] == [engine_causal(d) for d in GRID]
    assert vllm_reads["docs"] == [_generic(d) for d in GENERIC]
    assert [_resolve(d) for d in GRID] == [engine_causal(d) for d in GRID]  # the flips below flip these rules
    assert {(field_value(d, TOP_FIELD) is not None, field_value(d, NESTED_FIELD) is not None) for d in GRID} == \
        set(itertools.product((True, False), repeat=2))
    assert [True, False, True] in vllm_reads["folders"] and [False, True, True] in vllm_reads["folders"]
    assert [False] * 3 in vllm_reads["docs"]  # no layer kinds, no override: none causal


FLIPS = {
    "dflash_config.causal read first": dict(order=FIELDS[::-1]),
    "is_causal ignored": dict(order=(NESTED_FIELD,)),
    "dflash_config.causal ignored": dict(order=(TOP_FIELD,)),
    "sliding layers non-causal": dict(sliding=False),
    "full layers causal": dict(full=True),
    "no layer_types: Qwen3's default ignored": dict(qwen3_fill=False),
}


@pytest.mark.engine
@pytest.mark.parametrize("flip", sorted(FLIPS))
def test_a_planted_flip_of_any_rule_fails_the_comparison(vllm_reads, flip):
    wrong = [_resolve(d, **FLIPS[flip]) for d in GRID]
    assert wrong != vllm_reads["folders"]


@pytest.mark.engine
def test_a_flipped_rule_without_layer_kinds_fails_the_comparison(vllm_reads):
    wrong = [[True] * LAYERS if override_of(d) is None else _generic(d) for d in GENERIC]  # none: causal
    assert wrong != vllm_reads["docs"]


@pytest.mark.engine
def test_the_masks_are_those_of_vllms_cpu_kernel(vllm_reads):
    """Which cached keys each query attends in vLLM's CPU attention, causal or not, with a window or none, equals
    `position_mask` (a non-causal sliding layer's window reaches w - 1 positions both ways); our old rule for a
    non-causal sliding layer (the causal window) does not."""
    for (keys, queries, causal, window), seen in zip(MASKS, vllm_reads["masks"]):
        q_pos, k_pos = torch.arange(keys - queries, keys), torch.arange(keys)
        ours = position_mask(q_pos, k_pos, max(window, 0), causal).int().tolist()
        assert ours == seen, (causal, window)
        if not causal and 1 < window < queries:  # a window of 1 is the query alone either way
            assert position_mask(q_pos, k_pos, window, True).int().tolist() != seen


# -- export and reading ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.mark.parametrize("kinds, setting, written", [
    ([], "auto", {NESTED_FIELD: False}), ([], "causal", {NESTED_FIELD: True}),
    ([S, S], "auto", {NESTED_FIELD: True}), ([S, S], "non_causal", {NESTED_FIELD: False}),
    ([S, F], "auto", {}), ([S, F], "causal", {NESTED_FIELD: True}), ([S, F], "non_causal", {NESTED_FIELD: False}),
])
def test_export_writes_what_makes_vllm_run_the_trained_causality_and_reads_it_back(target, tmp_path, kinds, setting,
                                                                                   written):
    """Every layer alike: the explicit dflash_config.causal; sliding causal and full not: no field (vLLM's
    default). vLLM's reading of the file (`engine_causal`, checked against vLLM above) is the trained causality,
    and the folder reads back as the same drafter, drafting the same logits."""
    model = from_params({"drafter_layers": 2, "drafter_layer_types": kinds, "drafter_window": 3 if kinds else 0,
                         "drafter_causal": setting, "mask_id": MASK}).model
    cfg = DrafterConfig.from_model_config(model, target)
    drafter = tiny_drafter(target, layer_types=cfg.layer_types, sliding_window=cfg.sliding_window, causal=cfg.causal)
    export_drafter(drafter, tmp_path, torch.float32)
    doc = json.loads((tmp_path / "config.json").read_text())
    assert {f: field_value(doc, f) for f in FIELDS if field_value(doc, f) is not None} == written
    assert engine_causal(doc) == drafter.cfg.layer_causal == {"auto": default_causal(kinds, 2), "causal": [True] * 2,
                                                              "non_causal": [False] * 2}[setting]
    loaded = read_drafter(tmp_path, target)
    assert loaded.cfg == drafter.cfg
    feats = target.features(collate_padded([(np.arange(12) % 50, np.ones(12, bool))], 0))[0]
    ids = torch.tensor([7] + [drafter.cfg.mask_id] * (BLOCK - 1))
    torch.testing.assert_close(loaded.draft_logits(feats, 8, ids), drafter.draft_logits(feats, 8, ids), rtol=0, atol=0)


def test_a_folder_stating_causality_is_read_as_vllm_runs_it_and_a_flip_drafts_otherwise(target, tmp_path):
    """z-lab's DFlash2 layout on our kind: every layer sliding (window 2048), top-level is_causal false: read as
    non-causal sliding layers; the same folder with is_causal true drafts other logits. Both fields, disagreeing:
    is_causal decides, as in vLLM."""
    drafter = tiny_drafter(target, layer_types=[S, S], sliding_window=2048, causal=False)
    export_drafter(drafter, tmp_path, torch.float32)
    doc = json.loads((tmp_path / "config.json").read_text())
    doc["dflash_config"].pop("causal")
    for top, nested, want in [(False, None, [False] * 2), (False, True, [False] * 2), (True, False, [True] * 2)]:
        doc[TOP_FIELD] = top
        doc["dflash_config"]["causal"] = nested
        (tmp_path / "config.json").write_text(json.dumps(doc))
        loaded = read_drafter(tmp_path, target)
        assert loaded.cfg.layer_causal == want and loaded.cfg.layer_windows == [2048, 2048]
    feats = target.features(collate_padded([(np.arange(12) % 50, np.ones(12, bool))], 0))[0]
    ids = torch.tensor([7] + [drafter.cfg.mask_id] * (BLOCK - 1))
    ours = drafter.draft_logits(feats, 8, ids)
    assert float((loaded.draft_logits(feats, 8, ids) - ours).abs().max()) > 1e-3  # is_causal true: another drafter


def test_the_kinds_of_a_folder_without_layer_types_are_qwen3s(target, tmp_path):
    """A published config.json without layer_types but with use_sliding_window: its layers from max_window_layers
    on are sliding, as transformers' Qwen3 config (and so vLLM) has them, and causal by vLLM's default."""
    export_drafter(tiny_drafter(target), tmp_path, torch.float32)
    doc = json.loads((tmp_path / "config.json").read_text())
    doc.pop("layer_types")
    doc["dflash_config"].pop("causal")
    doc.update(use_sliding_window=True, sliding_window=5, max_window_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(doc))
    cfg = read_drafter(tmp_path, target).cfg
    assert (cfg.layer_types, cfg.layer_windows, cfg.layer_causal) == ([F, S], [0, 5], [False, True])


def test_a_pattern_config_json_cannot_state_is_refused_and_the_top_level_form_is_one_call():
    """Per layer [causal, non-causal] on two full layers has no config.json form; the top-level form (z-lab's
    DFlash2) replaces the nested one."""
    with pytest.raises(ConfigError, match="config.json states every layer causal, none, or sliding") as e:
        write_causality({}, [F, F], [True, False], NESTED_FIELD)
    assert "\n" not in str(e.value)
    doc = write_causality({"dflash_config": {"causal": True}}, [S] * 5, [False] * 5, TOP_FIELD)
    assert doc == {"dflash_config": {}, TOP_FIELD: False} and engine_causal({**doc, "layer_types": [S] * 5,
                                                                              "num_hidden_layers": 5}) == [False] * 5
    with pytest.raises(ConfigError, match="causality field 'causal' is not one vLLM reads"):
        write_causality({}, [F], [True], "causal")


def test_an_override_equal_to_the_default_is_kept_as_none_and_the_setting_reaches_the_config(target):
    assert DrafterConfig(**{**tiny_drafter(target).cfg.to_dict(), "causal": False}).causal is None  # all full
    cfg = DrafterConfig.from_model_config(from_params({"drafter_layers": 5, "drafter_layer_types": [S] * 5,
                                                       "drafter_window": 2048, "drafter_causal": "non_causal",
                                                       "mask_id": MASK}).model, target)
    assert (cfg.causal, cfg.layer_causal, cfg.layer_windows) == (False, [False] * 5, [2048] * 5)
    assert dflash.serving_config(cfg, torch.float32, 256)["dflash_config"]["causal"] is False


# -- training equals inference --------------------------------------------------------------------------------
DRAFTERS = {  # window 3 < the block (4) + 2: a non-causal window reaches forward inside the block and bites
    "causal full": dict(causal=True),
    "non-causal sliding": dict(layer_types=[S, S], sliding_window=3, causal=False),
    "non-causal sliding and full": dict(layer_types=[S, F], sliding_window=3, causal=False),
    "causal sliding and full": dict(layer_types=[S, F], sliding_window=3, causal=True),
}


def _docs(lengths, seed):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, VOCAB - 1, n), np.arange(n) >= 1) for n in lengths]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("backend", ["dense", "blocks", "flex"])
@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_training_equals_both_inference_paths_per_block(target, name, backend, packed):
    """The training forward of every block (each backend, padded and packed batches) equals the per-block inference
    forward over exactly the block's context, and the cached decoder equals that; the same weights under vLLM's
    default causality give other logits (the rule bites)."""
    drafter = tiny_drafter(target, ce_chunk_blocks=2, **DRAFTERS[name])
    docs = _docs([14, 3, 9, 23], seed=3)
    batch = (collate_packed(docs, 0, row_len=sum(len(t) for t, _ in docs) + 5) if packed
             else collate_padded(docs, 0))
    layout = build_layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(1)), "blocks")
    feats = target.features(batch)
    drafter.attention = backend
    flat_doc, flat_feats = batch.doc_ids.reshape(-1), feats.reshape(-1, feats.shape[-1])
    with torch.no_grad():
        got = drafter.block_logits(batch, feats, layout)  # (n, B, V)
        refs, cached = [], []
        for i in range(layout.num_blocks):
            doc_feats = flat_feats[flat_doc == layout.block_doc[i]]
            anchor = int(layout.anchor_pos[i])
            refs.append(drafter.draft_logits(doc_feats, anchor, layout.block_ids[i]))
            cache = drafter.context_cache()
            drafter.extend_context(cache, doc_feats[:anchor])
            cached.append(drafter.draft_logits_cached(cache, layout.block_ids[i]) if anchor else refs[-1])
        ref = torch.stack(refs)
        default = tiny_drafter(target, ce_chunk_blocks=2, **{**DRAFTERS[name], "causal": None}, attention=backend)
        other = default.block_logits(batch, feats, layout)
    atol = rounding_atol(ref, terms=drafter.cfg.hidden_size, depth=drafter.cfg.num_layers + 2)
    torch.testing.assert_close(got, ref, rtol=0, atol=atol)
    torch.testing.assert_close(torch.stack(cached), ref, rtol=0, atol=atol)
    assert float((other - ref).abs().max()) > 100 * atol


def test_the_dflash2_kind_trains_and_reads_z_labs_layout(target, tmp_path):
    """z-lab's DFlash2 layout on the dflash2 kind (`-p drafter_kind dflash2`): every layer sliding (window 2048) and
    non-causal. Its export states it in z-lab's field (top-level is_causal false), its training forward equals its
    inference forward per block, and the folder with the dflash kind's field instead reads back as the same
    drafter."""
    from dflash_lib.models.dflash2 import DFlash2Config, DFlash2Drafter

    model = from_params({"drafter_kind": "dflash2", "drafter_layers": 2, "drafter_layer_types": [S, S],
                         "drafter_window": 2048, "drafter_causal": "non_causal", "mask_id": MASK,
                         "conv_group_size": 8, "selector_rank": 16, "selector_top_k": 6}).model
    cfg = DFlash2Config.from_model_config(model, target)
    assert cfg.layer_causal == [False, False] and cfg.layer_windows == [2048, 2048]
    torch.manual_seed(0)
    drafter = DFlash2Drafter(cfg, target, attention="blocks")
    docs = _docs([14, 9], seed=5)
    batch = collate_padded(docs, 0)
    layout = build_layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(1)), "blocks")
    feats = target.features(batch)
    with torch.no_grad():
        got = drafter.block_logits(batch, feats, layout)
        ref = torch.stack([drafter.draft_logits(feats[int(layout.block_doc[i])], int(layout.anchor_pos[i]),
                                                layout.block_ids[i]) for i in range(layout.num_blocks)])
    torch.testing.assert_close(got, ref, rtol=0, atol=rounding_atol(ref, terms=cfg.hidden_size, depth=4))
    export_drafter(drafter, tmp_path, torch.float32)
    doc = json.loads((tmp_path / "config.json").read_text())
    assert engine_causal(doc) == [False, False] and read_drafter(tmp_path, target).cfg == drafter.cfg
    assert doc[TOP_FIELD] is False and "causal" not in doc["dflash_config"]  # DFlash2's own field, as z-lab's
    (tmp_path / "config.json").write_text(json.dumps(write_causality(doc, [S, S], [False, False], NESTED_FIELD)))
    assert TOP_FIELD not in doc and read_drafter(tmp_path, target).cfg == drafter.cfg  # the dflash kind's field
