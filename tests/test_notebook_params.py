"""Every notebook parameter is written once: the parameters cell declares a preset and the names a user changes, the
config comes from that cell (and papermill's injected names) through `runs.notebook_config`, and every config
field stays reachable with `-p`. Notebook 04 runs the paper recipe (`--preset qwen3-8b -p target DIR`)."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import nbformat
import pytest

from dflash_lib import rundir
from dflash_lib.config import FLAT_FIELDS, ConfigError, PRESETS, from_params, preset
from dflash_lib.lab import runs
from tiny_models import save_tiny_qwen3

NOTEBOOKS = sorted((rundir.REPO_ROOT / "notebooks").glob("*.ipynb"))
NB04 = rundir.REPO_ROOT / "notebooks" / "04_train.ipynb"
# the parameters a notebook declares that are not config fields (documented in its parameters cell and the README)
NON_CONFIG = {runs.PRESET}


def _code_cells(path: Path) -> tuple[nbformat.NotebookNode, list[nbformat.NotebookNode]]:
    nb = nbformat.read(path, as_version=4)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1
    return params[0], [c for c in nb.cells if c.cell_type == "code" and c is not params[0]]


def _bound_and_read(source: str) -> set[str]:
    """Bare names a cell reads or binds (assignments, imports, loop targets, function arguments)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_parameters_are_config_fields_and_show_the_default_preset(path):
    """Each declared name is a config field (or `preset`); the cell shows its preset's values, so running the
    notebook as committed runs that preset, and `--preset P` swaps the whole preset (run fills the cell's names)."""
    declared = runs.notebook_parameters(path)
    assert runs.builds_config(declared), f"{path.name} declares no preset"
    assert declared[runs.PRESET] in PRESETS
    assert set(declared) - set(FLAT_FIELDS) <= NON_CONFIG, set(declared) - set(FLAT_FIELDS)
    shown = preset(declared[runs.PRESET]).to_params()
    differ = {k: (v, shown[k]) for k, v in declared.items() if k in FLAT_FIELDS and v != shown[k]}
    assert not differ, f"{path.name}: cell value vs its preset's: {differ}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_parameter_is_written_once(path):
    """No cell but the parameters cell reads or binds a config field's name (or `preset`): the config is built by
    one `notebook_config(globals())` call and read as `cfg.<section>.<field>` (so a `-p` name reaches the code
    whether the cell declares it or not, and no stale value survives a rerun)."""
    _, cells = _code_cells(path)
    source = "\n".join(c.source for c in cells)
    for cell in cells:
        clash = _bound_and_read(cell.source) & (set(FLAT_FIELDS) | NON_CONFIG)
        assert not clash, f"{path.name}: a cell uses config names as variables: {sorted(clash)}"
    assert source.count("notebook_config(globals())") == 1
    assert "from_params(dict(" not in source


