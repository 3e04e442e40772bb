"""Project hygiene: notebooks committed clean and parameterised, conda env in sync, CI entry point."""

import json
import re
import tomllib
from pathlib import Path

import pytest

from dflash_lib.config import FLAT_FIELDS, coerce
from dflash_lib.lab.runs import PRESET, accepted_parameters, notebook_parameters
from dflash_lib.rundir import REPO_ROOT

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))


def test_notebooks_are_the_demo_chain_and_the_readme_table():
    """notebooks/ holds exactly the notebooks `make demo` chains (sorted names = run order) and the README's table
    describes, and every parameter the chain hands a notebook is one it accepts (the demo drops others silently)."""
    from dflash_lib.lab.demo import CHAIN, KEY_FIGURES

    stems = [p.stem for p in NOTEBOOKS]
    assert stems == [stem for stem, _ in CHAIN]
    assert re.findall(r"^\| `(\d\d_\w+)` \|", (REPO_ROOT / "README.md").read_text(), re.M) == stems
    assert {stem for stem, _ in KEY_FIGURES} <= set(stems)
    folders = {stem: Path("runs") / stem for stem in stems}
    for stem, derive in CHAIN:
        handed = derive(folders)
        assert handed.keys() <= accepted_parameters(REPO_ROOT / "notebooks" / f"{stem}.ipynb"), stem
    assert all(derive(folders) for _, derive in CHAIN[1:])  # each later notebook reads a folder before it
    for stem, _ in CHAIN:  # what a first demo-target step hands every notebook
        assert {"target", "tokenizer", "mask_id"} <= accepted_parameters(REPO_ROOT / "notebooks" / f"{stem}.ipynb")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_committed_without_outputs_and_parameterised(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), "strip outputs"
    tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1
    params = notebook_parameters(path)
    for key, value in params.items():
        if key == PRESET:  # the one parameter that is not a config field: the preset the config starts from
            continue
        assert key in FLAT_FIELDS, f"{path.name}: {key} is not a config field"
        coerce(key, value)  # the default has the field's type
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    source = "".join("".join(c["source"]) for c in code)
    assert not re.search(r"^\s*(def|class) ", source, re.M), "put functions and classes in dflash_lib"


def _names(reqs):
    return {re.split(r"[<>=\[ ]", r.strip(), maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def test_environment_yml_mirrors_pyproject():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    wanted = _names(project["dependencies"] + project["optional-dependencies"]["dev"]
                    + project["optional-dependencies"]["bench"])
    text = (REPO_ROOT / "environment.yml").read_text()
    pip = [line.strip()[2:] for line in text.splitlines() if line.strip().startswith("- ") and "=" in line
           and not line.strip().startswith("- python")]
    have = _names(pip)
    assert wanted == have, f"only in pyproject: {wanted - have}; only in environment.yml: {have - wanted}"
    pins = {r.split("==")[0]: r for r in pip if "==" in r}
    assert pins["torch"] == "torch==2.13.0"


def test_the_declared_versions_install_where_the_users_are():
    """The GPU image (Python 3.12, CUDA torch 2.11) can install the project; the venv's pinned 2.13 also fits."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    python = SpecifierSet(project["requires-python"])
    assert "3.11" in python and "3.12" in python
    torch = next(Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch")
    assert torch.specifier.contains("2.11.0") and torch.specifier.contains("2.13.0")


def test_ci_runs_make_test():
    assert "make test" in (REPO_ROOT / ".ci" / "run").read_text()
    readme = (REPO_ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme


def test_the_chain_ends_by_evaluating_the_training_run():
    """Notebook 05 evaluates the run notebook 04 wrote, and the demo report embeds its figures."""
    from dflash_lib.lab.demo import CHAIN, KEY_FIGURES

    assert [stem for stem, _ in CHAIN][-2:] == ["04_train", "05_evaluate"]
    folders = {stem: Path("runs") / stem for stem, _ in CHAIN}
    assert dict(CHAIN)["05_evaluate"](folders) == {"run": str(Path("runs") / "04_train")}
    assert [name for stem, name in KEY_FIGURES if stem == "05_evaluate"] == ["tau_by_step", "acceptance",
                                                                             "loss_vs_heldout"]
    declared = notebook_parameters(REPO_ROOT / "notebooks" / "04_train.ipynb")
    assert {"ckpt_every", "eval_every"} <= declared.keys()  # so that a run has checkpoints to evaluate


CITED_MD = re.compile(r"[A-Za-z0-9_./-]+\.md\b")


def cited_markdown(text: str) -> set[str]:
    """The `*.md` paths a text cites (a bare name means a file at the top or in docs/)."""
    return {m.lstrip("./") for m in CITED_MD.findall(text) if not m.startswith("http")}


def test_every_cited_markdown_file_is_in_the_repository():
    """Users have no ../shared: every *.md the code, notebooks, benchmarks or docs cite is a file we hold."""
    sources = [REPO_ROOT / "README.md", *(REPO_ROOT / "docs").glob("*.md"), *(REPO_ROOT / "dflash_lib").rglob("*.py"),
               *(REPO_ROOT / "notebooks").glob("*.ipynb"), *(REPO_ROOT / "benchmarks").glob("*.py")]
    missing = {}
    for path in sources:
        for cited in cited_markdown(path.read_text()):
            here = REPO_ROOT / cited
            bare = "/" not in cited and ((REPO_ROOT / "docs" / cited).is_file() or here.is_file())
            if not (here.is_file() or bare):
                missing.setdefault(cited, []).append(str(path.relative_to(REPO_ROOT)))
    assert missing == {}, f"cited but not in the repository: {missing}"
    assert cited_markdown("see shared/design/bucketing.md and docs/dflash.md") == {"shared/design/bucketing.md",
                                                                                  "docs/dflash.md"}


OUTSIDE = re.compile(r"\.\./shared\b|(?<![\w/])shared/")  # the design notes next to the repository, not in it


def unresolved_citations(text: str) -> list[str]:
    """What a text cites that a reader of the repository cannot open: a `*.md` that is not a file at that path
    from the repository root (`dflash.md` for `docs/dflash.md`), or anything under ../shared."""
    bad = sorted(m for m in cited_markdown(text) if not (REPO_ROOT / m).is_file())
    return bad + [m.group() for m in OUTSIDE.finditer(text)]


def test_code_cites_markdown_by_its_path_in_the_repository():
    """dflash_lib/, benchmarks/ and notebooks/ (comments, docstrings, markdown cells, strings alike) name a `*.md`
    by its path from the repository root, and never cite ../shared."""
    sources = [*(REPO_ROOT / "dflash_lib").rglob("*.py"), *(REPO_ROOT / "benchmarks").glob("*.py"),
               *(REPO_ROOT / "notebooks").glob("*.ipynb")]
    found = {str(p.relative_to(REPO_ROOT)): unresolved_citations(p.read_text()) for p in sources}
    assert {path: bad for path, bad in found.items() if bad} == {}
    cites = "the dflash.md rule, docs/dflash.md, LOG.md, ../shared/STYLE.md, shared/x, a cluster's /shared/runs"
    assert unresolved_citations(cites) == ["dflash.md", "shared/STYLE.md", "../shared", "shared/"]

