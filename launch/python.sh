#!/usr/bin/env bash
# Installs the Python package (pip install ., building the C++ core and the extension) and runs
# its pytest suite. Set FUSEDLOSS_OFFLINE=1 where no package index is reachable (the test
# dependencies must then be installed already).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
PY=${PYTHON:-python3}
if [ "${FUSEDLOSS_OFFLINE:-0}" != 1 ]; then
  # torch from PyPI; megatron-core: the newest release this Python supports
  $PY -m pip install -q "torch>=2.4" pybind11 "scikit-build-core>=0.10" pytest numpy megatron-core
fi
source launch/cuda_archs.sh
$PY -m pip install -q --no-build-isolation --no-deps .
cd python/tests && $PY -m pytest -q -p no:cacheprovider "$@"
