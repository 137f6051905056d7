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
  kBadToken = 3,            // the log-prob head's tokens: row: the row, value: its token
};

// The error word's address on the current device, for kernels of other translation units
// (cross_entropy_cuda.cu defines it; no host synchronisation).
DeviceError* device_error_word();

__device__ __forceinline__ void report_device_error(DeviceError* word, DeviceErrorKind kind,
                                                    int64_t row, int64_t value) {
  if (atomicCAS(&word->flag, 0, int(kind)) == 0) {
    word->row = row;
    word->value = value;
  }
}

#ifdef FUSEDLOSS_DEFINE_DEVICE_ERROR

// Defined in one translation unit only (cross_entropy_cuda.cu, which defines
// FUSEDLOSS_DEFINE_DEVICE_ERROR and reads it in check_device_errors): without relocatable device
// code, every .cu that defined it would get a copy of its own; the others report through
// device_error_word().
__device__ DeviceError g_device_error = {0, 0, 0};

__device__ __forceinline__ void report_device_error(DeviceErrorKind kind, int64_t row,
                                                    int64_t value) {
  report_device_error(&g_device_error, kind, row, value);
}

__device__ __forceinline__ void report_bad_target(int64_t row, int64_t value) {
  report_device_error(kBadTarget, row, value);
}
#endif  // FUSEDLOSS_DEFINE_DEVICE_ERROR

}  // namespace fusedloss::cuda
