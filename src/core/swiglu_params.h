// Validated SwiGLU arguments that the backends receive.
#pragma once
#include <cstdint>
#include "core/swiglu_math.h"
#include "fusedloss/swiglu.h"

namespace fusedloss::core {

struct SwigluArgs {
  int64_t rows = 0, n = 0;  // y is [rows, 2n]
  SwigluParams params{false, 0.0f};
  const void* bias = nullptr;   // [2n], y's dtype (the forward's y, or grad_y's in backward)
  const float* weights = nullptr;  // [rows]
  bool fp8_saturate = true;        // the e4m3 input copy: out-of-range values to +-448, or NaN
};

}  // namespace fusedloss::core
