"""Checks every committed study notebook must pass: no outputs, no execution counts, no functions or classes
in its cells (computations live in dflash_lib), and a readable length."""

from __future__ import annotations

import nbformat


def assert_committed_clean(nb: nbformat.NotebookNode, max_lines: int = 150) -> None:
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    source = "\n".join(c.source for c in code)
    assert "def " not in source and "class " not in source
    assert len(source.splitlines()) < max_lines
