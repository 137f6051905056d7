#!/usr/bin/env bash
# Quickstart: install, build, and run the C++ example at TP=1 and vocab-parallel over 2 ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
launch/deps.sh
launch/build.sh -DFUSEDLOSS_TESTS=OFF
MPIRUN="mpirun --allow-run-as-root --oversubscribe"
echo "== TP=1 =="
$MPIRUN -np 1 build/examples/tp_cross_entropy
echo "== vocab-parallel, 2 ranks =="
$MPIRUN -np 2 build/examples/tp_cross_entropy
