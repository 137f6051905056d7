#!/usr/bin/env bash
# On a GPU machine: the whole test suite in stages, each bounded (STAGE_TIMEOUT, default 480 s,
# so that a stage and the packing of its logs fit an 8-minute command), its logs packed into
# $OUT/<stage>.tar.gz, its wall time and status appended to $OUT/stage-times.txt and, for the
# pytest stages, one line per test file (its pytest summary, or why it has none) to
# $OUT/pytest-files.txt:
#
#   launch/gpu_suite.sh [STAGE ...]        (no stage: all of them, in this order)
#
#   build       build-gpu (tests, benchmarks, ptxas report) and pip install . of the package
#   ctest       the C++ suites (CPU and CUDA backends)
#   pytest      every Python test file but the slow ones and JAX's, one process per file at once
#   pytest-tp   test_vocab_parallel.py (gloo TP worlds)
#   pytest-lce  test_linear_cross_entropy.py (gloo TP worlds; the two side by side did not finish
#               in 260 s on an H100 machine, so each has a stage of its own)
#   pytest-jax  test_jax.py alone (JAX in a process of its own: it would take most of the GPU's
#               memory up front; XLA_PYTHON_CLIENT_PREALLOCATE=false all the same)
#   properties  the property tests on CUDA tensors (PROPERTY_EXAMPLES examples, default 300)
#   sanitizer   compute-sanitizer memcheck and racecheck over the CUDA C++ tests
#   bench       the benchmarks (BENCH_KINDS; LCE_VARIANTS adds the linear CE's variants)
#
# A later stage needs the build stage's outputs (build-gpu, the installed package): run the
# stages of one machine in order, in one command or in commands on the same warm machine.
# Logs and result CSVs go to ${OUT:-gpu-out}. Python: PYTHON, else the active environment, else
# python3 when it already has torch (GPU machines ship one; they often have no network for a
# fresh .venv), else .venv. Exit status: non-zero when a stage failed or timed out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PATH="$PATH:/usr/local/cuda/bin"
if [ -z "${PYTHON:-}${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ] && python3 -c "import torch" 2>/dev/null; then
  export PYTHON=python3
fi
source launch/python_env.sh
# The commit the benchmarks' CSVs name: a GPU machine's copy of the tree is no git checkout, so
# the caller passes it (FUSEDLOSS_COMMIT=$(git rev-parse --short HEAD)); else git's, else unknown.
export FUSEDLOSS_COMMIT=${FUSEDLOSS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
STAGES=(build ctest pytest pytest-tp pytest-lce pytest-jax properties sanitizer bench)
SLOW_FILES="test_vocab_parallel.py test_linear_cross_entropy.py"
OWN_PROCESS_FILES="test_jax.py"

stage_build() {
  BUILD_DIR=build-gpu launch/build.sh -DFUSEDLOSS_TESTS=ON -DFUSEDLOSS_BENCH=ON \
    -DFUSEDLOSS_PTXAS_REPORT=ON > "$LOGS/build.log" 2>&1 || { tail -50 "$LOGS/build.log"; return 1; }
  grep -E "Compiling entry|Used [0-9]+ registers|spill" "$LOGS/build.log" |
    sed 's/ptxas info *: //' > "$LOGS/ptxas_report.txt"
  echo "kernels: $(grep -c 'Compiling entry' "$LOGS/ptxas_report.txt"), with spills:" \
    "$(grep -c '[1-9][0-9]* bytes spill' "$LOGS/ptxas_report.txt")"
  FUSEDLOSS_OFFLINE=${FUSEDLOSS_OFFLINE:-1} launch/python.sh --collect-only -q \
    > "$LOGS/pytest-collect.log" 2>&1 || return 1
  tail -1 "$LOGS/pytest-collect.log"
}

stage_ctest() {
  ctest --test-dir build-gpu --output-on-failure --timeout 600 -j 6 > "$LOGS/ctest.log" 2>&1
  local rc=$?
  grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)" "$LOGS/ctest.log"
  echo "CUDA tests that ran: $(grep -c 'cuda .*Passed' "$LOGS/ctest.log") passed," \
    "skipped: $(grep -c 'cuda .*Skipped' "$LOGS/ctest.log")"
  return $rc
}

# pytest over the given files, one process per file at once (a crash in one file keeps the
# others' reports); a line per test in each file's log, a line per file in pytest-files.txt
pytest_files() {
  local pids=() rc=0 f
  for f in "$@"; do
    # each file bounded inside the stage's bound, so that a file cut off still gets its line
    (cd python/tests && XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 \
      timeout $((${STAGE_TIMEOUT:-480} - 40)) "$PY" -m pytest -v -rs -p no:cacheprovider "$f") \
      > "$LOGS/pytest-${f%.py}.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  for f in "$@"; do
    local log="$LOGS/pytest-${f%.py}.log" line
    line=$(grep -E "^=+ .*[0-9]+ (passed|failed|error|skipped).* in [0-9.]+s" "$log" | tail -1 | tr -d '=')
    echo "$f:${line:- no summary (crashed or cut off by the stage bound; last line: $(tail -1 "$log"))}" |
      tee -a "$OUT/pytest-files.txt"
  done
  grep -hE "^(FAILED|ERROR)|Fatal Python error" "$LOGS"/pytest-*.log | tail -25
  return $rc
}

stage_pytest() {
  local files=() f
  for f in python/tests/test_*.py; do
    f=$(basename "$f")
    case " $SLOW_FILES $OWN_PROCESS_FILES " in *" $f "*) continue ;; esac
    files+=("$f")
  done
  pytest_files "${files[@]}"
}

