#!/usr/bin/env bash
# On a GPU machine with megatron-core: the Llama-shaped end-to-end run
# (examples/megatron_llama_e2e.py: native, then each fusedloss patch in turn), first with tiny
# shapes and 3 steps (--smoke, into $OUT/smoke) to catch errors cheaply, then in full (about
# 10 minutes on an H200 altogether: the full run takes BUDGET_S, default 480 s; 300 s cut
# native's micro-batch search short). CSVs, a PNG and a text summary go to ${OUT:-gpu-out}.
# Exits non-zero when the smoke run or anything in the full run failed (a configuration, a task,
# a loss curve out of tolerance; in the full run also a task its time budget cut); the full run
# is not started after a failed smoke run. SMOKE_BUDGET_S / BUDGET_S bound the two runs (seconds); CONFIGS / TASKS
# narrow them (comma-separated, see --help); SKIP_SMOKE=1 skips the smoke run.
# TINY=1 also runs the tiny model's bf16 and fp32 loss-curve check
# (examples/megatron_gpt_patch.py, 50 steps, native vs CE+SwiGLU).
# Python: PYTHON, else the active environment, else python3 when it already has torch (GPU
# machines ship one), else .venv.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-gpu-out}
export PATH="$PATH:/usr/local/cuda/bin"
if [ -z "${PYTHON:-}${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ] && python3 -c "import torch" 2>/dev/null; then
  export PYTHON=python3
fi
source launch/cuda_archs.sh
source launch/python_env.sh
"$PY" -c "import fusedloss" 2>/dev/null || "$PY" -m pip install -q --no-build-isolation --no-deps . || exit 1
export FUSEDLOSS_COMMIT=${FUSEDLOSS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || true)}
export PYTHONUNBUFFERED=1
select=()
[ -n "${CONFIGS:-}" ] && select+=(--configs "$CONFIGS")
[ -n "${TASKS:-}" ] && select+=(--tasks "$TASKS")

if [ "${SKIP_SMOKE:-0}" != 1 ]; then
  echo "== smoke (tiny shapes, 3 steps)"
  "$PY" examples/megatron_llama_e2e.py --smoke --out "$OUT/smoke" --budget-s "${SMOKE_BUDGET_S:-100}" \
    "${select[@]}" || { echo "== smoke run failed: the full run is not started"; exit 1; }
fi
status=0
echo "== full (Llama shape)"
"$PY" examples/megatron_llama_e2e.py --out "$OUT" --budget-s "${BUDGET_S:-480}" "${select[@]}" || status=1
if [ "${TINY:-0}" = 1 ]; then
  for dtype in bf16 fp32; do
    echo "== tiny model, $dtype"
    "$PY" examples/megatron_gpt_patch.py --steps "${STEPS:-50}" --dtype "$dtype" --out "$OUT" || status=1
  done
fi
echo "== $([ $status = 0 ] && echo "all passed" || echo "FAILED (see the summary above)")"
exit $status
