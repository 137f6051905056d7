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
  float gate_multiplier = 1.0f;    // Falcon-H1's: the gate times this before the activation
  float down_multiplier = 1.0f;    // and the output (every gradient with it) times this
};

// The two operands as the backends read them: gate and up [rows, n], each with its own row
// stride (the fused layout: gate = y's columns [0, n), up = [n, 2n)). The same pair describes
// the gradient the backward writes and the e4m3 copy (data == nullptr: absent).
struct GateUpViews {
  MatrixView gate, up;
};

// A [rows, 2n] view as the pair of its halves.
inline GateUpViews halves(const MatrixView& y) {
  const int64_t n = y.cols / 2;
  MatrixView gate = y, up = y;
  gate.cols = up.cols = n;
  if (y.data)
    up.data = static_cast<char*>(y.data) + n * (y.dtype == DType::FP8_E4M3 ? 1
                                                : y.dtype == DType::F32   ? 4
                                                                          : 2);
  return {gate, up};
}

}  // namespace fusedloss::core
