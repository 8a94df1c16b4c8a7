"""Clear the outputs of notebooks in place, as they are kept in git: ``python scripts/strip_notebooks.py``
(every notebook under notebooks/) or with paths. tests/test_notebooks.py fails on stored outputs."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat


def strip(path: Path) -> bool:
    """Clear outputs, execution counts and run metadata of ``path``; return whether it changed."""
    nb = nbformat.read(path, as_version=4)
    before = nbformat.writes(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        cell.metadata.pop("execution", None)
    nb.metadata.pop("widgets", None)
    after = nbformat.writes(nb)
    if after != before:
        path.write_text(after + "\n" if not after.endswith("\n") else after)
    return after != before


if __name__ == "__main__":
    paths = [Path(p) for p in sys.argv[1:]] or sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
    for p in paths:
        print(f"{p}: {'stripped' if strip(p) else 'already clean'}")
