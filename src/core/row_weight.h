// The in-forward backward of a row-weighted linear cross-entropy (Reduction::None with
// LinearCrossEntropyOutputs::row_weight): the forward computed the gradients of
// sum_i w_i * loss_i, so an upstream gradient g of the per-row losses that is c * w for one
// scalar c (Megatron's loss_func: c * sum(loss_mask * loss)) gives the true gradients scaled
// by c. Any other g has no such c: the backward reports it instead of a wrong gradient.
//
//   c = g_k / w_k for the first row k with w_k != 0 (0 when every weight is 0)
//   row i fits when c w_i is finite and |g_i - c w_i| <= 2^-20 |c w_i|
//
// (c w_i finite: a c that overflows, from a tiny first weight, would otherwise fit every row
// with inf and leave the gradients infinite without a report.)
//
// Exact for 0/1 weights (c = g_k, and c w_i is then the product autograd formed); for other
// weights c rounds once, a few units of fp32 rounding, well inside the tolerance.
#pragma once
#include <cmath>
#include "core/platform.h"

namespace fusedloss::core {

constexpr float kRowWeightTolerance = 1.0f / float(1 << 20);

// The end of the error for a row that does not fit (host and CUDA backends).
constexpr const char* kNotRowWeightedWhy =
    " for one scalar c: the in-forward gradients are those of sum(row_weight * loss), so the "
    "upstream gradient must be proportional to the row weights (e.g. Megatron's loss_mask, as "
    "its loss_func reduces); use the Recompute backward (Python: backward_mode=\"recompute\") "
    "for any other";

FL_HD float row_weight_scale(float g_first, float w_first) { return g_first / w_first; }

FL_HD bool fits_row_weight(float g, float w, float c) {
  const float cw = c * w;
  return fabsf(cw) <= 3.4028235e38f && fabsf(g - cw) <= kRowWeightTolerance * fabsf(cw);
}

}  // namespace fusedloss::core
