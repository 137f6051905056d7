#!/usr/bin/env bash
# The test suite: install, build, run every test (CPU backend, mpirun -np 2/3/4, install
# consumer; CUDA tests run when a GPU is present and skip with a reason otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
launch/deps.sh
launch/build.sh -DFUSEDLOSS_TESTS=ON
ctest --test-dir build --output-on-failure --timeout 600 -j 2
