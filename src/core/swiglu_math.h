// The SwiGLU math, once, for every backend (see include/fusedloss/swiglu.h).
#pragma once
#include <cmath>
#include "core/platform.h"

namespace fusedloss::core {

// sigmoid(x) = 1 / (1 + e^-x). On the GPU through the special-function unit's exp2 and
// reciprocal (__expf, __fdividef: a few instructions where the IEEE expf and division take
// ~20, which left the SwiGLU kernels partly issue-bound). Relative error below 1e-6 for
// |x| < 10 and a few 1e-6 beyond, where the value is within 5e-5 of 0 or 1: far below bf16
// or fp16 rounding, and what Triton-compiled peers use too.
FL_HD float sigmoid(float x) {
#ifdef __CUDA_ARCH__
  return __fdividef(1.0f, 1.0f + __expf(-x));
#else
  return 1.0f / (1.0f + expf(-x));
#endif
}

// The clamped variant's settings (SwigluOptions' clamp fields, validated).
struct SwigluClamp {
  bool clamp;
  float clamp_value;
  bool gate_grad_at_bound;  // the gradient passes where gate == clamp_value
  bool up_grad_at_bound;    // the gradient passes where up == +-clamp_value
};

// Gate/up after the optional clamp, and whether each clamp let the gradient through.
struct GateUp {
  float a, b;
  bool a_live, b_live;
};

// gate_multiplier (Falcon-H1's) scales the gate before the clamp: the clamp bounds what the
// activation reads. A multiplier of 1 is exact (x * 1 == x).
FL_HD GateUp gate_up(float gate, float up, const SwigluClamp& k, float gate_multiplier = 1.0f) {
  gate *= gate_multiplier;
  if (!k.clamp) return GateUp{gate, up, true, true};
  const float c = k.clamp_value;
  // Strictly inside the bounds the gradient passes, beyond them it does not; exactly on a
  // bound it follows the framework's clamp, whose rule has changed between torch versions
  // (and differs between clamp(max=) and clamp(min=, max=)), so it is a setting.
  const bool gate_live = gate < c || (k.gate_grad_at_bound && gate == c);
  const bool up_live = (up > -c && up < c) || (k.up_grad_at_bound && (up == c || up == -c));
  // A NaN stays NaN, as torch.clamp keeps it (fminf / fmaxf would return the bound).
  return GateUp{gate != gate ? gate : fminf(gate, c), up != up ? up : fminf(fmaxf(up, -c), c),
                gate_live, up_live};
}

FL_HD float swiglu_value(const GateUp& v) { return v.a * sigmoid(v.a) * v.b; }

// d(out)/d(a), d(out)/d(b) scaled by g (the upstream gradient, already times w and the down
// multiplier); da through the gate multiplier too (a' = m a). Returns swiglu_value(v) from the
// same sigmoid, for the per-token weight's gradient.
FL_HD float swiglu_grad(const GateUp& v, float g, float& da, float& db,
                        float gate_multiplier = 1.0f) {
  float s = sigmoid(v.a);
  da = v.a_live ? g * s * (1.0f + v.a * (1.0f - s)) * v.b * gate_multiplier : 0.0f;
  db = v.b_live ? g * v.a * s : 0.0f;
  return v.a * s * v.b;
}

}  // namespace fusedloss::core
