#!/usr/bin/env bash
# Times build-time variants of the cross-entropy kernels (threads per block, loads in flight,
# streaming cache hints) with bench/ce_bench, one build per variant, on the local GPU.
# usage: bench/ce_variants.sh "512,4,0 256,8,0 ..." > variants.csv
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
first=1
for v in ${1:-"512,4,0 512,8,0 256,8,0"}; do
  IFS=, read -r threads unroll streaming <<< "$v"
  dir=build-variant-$threads-$unroll-$streaming
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DFUSEDLOSS_TESTS=OFF -DFUSEDLOSS_EXAMPLES=OFF -DFUSEDLOSS_MPI=OFF \
    -DCMAKE_CUDA_FLAGS="-DFUSEDLOSS_CE_THREADS=$threads -DFUSEDLOSS_CE_UNROLL=$unroll -DFUSEDLOSS_CE_STREAMING=$streaming" \
    > "$dir.log" 2>&1
  cmake --build "$dir" --target ce_bench >> "$dir.log" 2>&1
  "$dir/bench/ce_bench" | awk -v tag="$v" -v first=$first -F, \
    'NR==1 { if (first) print "variant," $0; next } { print "\"" tag "\"," $0 }'
  first=0
done
