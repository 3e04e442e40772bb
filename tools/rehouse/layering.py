#!/usr/bin/env python3
"""Layering report for dflash_lib: import circles, upward imports, function-local imports, top-level entries.

    python layering.py [REPO] [--legacy] [--strict]

REPO defaults to the current directory. Every module of REPO/dflash_lib is parsed (nothing is imported) and every
import statement counted: module level, inside `if TYPE_CHECKING:` ("type"), and inside functions ("local").
`from P import N` is an edge to P.N when P.N is a module of the package, else to P.

Stages (lower never imports higher): config, rundir (0) < data (1) < plan (2) < models (3) < train (4) <
evaluate, regenerate (5) < lab (6) < __main__ (7); the package's own __init__ is 0.
--legacy: a tree before the re-housing; each old module gets the stage of where rehouse.py (next to this file)
puts it, so the same report reads before and after.
--strict: exit 1 on a circle, an upward import or more than 14 top-level entries.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PKG = "dflash_lib"
STAGES = {"config": 0, "rundir": 0, "data": 1, "plan": 2, "models": 3, "train": 4, "evaluate": 5,
          "regenerate": 5, "lab": 6, "__main__": 7}
MAX_ENTRIES = 14


def modules(root: Path) -> dict[str, Path]:
    """{dotted module name: file} of every module under root/dflash_lib (a package as its __init__)."""
    out = {}
    for path in sorted((root / PKG).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (isinstance(t, ast.Attribute)
                                                                      and t.attr == "TYPE_CHECKING")


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, str, int]]:
    """(target module, kind 'top' | 'type' | 'local', line) of every import of a dflash_lib module in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            k = kind
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                k = "local"
            elif isinstance(child, ast.If) and _is_type_checking(child) and kind == "top":
                k = "type"
            if isinstance(child, ast.Import):
                for a in child.names:
                    if a.name == PKG or a.name.startswith(PKG + "."):
                        out.append((a.name, k, child.lineno))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    here = name.split(".") if is_pkg else name.split(".")[:-1]
                    here = here[:len(here) - (child.level - 1)]
                    base = ".".join(here + ([base] if base else []))
                if base == PKG or base.startswith(PKG + "."):
                    for a in child.names:
                        sub = f"{base}.{a.name}"
                        out.append((sub if sub in known else base, k, child.lineno))
            visit(child, k)

    visit(tree, "top")
    return list(dict.fromkeys(out))  # one per (target, kind, line): `from m import a, b` is one import


def legacy_stages(known: set[str]) -> dict[str, int]:
    """Stage of each OLD module: the stage of its destination in rehouse.py's tables."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import rehouse  # noqa: E402  (the tables only; nothing runs on import)

    out = {}
    for mod in known:
        rel = mod[len(PKG) + 1:] if mod != PKG else ""
        new = rehouse.destination_of_module(rel) if rel else ""
        out[mod] = stage_of(f"{PKG}.{new}" if new else PKG)
    return out


def stage_of(mod: str) -> int | None:
    parts = mod.split(".")[1:]
    if not parts:
        return 0
    return STAGES.get(parts[0])


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (or a module importing itself), Tarjan."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def top_entries(root: Path) -> list[str]:
    """The entries of dflash_lib/ a reader sees: modules and packages (no caches)."""
    return sorted(p.name for p in (root / PKG).iterdir()
                  if p.name != "__pycache__" and not p.name.startswith(".")
                  and (p.suffix == ".py" or (p.is_dir() and any(p.glob("*.py")))))


def report(root: Path, legacy: bool = False) -> dict[str, list]:
    mods = modules(root)
    known = set(mods)
    found = {m: imports(m, p, known) for m, p in mods.items()}
    stages = legacy_stages(known) if legacy else {m: stage_of(m) for m in known}
    edges: dict[str, set[str]] = {m: set() for m in known}
    upward, local, unstaged = [], [], set()
    for m, lst in found.items():
        for target, kind, line in lst:
            if target not in known:
                continue
            if target != m:
                edges[m].add(target)
            s, t = stages.get(m), stages.get(target)
            if s is None:
                unstaged.add(m)
            if t is None:
                unstaged.add(target)
            if s is not None and t is not None and t > s:
                upward.append(f"{mods[m].relative_to(root)}:{line}: {m} (stage {s}) -> {target} (stage {t}) [{kind}]")
            if kind == "local":
                local.append(f"{mods[m].relative_to(root)}:{line}: {m} -> {target}")
    circles = []
    for comp in cycles(edges):
        inside = sorted(f"{a} -> {b}" for a in comp for b in edges[a] if b in comp)
        circles.append(f"{' <-> '.join(comp)}: " + "; ".join(inside))
    return dict(circles=circles, upward=sorted(upward), local=sorted(local), entries=top_entries(root),
                unstaged=sorted(unstaged))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("repo", nargs="?", default=".")
    ap.add_argument("--legacy", action="store_true", help="stages of the old tree through rehouse.py's tables")
    ap.add_argument("--strict", action="store_true", help="exit 1 on a circle, an upward import, > 14 entries")
    args = ap.parse_args(argv)
    r = report(Path(args.repo).resolve(), args.legacy)
    print(f"import circles: {len(r['circles'])}")
    for line in r["circles"]:
        print("  " + line)
    print(f"imports from a lower stage into a higher one: {len(r['upward'])}")
    for line in r["upward"]:
        print("  " + line)
    print(f"function-local imports of dflash_lib modules: {len(r['local'])}")
    for line in r["local"]:
        print("  " + line)
    if r["unstaged"]:
        print(f"modules without a stage: {', '.join(r['unstaged'])}")
    print(f"top-level entries of {PKG}/: {len(r['entries'])} ({', '.join(r['entries'])})")
    bad = r["circles"] or r["upward"] or len(r["entries"]) > MAX_ENTRIES
    return 1 if args.strict and bad else 0


if __name__ == "__main__":
    sys.exit(main())
