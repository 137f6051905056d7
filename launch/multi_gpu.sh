#!/usr/bin/env bash
# Multi-GPU runs on one host with N GPUs (N = 2, 4, 8): the NCCL mpirun tests, the torchrun
# vocab-parallel example with its timing, for N ranks. NVLink multicast stays off.
#   launch/multi_gpu.sh 4
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-2}
export NCCL_NVLS_ENABLE=0
[ -x build/tests/test_multi_gpu ] || launch/build.sh -DFUSEDLOSS_TESTS=ON
echo "== mpirun -np $N: C++ vocab-parallel tests (MPI + CPU, NCCL + CUDA)"
mpirun --allow-run-as-root --oversubscribe -np "$N" -x NCCL_NVLS_ENABLE build/tests/test_multi_gpu
echo "== torchrun --nproc-per-node $N: PyTorch vocab-parallel cross-entropy"
for V in 131072 262144; do
  torchrun --standalone --nproc-per-node "$N" examples/vocab_parallel.py --vocab "$V" --rows 8192 --bench
done
