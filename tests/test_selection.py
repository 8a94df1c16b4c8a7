"""Which tests run (tests/conftest.py): ``python -m pytest`` leaves out the tests marked ``slow`` and those of
``FULL_ONLY``, and runs every fidelity and never-wrong test; ``PREFIXKV_FULL=1``, which ``.ci/run`` sets, runs them
all. Each entry of ``FULL_ONLY`` names tests that exist (a renamed test would otherwise run nowhere but CI, unnoticed,
or be left out of CI's count)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import FULL_ONLY, full_only

ROOT = Path(__file__).resolve().parent.parent
SLOW = "tests/test_invariance.py::test_smollm2_the_whole_chat_experiment_is_identical_warm_and_cold_in_bfloat16"
# the suites that compare with stock generate or prove a refusal: never left out of the quick run
ALWAYS = ("test_generate_core", "test_generate_modes", "test_never_wrong", "test_families", "test_compat")


def collected(files: list[str], *, full: bool) -> set[str]:
    env = {k: v for k, v in os.environ.items() if k != "PREFIXKV_FULL"}
    if full:
        env["PREFIXKV_FULL"] = "1"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return {line for line in run.stdout.splitlines() if line.startswith("tests/") and "::" in line}


def test_the_quick_run_leaves_out_only_the_full_only_and_slow_tests() -> None:
    files = sorted({start.split("::")[0] for start in FULL_ONLY} | {SLOW.split("::")[0], "tests/test_errors.py"})
    quick, full = collected(files, full=False), collected(files, full=True)
    assert quick < full
    left = full - quick
    for start in FULL_ONLY:
        assert any(full_only(t) == FULL_ONLY[start] for t in left if t.startswith(start)), f"{start}: no such test"
    assert SLOW in left, "a test marked slow runs in the quick run"
    assert {t for t in left if t != SLOW and not full_only(t)} == set(), "left out for no reason"
    assert [t for t in quick if full_only(t)] == []
    assert any(t.startswith("tests/test_errors.py::") for t in quick)


def test_fidelity_and_never_wrong_suites_are_never_left_out() -> None:
    assert not [start for start in FULL_ONLY if any(f"/{name}.py" in start for name in ALWAYS)]
