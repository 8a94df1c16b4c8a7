"""prefixkv under transformers' tensor parallelism (docs/getting-started.md, "Several GPUs"): ``torchrun
--nproc-per-node 2`` on CPU (gloo) runs tests/tp_worker.py, a tiny float64 Llama (4 heads, 2 K/V heads) split with
``tp_plan="auto"``. Each process's store pools its own K/V head, and every public path (greedy, sampling, beams, a
padded batch, pins, enable, generate_many, score, save/load, the disk tier, invariant mode, the compiled step, an
agreed budget) gives stock ``generate``'s tokens and logits (within 1e-6) on an untouched twin split alike, the
stores' decisions equal in both processes after every call, and an ordinary request after every odd path. Skipped
where torch has no gloo backend; transformers 4.57.1 (torch 2.6) and 5.24 (torch 2.13) both split on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import prefixkv

WORKER = Path(__file__).parent / "tp_worker.py"

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="this torch build has no torch.distributed with the gloo backend, which tensor parallelism on CPU needs",
)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """What the two processes checked (tests/tp_worker.py raises on any failed check: torchrun then fails)."""
    out = tmp_path_factory.mktemp("tp")
    src = str(Path(prefixkv.__file__).parent.parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER)]
    run = subprocess.run([*command, str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    loaded: dict[str, object] = json.loads((out / "result.json").read_text())
    return loaded


def test_every_public_path_matches_stock_under_tensor_parallelism(result: dict[str, object]) -> None:
    checked = result["checked"]
    assert isinstance(checked, dict)
    paths = ["greedy, cold", "greedy, warm", "sampling", "beams", "padded batch", "pinned prefix", "enable"]
    paths += ["generate_many", "score", "loaded from this rank's file", "disk tier, restored", "invariant, cold"]
    paths += ["compiled step, cold", "compiled step, warm"]
    assert set(paths) <= set(checked), set(paths) - set(checked)
    assert all(0 <= diff <= 1e-6 for diff in checked.values()), checked
    odd = ["beams and a padded batch", "pin and unpin", "enable and disable", "generate_many", "score"]
    odd += ["the other rank's file refused", "the disk tier", "invariant mode", "the compiled step"]
    assert all(f"{name}, then an ordinary request" in checked for name in odd), checked


def test_each_process_pools_its_own_share_of_the_kv_heads(result: dict[str, object]) -> None:
    assert (result["world_size"], result["heads"], result["kv_heads"]) == (2, 4, 2)
    assert result["pool_kv_heads"] == [1, 1]  # measured from the tensors, not the config's 2


def test_the_processes_keep_the_least_budget(result: dict[str, object]) -> None:
    assert result["max_blocks"] == [7, 7]  # rank 0 was given 7 blocks, rank 1 8


def test_a_file_of_another_rank_is_refused_with_the_reason(result: dict[str, object]) -> None:
    refusal = str(result["refusal"])
    assert "rank 1 of 2" in refusal and "rank 0 of 2" in refusal and "one per rank" in refusal
