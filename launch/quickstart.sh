#!/usr/bin/env bash
# Quickstart: install, build, run the C++ examples (cross-entropy at TP=1 and vocab-parallel over
# 2 ranks, SwiGLU in place, the linear cross-entropy into an fp32 main_grad), then install the Python package and run the PyTorch example (GPU if
# present, else CPU). Python: the active virtual environment, PYTHON=..., or .venv in the
# repository (created when neither is given; see launch/python_env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
launch/deps.sh
launch/build.sh -DFUSEDLOSS_TESTS=OFF -DFUSEDLOSS_BENCH=OFF
MPIRUN="mpirun --allow-run-as-root --oversubscribe"
echo "== TP=1 =="
$MPIRUN -np 1 build/examples/tp_cross_entropy
echo "== vocab-parallel, 2 ranks =="
$MPIRUN -np 2 build/examples/tp_cross_entropy
echo "== SwiGLU (C++) =="
build/examples/swiglu_step
echo "== linear cross-entropy (C++) =="
build/examples/linear_ce_step
echo "== Python API =="
source launch/python_env.sh
fl_install_torch
"$PY" -m pip install -q numpy pybind11 "scikit-build-core>=0.11"
source launch/cuda_archs.sh
"$PY" -m pip install -q --no-build-isolation --no-deps .
"$PY" examples/quickstart.py
