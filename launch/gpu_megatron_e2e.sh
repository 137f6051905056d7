#!/usr/bin/env bash
# On a GPU machine with megatron-core: a tiny GPTModel trained 50 steps with and without the
# fusedloss patch (examples/megatron_gpt_patch.py); CSV to ${OUT:-gpu-out}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
source launch/cuda_archs.sh
python3 -c "import fusedloss" 2>/dev/null || python3 -m pip install -q --no-build-isolation --no-deps .
PYTHONUNBUFFERED=1 python3 examples/megatron_gpt_patch.py --steps "${STEPS:-50}" --out "$OUT"
