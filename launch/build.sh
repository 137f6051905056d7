#!/usr/bin/env bash
# Configures and builds into ${BUILD_DIR:-build}. CUDA is on when nvcc is found; set
# FUSEDLOSS_CUDA_ARCHS (default: the local GPU's, else 90; the library's own default is "80;90").
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
source launch/cuda_archs.sh
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES="$FUSEDLOSS_CUDA_ARCHS" "$@"
cmake --build "$BUILD_DIR" --parallel "$(nproc)"
