// The device error word: kernels record the first bad target they meet (any block may win,
// one report is enough); check_device_errors() reads and clears it.
#pragma once
#include <cstdint>

namespace fusedloss::cuda {

struct DeviceError {
  int flag;
  long long row;
  long long value;
};

// Defined here, so include this header from one translation unit only
// (cross_entropy_cuda.cu, which reports into it and reads it in check_device_errors): without
// relocatable device code, every .cu that included it would get a copy of its own.
__device__ DeviceError g_device_error = {0, 0, 0};

__device__ __forceinline__ void report_bad_target(int64_t row, int64_t value) {
  if (atomicCAS(&g_device_error.flag, 0, 1) == 0) {
    g_device_error.row = row;
    g_device_error.value = value;
  }
}

}  // namespace fusedloss::cuda
