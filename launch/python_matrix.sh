#!/usr/bin/env bash
# The Python suite under another interpreter and megatron-core release, in a venv of its own
# under build/ (the newest megatron-core needs Python >= 3.12, the CI's Python is 3.11):
#   PY=python3.12 MEGATRON="megatron-core==0.19.2" launch/python_matrix.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:?set PY to an interpreter, e.g. python3.12}
MEGATRON=${MEGATRON:-megatron-core}
venv="$PWD/build/venv-$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
"$venv/bin/python" -m pip install -q "torch>=2.4" numpy pytest pybind11 "scikit-build-core>=0.11" "$MEGATRON"
echo "Python $("$venv/bin/python" -V 2>&1 | cut -d' ' -f2), megatron-core \
$("$venv/bin/python" -c 'from importlib.metadata import version; print(version("megatron-core"))')"
PYTHON="$venv/bin/python" FUSEDLOSS_OFFLINE=1 FUSEDLOSS_MEGATRON_OLDER= launch/python.sh "$@"
