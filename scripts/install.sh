#!/usr/bin/env bash
# Installs specjax (editable, with test extras) into the current Python environment.
# xgrammar needs torch; on a machine without a GPU we install a CPU build of torch FIRST,
# so that pip never pulls the multi-GB CUDA build as a dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install -q torch
  elif ! "$PY" -m pip install -q --only-binary=:all: "torch==2.13.0+cpu" 2>/dev/null; then
    # no local CPU wheel (pip find-links): take it from the PyTorch CPU index
    "$PY" -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
  fi
fi
"$PY" -m pip install -q -e ".[test]"
"$PY" -c "import torch, jax, specjax; print('specjax installed: jax', jax.__version__, 'torch', torch.__version__)"
