#!/usr/bin/env bash
# The test suite: install, build, run every test: the C++ suites (CPU backend, mpirun -np 2/3/4,
# install consumer) and the Python package's pytest suite (torch ops, torch.compile, gloo
# vocab-parallel, the Megatron-core patch). CUDA tests run when a GPU is present and skip with a
# printed reason otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
launch/deps.sh
launch/build.sh -DFUSEDLOSS_TESTS=ON
ctest --test-dir build --output-on-failure --timeout 600 -j 2
launch/python.sh
