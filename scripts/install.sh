#!/usr/bin/env bash
# Installs specjax from this checkout (editable, with the test extras) and the JAX build this machine
# needs, saying what it does at each step (pip's own output included):
#   1. Python: the active virtual environment (or conda env); else the system Python, unless it
#      refuses pip installs (PEP 668 "externally managed"): then the virtual environment .venv here
#      (created if missing; activate it afterwards: source .venv/bin/activate).
#   2. Accelerator: an NVIDIA GPU (nvidia-smi lists one) -> the `cuda12` extra (jax[cuda12]); a Cloud
#      TPU VM -> the `tpu` extra (jax[tpu], libtpu); otherwise JAX's CPU build (specjax/machine.py).
#   3. torch (xgrammar imports it): without an NVIDIA GPU a CPU build FIRST, so that pip never pulls
#      the multi-GB CUDA build as a dependency.
#   4. pip install -e ".[test,<extra>]"
#   5. Check: import specjax and print JAX's backend and devices (a warning when a GPU / TPU is
#      present but JAX runs on the CPU).
# Environment: PYTHON (default python3), SPECJAX_ACCEL=cpu|cuda12|cuda13|tpu (skip the detection),
# SPECJAX_VENV (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
step() { printf '\n==> [%s/5] %s\n' "$1" "$2"; }
PY=${PYTHON:-python3}
VENV=${SPECJAX_VENV:-.venv}

step 1 "Python environment"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "specjax needs Python >= 3.11; $PY is $("$PY" -V 2>&1) (set PYTHON=/path/to/python3.11+)" >&2; exit 1; }
KIND=$("$PY" - <<'EOF'
import os, sys, sysconfig
if sys.prefix != sys.base_prefix or os.environ.get("CONDA_PREFIX") == sys.prefix:
    print("venv")
elif os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) \
        and not os.environ.get("PIP_BREAK_SYSTEM_PACKAGES"):
    print("managed")
else:
    print("system")
EOF
)
USED_VENV=""
case "$KIND" in
  venv)   echo "    using the active environment: $("$PY" -c 'import sys; print(sys.prefix)')" ;;
  system) echo "    using $("$PY" -c 'import sys; print(sys.executable)') (no virtual environment active)" ;;
  managed)
    if [ ! -x "$VENV/bin/python" ]; then
      echo "    $PY refuses pip installs (PEP 668, externally managed): creating the virtual environment $VENV"
      "$PY" -m venv "$VENV" || {
        echo "cannot create $VENV (Debian / Ubuntu: sudo apt install python3-venv)" >&2; exit 1; }
    else
      echo "    $PY refuses pip installs (PEP 668, externally managed): using the virtual environment $VENV"
    fi
    PY="$VENV/bin/python"; USED_VENV=1 ;;
esac
"$PY" -V

step 2 "Accelerator"
ACCEL=${SPECJAX_ACCEL:-}
if [ -z "$ACCEL" ]; then
  ACCEL=$("$PY" -P specjax/machine.py)  # stdlib only: nvidia-smi, /dev/accel*, Google PCI devices
  case "$ACCEL" in cuda) ACCEL=cuda12 ;; esac
  echo "    detected: $ACCEL (override with SPECJAX_ACCEL=cpu|cuda12|cuda13|tpu)"
else
  echo "    SPECJAX_ACCEL=$ACCEL"
fi
case "$ACCEL" in
  cpu)    EXTRAS="test";          echo "    JAX: the CPU build" ;;
  cuda12|cuda13) EXTRAS="test,$ACCEL"; echo "    JAX: the CUDA build (jax[$ACCEL])"; nvidia-smi -L || true ;;
  tpu)    EXTRAS="test,tpu";      echo "    JAX: the TPU build (jax[tpu], libtpu)" ;;
  *) echo "unknown SPECJAX_ACCEL=$ACCEL (cpu, cuda12, cuda13 or tpu)" >&2; exit 1 ;;
esac

step 3 "torch (xgrammar imports it)"
if TV=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null); then
  echo "    torch $TV is already installed"
elif [ "${ACCEL#cuda}" != "$ACCEL" ]; then
  echo "    installing torch with CUDA (PyPI's default build)"
  "$PY" -m pip install torch
else
  echo "    installing a CPU build of torch (keeps pip from pulling the multi-GB CUDA build)"
  if ! "$PY" -m pip install --only-binary=:all: "torch==2.13.0+cpu" 2>/dev/null; then
    echo "    no local CPU wheel (pip find-links): taking it from the PyTorch CPU index"
    "$PY" -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
  fi
fi

step 4 "specjax and its dependencies: pip install -e \".[$EXTRAS]\" (about 3 GB with torch)"
"$PY" -m pip install -e ".[$EXTRAS]"

step 5 "Check"
"$PY" - <<'EOF'
import jax, torch, specjax
from specjax.machine import accelerator_warning, backend_line
print(f"    specjax installed ({specjax.__file__}): jax {jax.__version__}, torch {torch.__version__}")
print(f"    {backend_line()}")
why = accelerator_warning()
if why:
    print(f"    WARNING: {why}")
EOF
echo
echo "done in $((SECONDS - T0)) s."
if [ -n "$USED_VENV" ]; then
  echo "specjax is installed in the virtual environment $VENV: activate it in this shell (and in each new one):"
  echo "    source $VENV/bin/activate"
fi
