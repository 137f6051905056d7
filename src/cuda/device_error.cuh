// The device error word: kernels record the first error they meet (any block may win, one
// report is enough), what it is in `flag`; check_device_errors() reads and clears it.
#pragma once
#include <cstdint>

namespace fusedloss::cuda {

struct DeviceError {
  int flag;  // 0: none, else a DeviceErrorKind
  long long row;
  long long value;
};

enum DeviceErrorKind : int {
  kBadTarget = 1,           // row: the row, value: its target
  kNotRowWeighted = 2,      // row: the row, value: the bits of grad_loss[row] (low word) and
                            // row_weight[row] (high word)
};

// Defined here, so include this header from one translation unit only
// (cross_entropy_cuda.cu, which reports into it and reads it in check_device_errors): without
// relocatable device code, every .cu that included it would get a copy of its own.
__device__ DeviceError g_device_error = {0, 0, 0};

__device__ __forceinline__ void report_device_error(DeviceErrorKind kind, int64_t row,
                                                    int64_t value) {
  if (atomicCAS(&g_device_error.flag, 0, int(kind)) == 0) {
    g_device_error.row = row;
    g_device_error.value = value;
  }
}

__device__ __forceinline__ void report_bad_target(int64_t row, int64_t value) {
  report_device_error(kBadTarget, row, value);
}

}  // namespace fusedloss::cuda
