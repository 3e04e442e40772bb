"""The run command: validation before any kernel starts, and the run folder it leaves."""

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from dflash_lib import rundir
from dflash_lib.config import ConfigError
from dflash_lib.lab import runs


def _notebook(path: Path, params_src: str, body: str, tagged: bool = True) -> Path:
    nb = nbformat.v4.new_notebook()
    p = nbformat.v4.new_code_cell(params_src)
    if tagged:
        p.metadata["tags"] = ["parameters"]
    nb.cells = [p, nbformat.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


@pytest.fixture
def tiny_nb(tmp_path):
    body = (
        "import json, pathlib\n"
        "pathlib.Path(out_dir, 'result.json').write_text(json.dumps({'limit': limit, 'lr': lr}))\n"
    )
    return _notebook(tmp_path / "tiny.ipynb", "limit = 3\nlr = 0.001\nout_dir = ''\n", body)


def test_notebook_parameters_are_read(tiny_nb):
    assert runs.notebook_parameters(tiny_nb) == {"limit": 3, "lr": 0.001, "out_dir": ""}


@pytest.mark.parametrize(
    "params, message",
    [
        ({"limitt": "4"}, "parameter 'limitt' is not a parameter of tiny.ipynb and is not a config field"),
        ({"steps": "4"}, "parameter 'steps' is not a parameter of tiny.ipynb"),
        ({"limit": "many"}, "parameter 'limit': cannot parse"),
        ({"limit": "2.5"}, "parameter 'limit' must be int"),
        ({"limit": "-1"}, "limit must be >= 0"),
        ({"out_dir": "/tmp/elsewhere"}, "parameter 'out_dir' is not for `run`: tiny.ipynb writes into the new run "
                                        "folder"),  # (it would be overwritten with the run folder: never ignored)
    ],
)
def test_bad_parameters_refused_before_any_folder_or_kernel(tiny_nb, tmp_path, params, message):
    root = tmp_path / "runs"
    with pytest.raises(ConfigError) as e:
        runs.execute(tiny_nb, params, root=root)
    assert message in str(e.value)
    assert not root.exists() or not any(root.iterdir())


def test_parameters_cell_must_be_config_fields(tmp_path):
    nb = _notebook(tmp_path / "bad.ipynb", "flux = 3\n", "pass")
    with pytest.raises(ConfigError, match="'flux' is not a config field"):
        runs.resolve_params(nb, {})
    untagged = _notebook(tmp_path / "untagged.ipynb", "limit = 3\n", "pass", tagged=False)
    with pytest.raises(ConfigError, match="exactly one cell tagged 'parameters'"):
        runs.resolve_params(untagged, {})


def test_preset_values_apply_only_to_declared_keys(tiny_nb):
    chosen = runs.resolve_params(tiny_nb, {"lr": "0.5"}, preset_name="smoke")
    assert chosen == {"limit": 300, "lr": 0.5, "out_dir": ""}


def test_new_run_dirs_are_new_and_named(tmp_path):
    a = rundir.new_run_dir("nb", "t1", tmp_path)
    b = rundir.new_run_dir("nb", "t1", tmp_path)
    assert a != b and a.is_dir() and b.is_dir()
    assert a.name.endswith("_nb_t1") and a.name[:8].isdigit() and a.name[8] == "T"
    with pytest.raises(ConfigError, match="tag"):
        rundir.new_run_dir("nb", "bad tag/../x", tmp_path)


@pytest.mark.slow
def test_cli_run_executes_into_a_new_folder_and_prints_it_last(tiny_nb, tmp_path):
    env = {**os.environ, "DFLASH_RUNS_ROOT": str(tmp_path / "runs")}
    out = subprocess.run([sys.executable, "-m", "dflash_lib", "run", str(tiny_nb), "-p", "limit", "7",
                          "--tag", "cli"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    run_dir = Path(out.stdout.strip().splitlines()[-1])
    assert run_dir.parent == tmp_path / "runs" and run_dir.name.endswith("_tiny_cli")
    assert json.loads((run_dir / "result.json").read_text()) == {"limit": 7, "lr": 0.001}
    params = json.loads((run_dir / "params.json").read_text())
    assert params["params"]["limit"] == 7 and params["params"]["out_dir"] == str(run_dir)
    env_json = json.loads((run_dir / "env.json").read_text())
    assert {"git_sha", "git_dirty", "packages", "host", "python"} <= env_json.keys()
    assert env_json["packages"]["torch"] == importlib.metadata.version("torch")  # recorded, whichever is installed
    executed = nbformat.read(run_dir / "tiny.ipynb", as_version=4)
    assert any("injected-parameters" in c.metadata.get("tags", []) for c in executed.cells)
    assert "Debugger warning" not in out.stderr and "WARNING" not in out.stderr  # kernel noise silenced


@pytest.mark.slow
def test_cli_refuses_unknown_key_with_exit_2(tiny_nb, tmp_path):
    env = {**os.environ, "DFLASH_RUNS_ROOT": str(tmp_path / "runs")}
    out = subprocess.run([sys.executable, "-m", "dflash_lib", "run", str(tiny_nb), "-p", "bogus", "1"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2
    assert "error: parameter 'bogus'" in out.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.fixture
def preset_nb(tmp_path):
    """A notebook that builds its config from a preset: it declares `preset` and one name, and writes what the
    config holds."""
    body = (
        "import json, pathlib\n"
        "from dflash_lib.lab.runs import notebook_config\n"
        "cfg = notebook_config(globals())\n"
        "pathlib.Path(cfg.run.out_dir, 'result.json').write_text(json.dumps(dict(\n"
        "    limit=cfg.data.limit, steps=cfg.train.steps, token_budget=cfg.sampler.token_budget)))\n"
    )
    return _notebook(tmp_path / "cfg_nb.ipynb", "preset = 'smoke'\nlimit = 300\nout_dir = ''\n", body)


def test_a_preset_notebook_takes_any_config_field_and_refuses_the_rest(preset_nb):
    chosen = runs.resolve_params(preset_nb, {"steps": "4"})  # not declared: a config field all the same
    assert chosen == {"preset": "smoke", "limit": 300, "out_dir": "", "steps": 4}
    assert runs.resolve_params(preset_nb, {}, preset_name="demo")["limit"] == 0  # the cell's names from the preset
    assert runs.accepted_parameters(preset_nb) == set(runs.FLAT_FIELDS) | {"preset"}
    with pytest.raises(ConfigError, match="'bogus' is not a parameter of cfg_nb.ipynb and is not a config field"):
        runs.resolve_params(preset_nb, {"bogus": "1"})
    with pytest.raises(ConfigError, match="steps must be >= 0"):  # validated against the preset's config
        runs.resolve_params(preset_nb, {"steps": "-1"})


@pytest.mark.slow
def test_cli_injects_undeclared_fields_into_the_notebook_config(preset_nb, tmp_path):
    """papermill injects `-p steps 4` although the parameters cell does not declare it; notebook_config picks it up,
    the rest comes from the preset."""
    env = {**os.environ, "DFLASH_RUNS_ROOT": str(tmp_path / "runs")}
    out = subprocess.run([sys.executable, "-m", "dflash_lib", "run", str(preset_nb), "-p", "steps", "4",
                          "--preset", "demo"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    run_dir = Path(out.stdout.strip().splitlines()[-1])
    demo = runs.get_preset("demo")
    assert json.loads((run_dir / "result.json").read_text()) == {
        "limit": demo.data.limit, "steps": 4, "token_budget": demo.sampler.token_budget}
    assert json.loads((run_dir / "params.json").read_text())["preset"] == "demo"
    assert "WARNING" not in out.stderr  # papermill's note on a name the cell does not declare stays quiet
