#!/usr/bin/env bash
# Multi-GPU runs on one host with N GPUs (N = 2, 4, 8): the NCCL mpirun tests, the torchrun
# vocab-parallel example (checked against the unsharded reference), and the TP-scaling benchmark
# at TP = 1, 2, ... N against Megatron-core and Liger-Kernel (CSV + plot in ${OUT:-bench/results}).
# NVLink multicast stays off.
#   launch/multi_gpu.sh 4
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-2}
export NCCL_NVLS_ENABLE=0
source launch/python_env.sh
[ -x build/tests/multi_gpu/test_multi_gpu ] || launch/build.sh -DFUSEDLOSS_TESTS=ON
echo "== mpirun -np $N: C++ vocab-parallel tests (MPI + CPU, NCCL + CUDA)"
mpirun --allow-run-as-root --oversubscribe -np "$N" -x NCCL_NVLS_ENABLE build/tests/multi_gpu/test_multi_gpu
echo "== torchrun --nproc-per-node $N: PyTorch vocab-parallel cross-entropy"
"$PY" -m torch.distributed.run --standalone --nproc-per-node "$N" examples/vocab_parallel.py  # checked in float64
echo "== TP scaling benchmark"
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
rm -f "$OUT/$(date +%F)"-*-tp.csv  # one fresh table per day and machine
for n in 1 2 4 8; do
  [ "$n" -le "$N" ] || break
  # TP_BENCH_ARGS: e.g. "--vocab 4096 --rows 64" for a quick check of the script itself
  "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" bench/tp_bench.py --out "$OUT" ${TP_BENCH_ARGS:-}
done
"$PY" bench/tp_bench.py --summarize "$(ls -t "$OUT"/*-tp.csv | head -1)"
