"""Which tests run (tests/conftest.py): ``python -m pytest`` leaves out the tests marked ``slow`` and those of
``FULL_ONLY``, and runs every fidelity and never-wrong test; ``PREFIXKV_FULL=1``, which ``.ci/run`` sets, runs them
all. Each entry of ``FULL_ONLY`` names a test that exists (a renamed test would otherwise run in the quick suite
unnoticed, or a stale entry stay)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import conftest
import pytest
import torch
from conftest import FULL_ONLY, full_only

ROOT = Path(__file__).resolve().parent.parent
# the suites that compare with stock generate or prove a refusal: never left out of the quick run
ALWAYS = ("test_generate_core", "test_generate_modes", "test_never_wrong", "test_families", "test_compat")


def collected(path: str, *, full: bool) -> set[str]:
    env = {k: v for k, v in os.environ.items() if k != "PREFIXKV_FULL"}
    if full:
        env["PREFIXKV_FULL"] = "1"
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", path]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return {line for line in run.stdout.splitlines() if line.startswith("tests/") and "::" in line}


def test_the_switch_runs_what_the_quick_run_leaves_out() -> None:
    quick, full = collected("tests/test_notebooks.py", full=False), collected("tests/test_notebooks.py", full=True)
    left = full - quick
    assert left and all(full_only(t) for t in left) and not any(full_only(t) for t in quick), (quick, full)


def test_the_quick_run_says_what_it_left_out_under_xdist_too() -> None:
    """Under pytest-xdist (``-n``, the README's test command) the workers collect and leave tests out, not the
    process that prints the summary: the count they left out must still reach it, as without xdist."""
    pytest.importorskip("xdist")
    env = {k: v for k, v in os.environ.items() if k != "PREFIXKV_FULL"}
    said = []
    for workers in ([], ["-n", "1"]):
        command = [sys.executable, "-m", "pytest", *workers, "-p", "no:cacheprovider", "tests/test_notebooks.py"]
        run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
        said.append([line for line in run.stdout.splitlines() if line.startswith("prefixkv: the quick suite; ")])
    assert said[0] and said[1] == said[0], said


def test_every_full_only_entry_names_a_test_that_exists() -> None:
    for start in FULL_ONLY:
        path, _, test = start.partition("::")
        source = (ROOT / path).read_text()
        name = test.split("[")[0]
        assert not name or re.search(rf"^def {name}\(", source, re.M), f"{start}: no such test"


def test_fidelity_and_never_wrong_suites_are_never_left_out() -> None:
    assert not [start for start in FULL_ONLY if any(f"/{name}.py" in start for name in ALWAYS)]


class _Item:
    def __init__(self, nodeid: str, slow: bool = False) -> None:
        self.nodeid, self.slow = nodeid, slow

    def get_closest_marker(self, name: str) -> object:
        return object() if name == "slow" and self.slow else None


class _Config:
    def __init__(self) -> None:
        self.deselected: list[Any] = []
        self.hook = self
        self.stash: dict[Any, Any] = {}

    def pytest_deselected(self, items: list[Any]) -> None:
        self.deselected += items


@pytest.mark.parametrize("full", [False, True])
def test_the_quick_run_deselects_the_slow_and_the_full_only(full: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conftest, "FULL", full)
    items = [
        _Item("tests/test_generate_core.py::test_cold_then_warm_matches_stock[float64]"),
        _Item("tests/test_invariance.py::test_smollm2_the_whole_chat_experiment", slow=True),
        _Item("tests/test_flex_generate.py::test_anything[beams]"),
        _Item("tests/test_docs.py::test_code_blocks_run[evaluation.md]"),
        _Item("tests/test_docs.py::test_code_blocks_run[faq.md]"),
    ]
    config = _Config()
    kept = list(items)
    conftest.pytest_collection_modifyitems(config, kept)  # type: ignore[arg-type]
    if full:
        assert kept == items and config.deselected == []
    else:
        assert [i.nodeid for i in kept] == [items[0].nodeid, items[4].nodeid]
        assert config.deselected == items[1:4]


def test_xdist_workers_share_the_cores_unless_omp_num_threads_says() -> None:
    worker_threads = conftest.worker_threads
    assert worker_threads({"PYTEST_XDIST_WORKER_COUNT": "2"}, 2) == 1
    assert worker_threads({"PYTEST_XDIST_WORKER_COUNT": "2"}, 16) == 8
    assert worker_threads({"PYTEST_XDIST_WORKER_COUNT": "4"}, 2) == 1  # at least one
    assert worker_threads({"PYTEST_XDIST_WORKER_COUNT": "2", "OMP_NUM_THREADS": "3"}, 16) is None
    assert worker_threads({}, 16) is None  # one process: torch's own default
    expected = worker_threads(os.environ, conftest.available_cores())
    if expected is not None:  # this run is an xdist worker without OMP_NUM_THREADS: it took its share
        assert torch.get_num_threads() == expected
