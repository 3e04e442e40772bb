"""The drafter seam: `-p drafter_kind` refuses an unknown kind in one line; every site that builds a drafter or
writes / reads its serving folder resolves it through models/drafters/ (a throwaway kind registered here is what
they build, write and read); a folder of an unknown architecture is refused in one line naming its file; the
doctor takes its names from the declarations and keeps its own values."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path

import pytest
import torch

from dflash_lib.config import ConfigError, ModelConfig, from_params, preset
from dflash_lib.doctor import TargetReading, config_rules, expected_tensors, trained_as_rule, weight_rules
from dflash_lib.doctor import safetensors_header
from dflash_lib.models import DFlashDrafter
from dflash_lib.models.drafters import KINDS, dflash, drafter_kind, kind_of_folder, registry
from dflash_lib.models.export import (export_drafter, export_folder, export_run_weights, init_from, read_doc,
                                      read_drafter)
from tiny_models import HIDDEN, VOCAB, tiny_drafter, tiny_target

ROOT = Path(__file__).resolve().parents[1]


class ToyDrafter(DFlashDrafter):
    """A throwaway kind's module: DFlash's under another class."""


def _toy_serving(cfg, dtype, max_position_embeddings, training=None):
    doc = dflash.serving_config(cfg, dtype, max_position_embeddings, training)
    return {**doc, "architectures": ["ToyDraftModel"], "model_type": "toy"}


TOY = dataclasses.replace(dflash.KIND, name="toy", architectures=("ToyDraftModel",), model_type="toy",
                          module_class=ToyDrafter, serving_config=_toy_serving,
                          check_doc=lambda doc, path: None)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(KINDS, "toy", TOY)
    return TOY


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def _toy_drafter(target) -> ToyDrafter:
    torch.manual_seed(0)
    return ToyDrafter(tiny_drafter(target).cfg, target)


def test_the_setting_names_the_registered_kinds_and_refuses_another_in_one_line():
    assert typing.get_args(typing.get_type_hints(ModelConfig)["drafter_kind"]) == tuple(KINDS) == ("dflash",
                                                                                                   "dflash2")
    assert from_params({"drafter_kind": "dflash2"}).model.drafter_kind == "dflash2"
    with pytest.raises(ConfigError, match=r"^drafter_kind must be one of \['dflash', 'dflash2'\], got 'dflash3'$"):
        from_params({"drafter_kind": "dflash3"})
    with pytest.raises(ConfigError, match=r"^drafter_kind 'dflash3' is not a drafter kind here \(one of "
                                          r"\['dflash', 'dflash2'\]\)$"):
        drafter_kind("dflash3")


def test_two_kinds_sharing_a_name_an_architecture_or_a_module_class_are_refused():
    """A folder's kind is found by its architecture and a drafter's by its class: each must be one kind's."""
    assert registry(dflash.KIND, TOY) == {"dflash": dflash.KIND, "toy": TOY}
    for change, what in (({"name": "dflash"}, "name 'dflash'"),
                         ({"architectures": ("DFlashDraftModel",)}, "architecture 'DFlashDraftModel'"),
                         ({"module_class": DFlashDrafter}, "module class 'dflash_lib.models.drafter.DFlashDrafter'")):
        other = dataclasses.replace(TOY, **change)
        with pytest.raises(ConfigError, match=f"^models/drafters: two drafter kinds share the {re.escape(what)}$"):
            registry(dflash.KIND, other)


def test_a_folder_of_an_unknown_architecture_is_refused_in_one_line_naming_the_file(target, tmp_path):
    folder = export_drafter(tiny_drafter(target), tmp_path / "drafter")
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "architectures": ["Eagle3DraftModel"]}))
    for read in (lambda: read_doc(folder), lambda: read_drafter(folder, target),
                 lambda: init_from(tiny_drafter(target), folder), lambda: export_folder(folder, tmp_path / "out")):
        with pytest.raises(ConfigError) as e:
            read()
        assert str(e.value) == (f"{path}: architectures ['Eagle3DraftModel'] names no drafter kind here (one of "
                                f"['DFlashDraftModel', 'DFlash2DraftModel'])")


def test_a_registered_kind_is_what_export_and_read_use(toy, target, tmp_path):
    drafter = _toy_drafter(target)
    folder = export_drafter(drafter, tmp_path / "toy", torch.float32)
    doc = json.loads((folder / "config.json").read_text())
    assert (doc["architectures"], doc["model_type"]) == (["ToyDraftModel"], "toy")
    assert kind_of_folder(doc, "config.json") is toy
    loaded = read_drafter(folder, target)
    assert type(loaded) is ToyDrafter and loaded.cfg == drafter.cfg
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()))
    again = export_folder(folder, tmp_path / "again")  # a re-export keeps the kind
    assert json.loads((again / "config.json").read_text())["architectures"] == ["ToyDraftModel"]
    init_from(_toy_drafter(target), folder)  # the same kind: accepted
    with pytest.raises(ConfigError, match=r"^init_from .*: a toy drafter there, this config builds dflash "
                                          r"\(set drafter_kind to match\)$"):
        init_from(tiny_drafter(target), folder)