def test_a_cell_that_reads_a_parameter_fails_the_check():
    """The check above can fail: a hand-typed config dict and a bare read are both caught."""
    assert _bound_and_read("cfg = from_params(dict(limit=limit))") >= {"limit"}
    assert _bound_and_read("for k in range(3): pass") >= {"k"}
    assert "source" not in _bound_and_read("print(cfg.data.source)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_config_field_is_reachable_with_p(path):
    """`-p KEY VALUE` of ANY config field is accepted before the kernel starts (injected by papermill even when the
    cell does not declare it); a name that is neither a parameter nor a config field is refused."""
    base = preset("demo").to_params()
    for key in FLAT_FIELDS:
        chosen = runs.resolve_params(path, {key: json.dumps(base[key]) if not isinstance(base[key], str)
                                            else base[key]}, "demo")
        assert chosen[key] == base[key]
    with pytest.raises(ConfigError, match=r"'flux' is not a parameter of .* and is not a config field"):
        runs.resolve_params(path, {"flux": "1"})
    with pytest.raises(ConfigError, match="unknown preset"):
        runs.resolve_params(path, {}, "nope")


def test_injected_fields_reach_the_config_train_reads():
    """What notebook 04 builds from its namespace: the preset, the cell's names, and every injected field the issue
    named as unreachable before (device, attention backends, accumulation, checkpoints, layer ids, CE chunks,
    gamma); every field `train()` reads comes from this one Config."""
    declared = runs.notebook_parameters(NB04)
    injected = dict(device="cpu", attn_backend="sdpa", drafter_attention="dense", accum_tokens=4096, ckpt_every=7,
                    target_layer_ids=[0, 1, 2], ce_chunk_blocks=8, gamma=3.0, stop_at_step=2)
    lines: list[str] = []
    cfg = runs.notebook_config({**declared, **injected, "json": json, "Path": Path}, say=lines.append)
    assert cfg.model.attn_backend == "sdpa" and cfg.model.drafter_attention == "dense"
    assert cfg.model.target_layer_ids == [0, 1, 2] and cfg.model.ce_chunk_blocks == 8 and cfg.model.gamma == 3.0
    assert cfg.train.device == "cpu" and cfg.train.accum_tokens == 4096 and cfg.train.ckpt_every == 7
    assert cfg.train.stop_at_step == 2
    assert cfg.model.num_anchors == preset("demo").model.num_anchors  # not in the cell: from the preset
    (line,) = lines  # the preset and what differs from it: the injected names, not the cell's (the preset's)
    assert line.startswith("config: preset demo; changed here: ")
    assert sorted(line.split("changed here: ")[1].split(", ")) == sorted(
        [f"{k}={v!r}" for k, v in injected.items() if k != "target_layer_ids"] + ["target_layer_ids=[0", "1", "2]"])
    paper = runs.notebook_config({**declared, **runs.resolve_params(NB04, {"target": "/models/q"}, "qwen3-8b")},
                                 say=lambda s: None)
    want = from_params({"target": "/models/q"}, preset("qwen3-8b"))
    assert paper == want  # the cell's names filled from the preset: exactly the paper recipe
    with pytest.raises(ConfigError, match="parameter 'num_anchors' must be int"):
        runs.notebook_config({**declared, "num_anchors": 2.5}, say=lambda s: None)
    with pytest.raises(ConfigError, match="no 'preset'"):
        runs.notebook_config({"limit": 3}, say=lambda s: None)


def test_plan_may_name_a_notebook_02_folder(tmp_path):
    (tmp_path / "plan.json").write_text("{}")
    declared = runs.notebook_parameters(NB04)
    cfg = runs.notebook_config({**declared, "plan": str(tmp_path)}, say=lambda s: None)
    assert cfg.sampler.plan == str(tmp_path / "plan.json")


def test_preset_by_p_or_flag_once(tmp_path):
    assert runs.resolve_params(NB04, {"preset": "smoke"})["token_budget"] == preset("smoke").sampler.token_budget
    assert runs.resolve_params(NB04, {})["preset"] == "demo"  # the notebook's own default
    with pytest.raises(ConfigError, match="preset given twice"):
        runs.resolve_params(NB04, {"preset": "smoke"}, "demo")


@pytest.fixture(scope="module")
def paper_shaped_target(tmp_path_factory):
    """A tiny random Qwen3 with the paper target's depth (36 layers, so the recipe's feature layers 1..33 exist) and
    the real Qwen3 vocabulary, hidden size 32, saved as a local Hugging Face folder."""
    directory = tmp_path_factory.mktemp("qwen3_36_layers")
    save_tiny_qwen3(directory, hidden_size=32, num_layers=36)
    return directory


@pytest.mark.slow
def test_notebook_04_runs_the_paper_recipe(tmp_path, paper_shaped_target):
    """`run 04_train --preset qwen3-8b -p target DIR`: the recipe's drafter (5 layers, block 16, 512 anchors, feature
    layers [1, 9, 17, 25, 33], max_len 3072, 6 epochs of warmup/cosine) trains against a local folder and stops,
    checkpointed, after its first step. Kept small on CPU: a 36-layer hidden-32 target, 64 conversations, and a
    token budget of one max_len document (3072 instead of 16384: the LM head over the real vocabulary dominates)."""
    os.environ["WANDB_MODE"] = "disabled"
    run_dir = runs.execute(NB04, {"target": str(paper_shaped_target), "stop_at_step": "1", "limit": "64",
                                  "token_budget": "3072", "wandb_mode": "disabled"},
                           preset_name="qwen3-8b", root=tmp_path)
    recorded = json.loads((run_dir / "train" / "config.json").read_text())["config"]
    model, train = recorded["model"], recorded["train"]
    assert model["target"] == str(paper_shaped_target)
    recipe = (model["drafter_layers"], model["block_size"], model["num_anchors"], model["num_features"])
    assert recipe == (5, 16, 512, 5)
    assert model["target_layer_ids"] == [1, 9, 17, 25, 33] and recorded["data"]["max_len"] == 3072
    assert train["epochs"] == 6.0 and train["steps"] == 0 and train["stop_at_step"] == 1
    summary = json.loads((run_dir / "train" / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["complete"] is False
    assert any((run_dir / "train" / "checkpoints").glob("ckpt-*/manifest.json"))
    assert (run_dir / "dashboard.json").is_file() and (run_dir / "loss_by_bucket.json").is_file()
    params = json.loads((run_dir / "params.json").read_text())
    assert params["preset"] == "qwen3-8b" and params["params"]["steps"] == 0  # the cell's names from the preset