stage_pytest_tp() {
  pytest_files test_vocab_parallel.py
}

stage_pytest_lce() {
  pytest_files test_linear_cross_entropy.py
}

stage_pytest_jax() {
  # shellcheck disable=SC2086
  pytest_files $OWN_PROCESS_FILES
}

stage_properties() {
  nvidia-smi -L > /dev/null 2>&1 || { echo "no GPU: the CUDA property tests need one"; return 1; }
  (cd python/tests && FUSEDLOSS_PROPERTY_DEVICE=cuda FUSEDLOSS_PROPERTY_EXAMPLES=${PROPERTY_EXAMPLES:-300} \
    "$PY" -m pytest -q -p no:cacheprovider test_properties.py test_rms_norm.py -k "any_layout or property") \
    > "$LOGS/pytest-properties-cuda.log" 2>&1
  local rc=$?
  tail -3 "$LOGS/pytest-properties-cuda.log"
  return $rc
}

stage_sanitizer() {
  local rc=0 tool
  for tool in memcheck racecheck; do
    echo "compute-sanitizer $tool (${SANITIZER_FILTER:-*/cuda})"
    timeout "${SANITIZER_TIMEOUT:-270}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
      build-gpu/tests/test_single_gpu --gtest_filter="${SANITIZER_FILTER:-*/cuda}" \
      > "$LOGS/sanitizer_$tool.log" 2>&1 || rc=1
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|tests ran|PASSED|FAILED" "$LOGS/sanitizer_$tool.log" | head -5
  done
  return $rc
}

# Benchmarks while nothing else runs on the GPU; the CSVs and plots land in $OUT itself.
stage_bench() {
  local rc=0 kind extra
  for kind in ${BENCH_KINDS:-cross-entropy swiglu rms-norm linear-cross-entropy log-probs distillation}; do
    echo "benchmark $kind"
    extra=()
    [ "$kind" = linear-cross-entropy ] && extra=(--variants "${LCE_VARIANTS:-default}")
    PYTHONUNBUFFERED=1 timeout "${BENCH_TIMEOUT:-900}" "$PY" bench/run_bench.py "$kind" --build build-gpu \
      --out "$OUT" ${extra[@]+"${extra[@]}"} > "$LOGS/bench-$kind.log" 2>&1 || rc=1
    sed -n '/ on NVIDIA\| on .*copy bandwidth/,$p' "$LOGS/bench-$kind.log" | grep -v "^\[rank"
  done
  if [ -d build-swiglu-variants ]; then  # built ahead by bench/swiglu_variants.sh
    echo "SwiGLU kernel variants"
    local variants
    variants=$(ls build-swiglu-variants | sed -n 's/^swiglu_bench-\([0-9]*\)-\([0-9]*\)-\([0-9]*\)$/\1,\2,\3/p')
    bench/swiglu_variants.sh run "$variants" > "$OUT/swiglu-variants.csv" 2> "$LOGS/swiglu-variants.log" || rc=1
  fi
  # RMSNorm launch shapes: RMS_VARIANTS="default bwd_prefetch=0 ...", one variant a word
  # (bench/rms_norm_bench's arguments)
  if [ -n "${RMS_VARIANTS:-}" ]; then
    echo "RMSNorm kernel variants"
    # shellcheck disable=SC2086
    build-gpu/bench/rms_norm_bench $RMS_VARIANTS > "$OUT/rms-norm-variants.csv" \
      2> "$LOGS/rms-norm-variants.log" || rc=1
  fi
  return $rc
}

run_stage() {
  local stage=$1 start=$SECONDS rc
  STAGE_TIMEOUT=${STAGE_TIMEOUT:-480}
  LOGS="$OUT/$stage"
  mkdir -p "$LOGS"
  echo "== stage $stage"
  # a stage's own time bound: its processes are ended there, and the stage reports a timeout
  export -f "stage_${stage//-/_}" pytest_files
  export LOGS PY SLOW_FILES OWN_PROCESS_FILES OUT STAGE_TIMEOUT
  timeout --kill-after=20 "${STAGE_TIMEOUT:-480}" bash -c "stage_${stage//-/_}"
  rc=$?
  local what=passed
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && what="timed out after ${STAGE_TIMEOUT:-480} s"
  [ $rc -ne 0 ] && [ "$what" = passed ] && what="failed"
  (cd "$OUT" && tar czf "$stage.tar.gz" "$stage" && rm -rf "$stage")
  echo "stage $stage: $((SECONDS - start)) s, $what" | tee -a "$OUT/stage-times.txt"
  return $rc
}

[ $# -eq 0 ] && set -- "${STAGES[@]}"
for stage in "$@"; do
  declare -F "stage_${stage//-/_}" > /dev/null ||
    { echo "stage: got '$stage', expected some of: ${STAGES[*]}" >&2; exit 2; }
done
status=0
for stage in "$@"; do
  run_stage "$stage" || status=1
done
exit $status
