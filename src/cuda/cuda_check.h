// CUDA return-code checking: every runtime call goes through FL_CUDA_CHECK.
#pragma once
#include <cuda_runtime.h>
#include "common/error.h"

#define FL_CUDA_CHECK(call)                                                           \
  do {                                                                                \
    cudaError_t fl_err_ = (call);                                                     \
    if (fl_err_ != cudaSuccess) ::fusedloss::cuda::throw_error(fl_err_, #call, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: launch-configuration errors surface here, without synchronising.
#define FL_CUDA_CHECK_LAUNCH() FL_CUDA_CHECK(cudaGetLastError())

namespace fusedloss::cuda {

// The one place a CUDA error becomes a message: "no usable CUDA device (reason)" as a
// NoUsableCudaDevice when no device can run this build (FL_DISPATCH adds the public function's
// name), else the failed call, the error's name and text, and the source line.
[[noreturn]] void throw_error(cudaError_t err, const char* call, const char* file, int line);

inline cudaStream_t as_cuda(Stream s) { return static_cast<cudaStream_t>(s); }
}  // namespace fusedloss::cuda
