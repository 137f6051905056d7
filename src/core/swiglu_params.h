// Validated SwiGLU parameters that the backends receive.
#pragma once
#include <cstdint>
#include "core/swiglu_math.h"
#include "fusedloss/types.h"

namespace fusedloss::core {

// (Named like core::CeParams: the options resolved against the views' shapes.)
struct SwigluParams {
  int64_t rows = 0, n = 0;  // y is [rows, 2n]
  SwigluClamp clamp{false, 0.0f};
  const void* bias = nullptr;  // [2n], y's dtype (the forward's y, or grad_y's in backward)
  const float* weights = nullptr;  // [rows]
  bool fp8_saturate = true;        // the e4m3 input copy: out-of-range values to +-448, or NaN
};

}  // namespace fusedloss::core
