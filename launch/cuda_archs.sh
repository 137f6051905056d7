# Sourced by the launch scripts: FUSEDLOSS_CUDA_ARCHS defaults to the local GPU's compute
# capability (e.g. 90 on an H100/H200), or 90 where there is no GPU to ask.
if [ -z "${FUSEDLOSS_CUDA_ARCHS:-}" ]; then
  cap=$( (nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null || true) | head -n 1 | tr -d '. ')
  export FUSEDLOSS_CUDA_ARCHS=${cap:-90}
fi
