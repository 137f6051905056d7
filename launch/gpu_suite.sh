#!/usr/bin/env bash
# On a GPU machine: build for the local GPU, run the whole test suite, the CUDA tests under
# compute-sanitizer (memcheck, racecheck), the kernels' resource usage, and the benchmark.
# Logs and result CSVs go to ${OUT:-gpu-out}. Set SKIP_BENCH=1 / SKIP_SANITIZER=1 to shorten.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PATH="$PATH:/usr/local/cuda/bin"
status=0
step() { echo "== $*"; }

step build
BUILD_DIR=build-gpu launch/build.sh -DFUSEDLOSS_TESTS=ON -DFUSEDLOSS_BENCH=ON \
  > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
grep -i -E "spill|warning" "$OUT/build.log" | head -20
step resource usage
cuobjdump --dump-resource-usage build-gpu/CMakeFiles/fusedloss.dir/src/cuda/*.o 2>&1 \
  | grep -E "Function|REG|STACK" | sed 's/^ *//' > "$OUT/resource_usage.txt"
grep -c "STACK:0" "$OUT/resource_usage.txt" | sed 's/^/kernels with no stack frame: /'
grep -v "STACK:0" "$OUT/resource_usage.txt" | grep STACK | head -5

step ctest
ctest --test-dir build-gpu --output-on-failure --timeout 600 -j 4 > "$OUT/ctest.log" 2>&1 || status=1
grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)" "$OUT/ctest.log"
echo "CUDA tests that ran: $(grep -c 'cuda .*Passed' "$OUT/ctest.log") passed, skipped: $(grep -c 'cuda .*Skipped' "$OUT/ctest.log")"

if [ "${SKIP_SANITIZER:-0}" != 1 ]; then
  for tool in memcheck racecheck; do
    step "compute-sanitizer $tool"
    compute-sanitizer --tool "$tool" --error-exitcode 9 build-gpu/tests/test_single_gpu \
      --gtest_filter='*/cuda' > "$OUT/sanitizer_$tool.log" 2>&1 || status=1
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|tests ran|PASSED|FAILED" "$OUT/sanitizer_$tool.log" | head -5
  done
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  step benchmark
  PYTHONUNBUFFERED=1 python3 bench/run_ce_bench.py --binary build-gpu/bench/ce_bench --out "$OUT" \
    2>&1 | tee "$OUT/bench.log" | grep -v "^\[bench\]" || status=1
fi
exit $status
