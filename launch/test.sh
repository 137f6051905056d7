#!/usr/bin/env bash
# The test suite: install, build, run every test: the C++ suites (CPU backend, mpirun -np 2/3/4,
# install consumer: CMake install, CPU-only install, the wheel's SDK) and the Python package's
# pytest suite (torch ops, torch.compile, gloo vocab-parallel, the Megatron-core patch), then
# the documentation site, built strict (launch/docs.sh: a broken link fails it). CUDA
# tests run when a GPU is present and skip with a printed reason otherwise. Every suite runs even
# when an earlier one fails; the last lines are one summary per suite (ran, skipped and why,
# failed), and the exit status is non-zero when anything failed. Python: as launch/quickstart.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
launch/deps.sh || exit 1
source launch/python_env.sh
REPORTS="$PWD/build/test-reports"
rm -rf "$REPORTS" && mkdir -p "$REPORTS"
launch/build.sh -DFUSEDLOSS_TESTS=ON || exit 1
status=0
echo "== C++ tests (ctest)"
ctest --test-dir build --output-on-failure --timeout 600 -j 2 --output-junit "$REPORTS/ctest.xml" \
  --test-output-size-passed 262144 --test-output-size-failed 262144 || status=1
echo "== Python package"
FUSEDLOSS_REPORTS="$REPORTS" launch/python.sh || status=1
echo "== documentation (mkdocs build --strict)"
FUSEDLOSS_REPORTS="$REPORTS" launch/docs.sh || status=1
echo "== summary"
"$PY" launch/test_summary.py "$REPORTS" || status=1
exit $status
