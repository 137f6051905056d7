#!/usr/bin/env bash
# Build-time variants of the SwiGLU kernels, timed with bench/swiglu_bench. A variant is
# "threads,groups,min_blocks": block size, column groups in flight per thread, and a register
# cap as resident blocks per SM (0: none). The shipped kernels are "256,1,0".
#   bench/swiglu_variants.sh build "256,1,0 256,2,0 256,2,4 128,2,8"   # compile (no GPU needed)
#   bench/swiglu_variants.sh run   "256,1,0 256,2,0 256,2,4 128,2,8" > variants.csv
# Each variant builds in build-swiglu-<variant>/ for sm_${ARCH:-90}; its binary is copied into
# build-swiglu-variants/, the one folder to take to the GPU machine: build ahead, run there.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
mode=${1:?usage: swiglu_variants.sh build|run "threads,groups,min_blocks ..."}
variants=${2:-"256,1,0"}
first=1
for v in $variants; do
  IFS=, read -r threads groups min_blocks <<< "$v"
  tag=$threads-$groups-$min_blocks
  dir=build-swiglu-$tag
  if [ "$mode" = build ]; then
    mkdir -p "$dir"
    log=$dir/variant.log
    flags="-DFUSEDLOSS_SWIGLU_THREADS=$threads -DFUSEDLOSS_SWIGLU_GROUPS=$groups"
    [ "$min_blocks" != 0 ] && flags+=" -DFUSEDLOSS_SWIGLU_MIN_BLOCKS=$min_blocks"
    cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="${ARCH:-90}" \
      -DFUSEDLOSS_TESTS=OFF -DFUSEDLOSS_EXAMPLES=OFF -DFUSEDLOSS_MPI=OFF -DFUSEDLOSS_NCCL=OFF \
      -DFUSEDLOSS_BENCH=ON -DFUSEDLOSS_PTXAS_REPORT=ON -DCMAKE_CUDA_FLAGS="$flags" > "$log" 2>&1
    cmake --build "$dir" --target swiglu_bench --clean-first >> "$log" 2>&1
    mkdir -p build-swiglu-variants
    cp "$dir/bench/swiglu_bench" "build-swiglu-variants/swiglu_bench-$tag"
    # registers and spill bytes of the benchmarked kernels (bf16, 16-byte packs), from ptxas
    awk -v v="$v" '/Compiling entry function|Function properties for/ {
        on = /swiglu_cuda/ && /StorageKindE2E(LS[0-9]_2E)?Li8E/ } !on { next }
      /Used [0-9]+ registers/ { for (i = 1; i < NF; i++) if ($(i+1) == "registers,") r = $i > r ? $i : r }
      /bytes stack frame/ { s = $5 > s ? $5 : s }
      END { printf "%s: bf16 kernels use at most %d registers, %d bytes spill stores\n", v, r, s }' "$log"
  elif [ "$mode" = run ]; then
    "build-swiglu-variants/swiglu_bench-$tag" | awk -v tag="$tag" -v first=$first \
      'NR==1 { if (first) print "variant," $0; next } { print tag "," $0 }'
    first=0
  else
    echo "mode: got '$mode', expected build or run" >&2
    exit 2
  fi
done
