#!/usr/bin/env bash
# Times build-time variants of the cross-entropy kernels with bench/ce_bench, one build per
# variant, on the local GPU. A variant is "fwd_threads,fwd_unroll,bwd_threads,bwd_unroll" with
# an optional fifth field, the backward's resident blocks per SM (FUSEDLOSS_CE_BWD_MIN_BLOCKS,
# default 2). Arguments after the variants go to ce_bench ([rows] [V,V,...] [inplace|separate]).
# usage: bench/ce_variants.sh "256,8,512,8 256,8,512,8,1" 8192 50257,50304 > variants.csv
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
variants=${1:-"256,8,512,8"}
shift || true
first=1
for v in $variants; do
  IFS=, read -r ft fu bt bu bm <<< "$v"
  bm=${bm:-2}
  dir=build-variant-$ft-$fu-$bt-$bu-$bm
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DFUSEDLOSS_TESTS=OFF -DFUSEDLOSS_EXAMPLES=OFF -DFUSEDLOSS_MPI=OFF \
    -DCMAKE_CUDA_FLAGS="-DFUSEDLOSS_CE_FWD_THREADS=$ft -DFUSEDLOSS_CE_FWD_UNROLL=$fu -DFUSEDLOSS_CE_BWD_THREADS=$bt -DFUSEDLOSS_CE_BWD_UNROLL=$bu -DFUSEDLOSS_CE_BWD_MIN_BLOCKS=$bm" \
    > "$dir.log" 2>&1
  cmake --build "$dir" --target ce_bench >> "$dir.log" 2>&1
  "$dir/bench/ce_bench" "$@" | awk -v tag="$v" -v first=$first \
    'NR==1 { if (first) print "variant," $0; next } { print "\"" tag "\"," $0 }'
  first=0
done