def test_every_builder_resolves_the_setting_through_the_kinds(monkeypatch, tmp_path):
    """The trainer's build, the dry run (real and fake), the evaluation's initial drafter, the engine check's
    models and the export of a run's weights all build or write what KINDS[config.model.drafter_kind] declares."""
    from dflash_lib import dryrun
    from dflash_lib.evaluate import initial_drafter
    from dflash_lib.evaluate.engine_check import check_models
    from dflash_lib.models.target_config import tiny_qwen3_config
    from dflash_lib.target.local import TargetModel
    from dflash_lib.train.build import build_parts

    marked = dataclasses.replace(dflash.KIND, module_class=ToyDrafter, serving_config=lambda *a: {
        **dflash.serving_config(*a), "marked": True})
    monkeypatch.setitem(KINDS, "dflash", marked)
    config = preset("smoke")
    assert type(build_parts(config, torch.device("cpu")).drafter) is ToyDrafter
    hf = tiny_qwen3_config(hidden_size=64, num_layers=4, vocab_size=1000)
    small = from_params({"hidden_size": 64, "target_layers": 4, "mask_id": 999, "block_size": 4})
    for fake in (False, True):
        models = dryrun.build_step_models(small, hf, dryrun.StepSettings("dense", 0), fake)
        assert type(models.drafter) is ToyDrafter
    target = TargetModel.from_model_config(config.model, seed=0)
    assert type(initial_drafter(config, target)) is ToyDrafter
    assert type(check_models()[1]) is ToyDrafter
    weights = {n: p for n, p in initial_drafter(config, target).named_parameters()}
    out = export_run_weights(config.to_dict(), weights, tmp_path / "run", torch.bfloat16, "a test", "a test")
    assert json.loads((out / "config.json").read_text())["marked"] is True


def test_no_site_outside_the_kinds_builds_a_drafter_or_names_its_architecture():
    """What a new kind would otherwise have to be added to by hand: a direct construction of the dflash kind's
    config or module, or its architecture string, anywhere in the library but its own modules."""
    own = {ROOT / "dflash_lib/models/drafter.py", ROOT / "dflash_lib/models/drafters/dflash.py",
           ROOT / "dflash_lib/models/dflash2.py", ROOT / "dflash_lib/models/drafters/dflash2.py"}
    pattern = re.compile(r"DFlash2?Drafter\(|(Drafter|DFlash2)Config\(|(Drafter|DFlash2)Config\.from_model_config|"
                         r"DFlash2?DraftModel")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "dflash_lib").rglob("*.py")) if p not in own
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


def _reading(target) -> TargetReading:
    return TargetReading("target", HIDDEN, target.num_layers, VOCAB, ())


def test_the_doctor_takes_the_names_from_the_declaration(monkeypatch, toy, target, tmp_path):
    folder = export_drafter(tiny_drafter(target), tmp_path / "drafter")
    doc = json.loads((folder / "config.json").read_text())
    renamed = {**doc, "architectures": ["ToyDraftModel"], "model_type": "toy"}
    assert config_rules(renamed, _reading(target))[0].ok is True  # the toy kind's names: served
    monkeypatch.delitem(KINDS, "toy")
    rule = config_rules(renamed, _reading(target))[0]
    assert rule.ok is False and "['DFlashDraftModel'] and 'qwen3'" in rule.detail
    renames = {"draft_ids": "t2d", "draft_head": "head.weight"}
    monkeypatch.setitem(KINDS, "toy", dataclasses.replace(TOY, tensors=renames))
    vocab = {**renamed, "draft_vocab_size": 10}
    assert {"t2d", "head.weight"} <= set(expected_tensors(vocab)) and "d2t" not in expected_tensors(vocab)


def test_the_doctor_keeps_its_own_values(monkeypatch, target, tmp_path):
    """The doctor never calls the kind's writer or reader: with every function of the declaration broken, its
    verdicts on a folder are the same."""
    folder = export_drafter(tiny_drafter(target, draft_vocab_size=VOCAB - 20), tmp_path / "drafter")
    doc = json.loads((folder / "config.json").read_text())
    header = safetensors_header(folder / "model.safetensors")

    def lines():
        rules = [*config_rules(doc, _reading(target)), *weight_rules(doc, header),
                 trained_as_rule(doc, folder / "model.safetensors")]
        return [r.line() for r in rules]

    before = lines()
    assert all(line.startswith("PASS") for line in before), before

    def broken(*args):
        raise AssertionError("the doctor called the declaration's functions")

    monkeypatch.setitem(KINDS, "dflash", dataclasses.replace(
        dflash.KIND, serving_config=broken, check_doc=broken, read_config=broken, trained_as=broken,
        training=broken, readme=broken))
    assert lines() == before
