"""The notebooks run top to bottom on the embedded model (each checks its own results with asserts), show no
warning (a user should never have to ignore one: tqdm's "IProgress not found" needs ipywidgets, in the test
extra), show the cached prefixes as text, and git keeps them without outputs."""

from __future__ import annotations

import html
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_the_notebooks_are_there() -> None:
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "how_it_works.ipynb", "vlm_chat.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name}, cell {i}: outputs are stored; run `python scripts/strip_notebooks.py` before committing"
            )
    assert "widgets" not in nb.metadata


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the embedded model (CI), or SmolLM2 where the real-model tests are switched on
    monkeypatch.setenv("PREFIXKV_MODEL", "smollm2" if os.environ.get("PREFIXKV_REAL_TESTS") == "1" else "embedded")
    nb = nbformat.read(path, as_version=4)
    # raises CellExecutionError, with the cell and its traceback, when a cell fails
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    warned = [o["text"] for o in outputs if o.get("name") == "stderr" and "Warning" in o.get("text", "")]
    assert not warned, f"{path.name} shows warnings: {warned}"
    kinds = {kind for o in outputs for kind in o.get("data", {})}
    assert "image/png" in kinds, f"{path.name} drew no figure"
    assert "text/html" in kinds, f"{path.name} displayed no store or cache"
    if path.name == "quickstart.ipynb":  # store.show(tok): the cached prefixes as text, with ids on hover
        views = [o["data"]["text/html"] for o in outputs if "prefixes" in o.get("data", {}).get("text/html", "")]
        text = html.unescape(re.sub(r"<[^>]+>", "", views[0])) if views else ""
        assert "twice online." in text and "<span title='id " in views[0], "the store is not shown as text"
