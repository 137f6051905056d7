#!/usr/bin/env bash
# Installs the Python package (pip install ., building the C++ core and the extension), checks
# the C++ SDK it ships (the wheel's file list; a CMake consumer finding it through
# python -m fusedloss --cmake-prefix-path and --cmake-dir, and with COMPONENTS CPU without the
# CUDA toolkit) and runs its pytest suite.
# Python: as launch/quickstart.sh (launch/python_env.sh). Set FUSEDLOSS_OFFLINE=1 where no
# package index is reachable (the test dependencies must then be installed already).
# FUSEDLOSS_REPORTS=<dir>: JUnit XML and results for launch/test_summary.py go there.
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
source launch/python_env.sh
if [ "${FUSEDLOSS_OFFLINE:-0}" != 1 ]; then
  # torch (CPU wheels where there is no GPU, when reachable); megatron-core: the newest release
  # this Python supports
  fl_install_torch || exit 1
  "$PY" -m pip install -q pybind11 "scikit-build-core>=0.11" pytest hypothesis numpy megatron-core || exit 1
  # jax (its CPU wheels): fusedloss.jax's tests, and XLA's FFI headers for the build to find
  "$PY" -m pip install -q jax || exit 1
  # transformers: fusedloss.huggingface's tests (tiny random-weight models of each family)
  "$PY" -m pip install -q transformers || exit 1
  # trl: fusedloss.trl's tests (its GRPO trainer on a tiny model); verl without its trainer's
  # dependencies (ray, ...): fusedloss.verl's tests read its torch-only modules
  "$PY" -m pip install -q trl || exit 1
  "$PY" -m pip install -q --no-deps verl || exit 1
fi
source launch/cuda_archs.sh
"$PY" -m pip install -q --no-build-isolation --no-deps . || exit 1
status=0
reports=${FUSEDLOSS_REPORTS:-}
junit() { [ -n "$reports" ] && echo "--junitxml=$reports/pytest$1.xml"; }

echo "== the wheel's C++ SDK: file list, find_package(fusedloss) through python -m fusedloss"
wheel=passed
"$PY" tests/install_consumer/wheel_files.py || wheel=failed
prefixes="$("$PY" -m fusedloss --cmake-prefix-path);$("$PY" -m fusedloss --cmake-dir)"
version="$("$PY" -c 'import fusedloss; print(fusedloss.__version__)')"
has_cuda="$("$PY" -c 'import fusedloss; print(int(fusedloss.build_info()["backends"]["CUDA"]))')"
"$PY" -m fusedloss --info
cmake -DMODE=prefix -DSOURCE_DIR="$PWD/tests/install_consumer" -DBUILD_ROOT="$PWD/build/install_consumer_wheel" \
  "-DPREFIXES=$prefixes" -DEXPECT_VERSION="$version" -DHAS_CUDA="$has_cuda" \
  -P tests/install_consumer/run.cmake > build/install_consumer_wheel.log 2>&1 ||
  { tail -30 build/install_consumer_wheel.log; wheel=failed; }
grep -E "^-- fusedloss|^fusedloss" build/install_consumer_wheel.log
echo "wheel consumer: $wheel"
[ "$wheel" = passed ] || status=1
[ -n "$reports" ] && echo "$wheel" > "$reports/wheel_consumer.txt"

echo "== pytest"
cd python/tests
"$PY" -m pytest -q -rs -p no:cacheprovider $(junit "") "$@" || status=1
# The patcher supports the newest megatron-core and older minors: run its tests once more
# against an older release, installed beside the newest one (PYTHONPATH puts it first).
OLDER=${FUSEDLOSS_MEGATRON_OLDER:-0.14.0}
if [ "${FUSEDLOSS_OFFLINE:-0}" != 1 ] && [ -n "$OLDER" ] && [ $# -eq 0 ]; then
  target="$(cd ../.. && pwd)/build/megatron-core-$OLDER"
  [ -d "$target/megatron" ] || "$PY" -m pip install -q --no-deps --target "$target" "megatron-core==$OLDER" ||
    status=1
  export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
  echo "test_megatron.py against megatron-core $("$PY" -c 'from importlib.metadata import version; print(version("megatron-core"))')"
  "$PY" -m pytest -q -rs -p no:cacheprovider $(junit "-megatron-core-$OLDER") test_megatron.py || status=1
fi
exit $status
