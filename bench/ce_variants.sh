#!/usr/bin/env bash
# Times build-time variants of the cross-entropy kernels with bench/ce_bench, one build per
# variant, on the local GPU. A variant is "fwd_threads,fwd_unroll,bwd_threads,bwd_unroll".
# usage: bench/ce_variants.sh "256,8,512,8 512,4,512,4" > variants.csv
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
first=1
for v in ${1:-"256,8,512,8"}; do
  IFS=, read -r ft fu bt bu <<< "$v"
  dir=build-variant-$ft-$fu-$bt-$bu
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DFUSEDLOSS_TESTS=OFF -DFUSEDLOSS_EXAMPLES=OFF -DFUSEDLOSS_MPI=OFF \
    -DCMAKE_CUDA_FLAGS="-DFUSEDLOSS_CE_FWD_THREADS=$ft -DFUSEDLOSS_CE_FWD_UNROLL=$fu -DFUSEDLOSS_CE_BWD_THREADS=$bt -DFUSEDLOSS_CE_BWD_UNROLL=$bu" \
    > "$dir.log" 2>&1
  cmake --build "$dir" --target ce_bench >> "$dir.log" 2>&1
  "$dir/bench/ce_bench" | awk -v tag="$v" -v first=$first \
    'NR==1 { if (first) print "variant," $0; next } { print "\"" tag "\"," $0 }'
  first=0
done
