// CPU reference backend of RMSNorm. Arguments arrive validated (src/api/rms_norm.cpp).
#pragma once
#include "core/rms_norm_math.h"

namespace fusedloss::cpu {

void rms_norm_forward(const MatrixView& x, const core::RmsNormParams& p, const MatrixView& y,
                      float* rstd, const MatrixView& residual, const MatrixView& residual_out);
// grad_residual_out: rows == 0 when absent.
void rms_norm_backward(const MatrixView& grad_y, const MatrixView& x_or_s,
                       const core::RmsNormParams& p, const float* rstd, const MatrixView& grad_x,
                       void* grad_weight, DType grad_weight_dtype,
                       const MatrixView& grad_residual_out);

}  // namespace fusedloss::cpu
