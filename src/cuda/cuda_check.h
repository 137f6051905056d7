// CUDA return-code checking: every runtime call goes through FL_CUDA_CHECK.
#pragma once
#include <cuda_runtime.h>
#include "common/error.h"

#define FL_CUDA_CHECK(call)                                                               \
  do {                                                                                    \
    cudaError_t fl_err_ = (call);                                                         \
    if (fl_err_ != cudaSuccess)                                                           \
      ::fusedloss::detail::fail(#call, " failed: ", cudaGetErrorName(fl_err_), ": ",      \
                                cudaGetErrorString(fl_err_), " (", __FILE__, ":", __LINE__, \
                                ")");                                                     \
  } while (0)

// After a kernel launch: launch-configuration errors surface here, without synchronising.
#define FL_CUDA_CHECK_LAUNCH() FL_CUDA_CHECK(cudaGetLastError())

namespace fusedloss::cuda {
inline cudaStream_t as_cuda(Stream s) { return static_cast<cudaStream_t>(s); }
}  // namespace fusedloss::cuda
