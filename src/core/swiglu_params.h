// Validated SwiGLU parameters that the backends receive.
#pragma once
#include <cstdint>
#include "core/swiglu_math.h"
#include "fusedloss/types.h"

namespace fusedloss::core {

// (Named like core::CeParams: the options resolved against the views' shapes.)
struct SwigluParams {
  int64_t rows = 0, n = 0;  // y is [rows, 2n]
  SwigluClamp clamp{false, 0.0f, false, false};
  // [2n]: fp32, or the value dtype (the forward's y, or grad_y's in backward) when bias_f32 is
  // false. The math is fp32 either way; only the load differs.
  const void* bias = nullptr;
  bool bias_f32 = false;
  const float* weights = nullptr;  // [rows]
  bool fp8_saturate = true;        // the e4m3 input copy: out-of-range values to +-448, or NaN
};

}  // namespace fusedloss::core
