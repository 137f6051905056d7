// The RMSNorm math, once, for every backend (see include/fusedloss/rms_norm.h).
#pragma once
#include <cmath>
#include <cstdint>
#include "core/platform.h"
#include "fusedloss/types.h"

namespace fusedloss::core {

// The validated call, as the backends receive it.
struct RmsNormParams {
  int64_t rows = 0, hidden = 0;
  float eps = 1e-5f;
  bool zero_centered_gamma = false;
  // [hidden] in weight_dtype: x's dtype, fp32, or bf16/fp16 with an fp32 x. Only the load
  // differs; the math is fp32.
  const void* weight = nullptr;
  DType weight_dtype = DType::F32;
};

// The scale a stored weight stands for: the weight itself, or 1 + weight when zero-centred.
FL_HD float rms_gamma(float stored, bool zero_centered) {
  return zero_centered ? stored + 1.0f : stored;
}

// 1 / sqrt(mean of squares + eps) from a row's sum of squares. eps > 0 (validated): a row of
// zeros gives 1/sqrt(eps), finite.
FL_HD float rms_rstd(float sum_sq, int64_t hidden, float eps) {
  const float mean_sq = sum_sq / float(hidden);
#ifdef __CUDA_ARCH__
  return rsqrtf(mean_sq + eps);
#else
  return 1.0f / std::sqrt(mean_sq + eps);
#endif
}

FL_HD float rms_y(float s, float rstd, float gamma) { return s * rstd * gamma; }

// The backward's per-row coefficient c = mean_j(dy_j gamma_j xhat_j), from the row's sum.
FL_HD float rms_dot_mean(float sum_dy_gamma_xhat, int64_t hidden) {
  return sum_dy_gamma_xhat / float(hidden);
}

// d(loss)/d(s) of one element, from its xhat = s * rstd, its dy and gamma, and the row's c.
FL_HD float rms_grad_s(float xhat, float dy, float gamma, float rstd, float c) {
  return rstd * (dy * gamma - xhat * c);
}

}  // namespace fusedloss::core
