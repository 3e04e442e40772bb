"""The package's layering: one package per stage, a lower stage never imports a higher one, no import circle.

Stages, bottom to top: families, config, rundir < data < plan < models < serve (the engine) < target (every source of the
target's features) < train < evaluate (and its benchmark_report), regenerate, doctor, export, dryrun < lab < __main__.
The trainer reads the engine through target/ only: train/ never imports serve/ (nor serve/ train/). The evaluation
reads run folders through rundir.reader: evaluate/ never imports train/.
Every import statement of every dflash_lib module counts (module level, TYPE_CHECKING blocks, inside
functions); the files are parsed, nothing is imported.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "dflash_lib"
STAGES = {"families": 0, "config": 0, "rundir": 0, "data": 1, "plan": 2, "models": 3, "serve": 4, "target": 5,
          "train": 6, "evaluate": 7, "benchmark_report": 7, "regenerate": 7, "doctor": 7, "export": 7, "dryrun": 7, "lab": 8,
          "__main__": 9}
APART = {("train", "serve"), ("serve", "train"),  # (importer, imported): packages that never import each other
         ("evaluate", "train")}  # the evaluation reads a run folder through rundir.reader, not the trainer's modules
MAX_ENTRIES = 18  # modules and packages directly under dflash_lib/ (15th: dryrun/, 16th: export.py, out of train/;
# 17th: target/, out of models/, train/ and serve/; 18th: families/, out of config.py and models/shapes.py)


def modules(root: Path) -> dict[str, Path]:
    """{dotted module name: file} under root/dflash_lib (a package as its __init__)."""
    out = {}
    for path in sorted((root / PKG).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported dflash_lib module, line, inside a function) for every import statement of `path`; `from P
    import N` counts as an import of P.N when that is a module."""
    out = []
    is_pkg = path.name == "__init__.py"

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, inner) for a in child.names if a.name.split(".")[0] == PKG)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    here = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = ".".join(here[:len(here) - child.level + 1] + ([base] if base else []))
                if base.split(".")[0] == PKG:
                    out.extend((f"{base}.{a.name}" if f"{base}.{a.name}" in known else base, child.lineno, inner)
                               for a in child.names)
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return out


def stage(module: str) -> int | None:
    parts = module.split(".")[1:]
    return STAGES.get(parts[0]) if parts else 0


def graph(root: Path) -> tuple[dict[str, Path], dict[str, list[tuple[str, int, bool]]]]:
    mods = modules(root)
    return mods, {m: [i for i in imports(m, p, set(mods)) if i[0] in mods and i[0] != m] for m, p in mods.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def top_entries(root: Path) -> list[str]:
    return sorted(p.name for p in (root / PKG).iterdir()
                  if p.name != "__pycache__" and (p.suffix == ".py" or (p / "__init__.py").is_file()))


@pytest.fixture(scope="module")
def tree() -> tuple[dict[str, Path], dict[str, list[tuple[str, int, bool]]]]:
    return graph(ROOT)


def test_every_module_has_a_stage(tree):
    mods, _ = tree
    assert [m for m in mods if stage(m) is None] == []


def test_no_import_circle(tree):
    """Function-local imports count: a circle broken only by importing late is still a circle."""
    _, found = tree
    assert circles({m: {t for t, _, _ in lst} for m, lst in found.items()}) == []


def test_no_lower_stage_imports_a_higher_one(tree):
    mods, found = tree
    upward = [f"{mods[m].relative_to(ROOT)}:{line}: {m} -> {t}" for m, lst in found.items() for t, line, _ in lst
              if stage(t) > stage(m)]
    assert upward == []


def package(module: str) -> str:
    parts = module.split(".")[1:]
    return parts[0] if parts else ""


def test_the_trainer_reads_the_engine_through_target_and_the_evaluation_runs_through_rundir(tree):
    mods, found = tree
    crossing = [f"{mods[m].relative_to(ROOT)}:{line}: {m} -> {t}" for m, lst in found.items() for t, line, _ in lst
                if (package(m), package(t)) in APART]
    assert crossing == []


def test_only_the_serving_package_names_an_engine_module(tree):
    """What is one engine's alone (serve/vllm.py) is read through its adapter (`server.engine_adapter`) everywhere
    else: a second engine is one module, not a walk through its importers."""
    mods, found = tree
    named = [f"{mods[m].relative_to(ROOT)}:{line}: {m} -> {t}" for m, lst in found.items() for t, line, _ in lst
             if t == f"{PKG}.serve.vllm" and package(m) != "serve"]
    assert named == []


def test_imports_of_the_package_are_at_the_top_except_in_the_command_line(tree):
    """So the layering is visible in each file's header. The command line imports each command's stage when the
    command runs (`--help` loads no torch)."""
    mods, found = tree
    local = [f"{mods[m].relative_to(ROOT)}:{line}: {t}" for m, lst in found.items() for t, line, inner in lst
             if inner and m != f"{PKG}.__main__"]
    assert local == []


def test_the_package_root_stays_small():
    entries = top_entries(ROOT)
    assert len(entries) <= MAX_ENTRIES, entries


def _copy_with(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of the package's modules with `line` appended to `module` (a path under dflash_lib/)."""
    for path in modules(ROOT).values():
        dest = tmp_path / path.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(path.read_text())
    target = tmp_path / PKG / module
    target.write_text(target.read_text() + "\n\n" + line)
    return tmp_path


def test_a_planted_upward_import_is_caught(tmp_path):
    root = _copy_with(tmp_path, "models/export.py", "from dflash_lib.train.loop import train\n")
    _, found = graph(root)
    assert [(m, t) for m, lst in found.items() for t, _, _ in lst if stage(t) > stage(m)] == \
        [(f"{PKG}.models.export", f"{PKG}.train.loop")]


def test_a_planted_import_of_the_engine_by_the_trainer_is_caught(tmp_path):
    root = _copy_with(tmp_path, "train/build.py", "from dflash_lib.serve.hidden_states import EngineFiles\n")
    _, found = graph(root)
    assert [(m, t) for m, lst in found.items() for t, _, _ in lst if (package(m), package(t)) in APART] == \
        [(f"{PKG}.train.build", f"{PKG}.serve.hidden_states")]


def test_a_planted_import_of_the_trainer_by_the_evaluation_is_caught(tmp_path):
    root = _copy_with(tmp_path, "evaluate/run.py", "from dflash_lib.train.summary import run_summary\n")
    _, found = graph(root)
    assert [(m, t) for m, lst in found.items() for t, _, _ in lst if (package(m), package(t)) in APART] == \
        [(f"{PKG}.evaluate.run", f"{PKG}.train.summary")]


def test_a_planted_circle_is_caught_even_inside_a_function(tmp_path):
    root = _copy_with(tmp_path, "models/drafter.py", "def _late():\n    from dflash_lib.models import export\n")
    _, found = graph(root)
    assert circles({m: {t for t, _, _ in lst} for m, lst in found.items()}) == \
        [[f"{PKG}.models.dflash2", f"{PKG}.models.drafter", f"{PKG}.models.drafters", f"{PKG}.models.drafters.dflash",
          f"{PKG}.models.drafters.dflash2", f"{PKG}.models.export"]]
    # (export reads the drafter through its kind: models/drafters/ -> dflash.py -> drafter.py)
