#!/usr/bin/env bash
# On a GPU machine with megatron-core: a tiny GPTModel trained 50 steps with and without the
# fusedloss patch (examples/megatron_gpt_patch.py), in bf16 (speed, memory, loss within bf16
# tolerance) and in fp32 (curves held to 1e-3 relative); CSVs to ${OUT:-gpu-out}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
source launch/cuda_archs.sh
source launch/python_env.sh
"$PY" -c "import fusedloss" 2>/dev/null || "$PY" -m pip install -q --no-build-isolation --no-deps .
status=0
for dtype in bf16 fp32; do
  echo "== $dtype"
  PYTHONUNBUFFERED=1 "$PY" examples/megatron_gpt_patch.py --steps "${STEPS:-50}" --dtype "$dtype" \
    --out "$OUT" || status=1
done
exit $status
