#!/usr/bin/env bash
# On a GPU machine: build for the local GPU, run the whole test suite, the CUDA tests under
# compute-sanitizer (memcheck, racecheck), the kernels' resource usage, and the benchmark.
# Logs and result CSVs go to ${OUT:-gpu-out}. Set SKIP_BENCH=1 / SKIP_SANITIZER=1 to shorten;
# BENCH_KINDS, BENCH_TIMEOUT, SANITIZER_FILTER, SANITIZER_TIMEOUT, PROPERTY_EXAMPLES narrow them;
# RMS_VARIANTS (launch shapes of the RMSNorm kernels, bench/rms_norm_bench's arguments) adds them.
# LCE_VARIANTS (e.g. all) adds the linear cross-entropy's pipeline variants (bench/lce_bench.py).
# Python: PYTHON, else the active environment, else python3 when it already has torch (GPU
# machines ship one; they often have no network for a fresh .venv), else .venv.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PATH="$PATH:/usr/local/cuda/bin"
if [ -z "${PYTHON:-}${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ] && python3 -c "import torch" 2>/dev/null; then
  export PYTHON=python3
fi
source launch/python_env.sh
status=0
step() { echo "== $*"; }

step build
BUILD_DIR=build-gpu launch/build.sh -DFUSEDLOSS_TESTS=ON -DFUSEDLOSS_BENCH=ON -DFUSEDLOSS_PTXAS_REPORT=ON \
  > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
step "kernel resources (ptxas)"
grep -E "Compiling entry|Used [0-9]+ registers|spill" "$OUT/build.log" | sed 's/ptxas info *: //' \
  > "$OUT/ptxas_report.txt"
echo "kernels: $(grep -c 'Compiling entry' "$OUT/ptxas_report.txt"), with spills: \
$(grep -c '[1-9][0-9]* bytes spill' "$OUT/ptxas_report.txt")"

step "python package (pip install .)"
FUSEDLOSS_OFFLINE=${FUSEDLOSS_OFFLINE:-1} launch/python.sh --collect-only -q > "$OUT/pytest.log" 2>&1 ||
  status=1
tail -1 "$OUT/pytest.log"

# Benchmarks first, while nothing else runs on the GPU. BENCH_KINDS picks them, BENCH_TIMEOUT
# bounds each (seconds).
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  for kind in ${BENCH_KINDS:-cross-entropy swiglu rms-norm linear-cross-entropy}; do
    step "benchmark $kind"
    extra=()
    [ "$kind" = linear-cross-entropy ] && extra=(--variants "${LCE_VARIANTS:-default}")
    PYTHONUNBUFFERED=1 timeout "${BENCH_TIMEOUT:-900}" "$PY" bench/run_bench.py $kind --build build-gpu \
      --out "$OUT" ${extra[@]+"${extra[@]}"} > "$OUT/bench-$kind.log" 2>&1 || status=1
    sed -n '/ on NVIDIA\| on .*copy bandwidth/,$p' "$OUT/bench-$kind.log" | grep -v "^\[rank"
  done
fi

# Then every test at once (the machine has cores to spare; the slowest suite sets the time):
# ctest, one pytest process per file with a line per test (a crash in one file keeps every
# other file's report), and the property tests on CUDA tensors with PROPERTY_EXAMPLES examples.
step "tests: ctest, pytest per file (CPU and CUDA), property tests on CUDA"
pids=()
ctest --test-dir build-gpu --output-on-failure --timeout 600 -j 6 > "$OUT/ctest.log" 2>&1 &
pids+=($!)
for f in python/tests/test_*.py; do
  name=$(basename "$f" .py)
  (cd python/tests && "$PY" -m pytest -v -rs -p no:cacheprovider "$name.py") > "$OUT/pytest-$name.log" 2>&1 &
  pids+=($!)
done
if nvidia-smi -L > /dev/null 2>&1; then
  (cd python/tests && FUSEDLOSS_PROPERTY_DEVICE=cuda FUSEDLOSS_PROPERTY_EXAMPLES=${PROPERTY_EXAMPLES:-300} \
    "$PY" -m pytest -q -p no:cacheprovider test_properties.py test_rms_norm.py -k "any_layout or property") \
    > "$OUT/pytest-properties-cuda.log" 2>&1 &
  pids+=($!)
fi
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)" "$OUT/ctest.log"
echo "CUDA tests that ran: $(grep -c 'cuda .*Passed' "$OUT/ctest.log") passed, skipped: $(grep -c 'cuda .*Skipped' "$OUT/ctest.log")"
cat "$OUT"/pytest-*.log >> "$OUT/pytest.log" && rm -f "$OUT"/pytest-*.log
grep -E "^(FAILED|ERROR)|Fatal Python error|[0-9]+ (passed|failed)" "$OUT/pytest.log" | tail -25

if [ "${SKIP_SANITIZER:-0}" != 1 ]; then
  for tool in memcheck racecheck; do
    step "compute-sanitizer $tool (${SANITIZER_FILTER:-*/cuda})"
    timeout "${SANITIZER_TIMEOUT:-1200}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
      build-gpu/tests/test_single_gpu --gtest_filter="${SANITIZER_FILTER:-*/cuda}" \
      > "$OUT/sanitizer_$tool.log" 2>&1 || status=1
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|tests ran|PASSED|FAILED" "$OUT/sanitizer_$tool.log" | head -5
  done
fi

if [ -d build-swiglu-variants ] && [ "${SKIP_BENCH:-0}" != 1 ]; then  # built ahead by swiglu_variants.sh
  step "SwiGLU kernel variants"
  variants=$(ls build-swiglu-variants | sed -n 's/^swiglu_bench-\([0-9]*\)-\([0-9]*\)-\([0-9]*\)$/\1,\2,\3/p')
  bench/swiglu_variants.sh run "$variants" > "$OUT/swiglu-variants.csv" 2> "$OUT/swiglu-variants.log" || status=1
  grep -E "^variant|fwd\+bwd|forward" "$OUT/swiglu-variants.csv" | cut -d, -f1,3,4,6,7
fi
# RMSNorm launch shapes, chosen at run time: RMS_VARIANTS="default bwd_prefetch=0 ...", one
# variant a word (bench/rms_norm_bench's arguments); the table shows ms, floor and ratio.
if [ -n "${RMS_VARIANTS:-}" ] && [ "${SKIP_BENCH:-0}" != 1 ]; then
  step "RMSNorm kernel variants"
  # shellcheck disable=SC2086
  build-gpu/bench/rms_norm_bench $RMS_VARIANTS > "$OUT/rms-norm-variants.csv" \
    2> "$OUT/rms-norm-variants.log" || status=1
  grep -E '^variant|fwd\+bwd|,forward,' "$OUT/rms-norm-variants.csv" | sed -E 's/,[^,]*,[^,]*$//'
fi
if [ "${PACK_LOGS:-0}" = 1 ]; then  # few files to carry back: logs in one archive
  (cd "$OUT" && tar czf logs.tar.gz *.log *.txt && rm -f *.log *.txt)
fi
exit $status
