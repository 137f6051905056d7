// Programmatic dependent launch (sm_90): a small kernel that only finishes what the kernel
// before it on the stream computed (a column sum over its partial rows) is launched while that
// kernel still runs, so its launch and block scheduling overlap the first kernel's tail instead
// of following it. Correctness does not depend on it: the dependent kernel's first statement,
// wait_for_preceding_grid(), returns only once the preceding grid has completed and its memory
// writes are visible, exactly as with an ordinary launch. On older chips, and when the
// dependent is launched without the attribute, both device functions are no-ops.
#pragma once
#include <cuda_runtime.h>

#include <utility>

#include "cuda/cuda_check.h"

namespace fusedloss::cuda {

// In the preceding kernel: its dependents may be launched once every block of this grid has
// called it or exited (so waiting dependents never keep one of its blocks from starting).
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// In the dependent kernel, before it reads anything the preceding kernel wrote.
__device__ __forceinline__ void wait_for_preceding_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// kernel<<<grid, block, 0, stream>>>(args...), with the programmatic-serialisation attribute
// when `overlap`: the kernel must start with wait_for_preceding_grid(), and the code the device
// runs must have been compiled for sm_90 or later (else that wait is compiled out; the caller
// checks built_for_sm90(), runtime.h).
template <class... Params, class... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                      bool overlap, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = overlap ? 1 : 0;
  FL_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace fusedloss::cuda
