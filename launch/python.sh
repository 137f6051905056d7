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
cd python/tests
$PY -m pytest -q -p no:cacheprovider "$@"
# The patcher supports the newest megatron-core and older minors: run its tests once more
# against an older release, installed beside the newest one (PYTHONPATH puts it first).
OLDER=${FUSEDLOSS_MEGATRON_OLDER:-0.14.0}
if [ "${FUSEDLOSS_OFFLINE:-0}" != 1 ] && [ -n "$OLDER" ] && [ $# -eq 0 ]; then
  target="$(cd ../.. && pwd)/build/megatron-core-$OLDER"
  [ -d "$target/megatron" ] || $PY -m pip install -q --no-deps --target "$target" "megatron-core==$OLDER"
  export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
  echo "test_megatron.py against megatron-core $($PY -c 'from importlib.metadata import version; print(version("megatron-core"))')"
  $PY -m pytest -q -p no:cacheprovider test_megatron.py
fi
