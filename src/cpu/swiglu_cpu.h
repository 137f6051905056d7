// CPU reference backend of SwiGLU. Arguments arrive validated (src/api/swiglu.cpp).
#pragma once
#include "core/swiglu_params.h"

namespace fusedloss::cpu {

void swiglu_forward(const MatrixView& y, const core::SwigluParams& p, const MatrixView& out,
                    const MatrixView& y_fp8);
void swiglu_backward(const MatrixView& grad_out, const MatrixView& y, const core::SwigluParams& p,
                     const MatrixView& grad_y, float* grad_weights, float* grad_bias);

}  // namespace fusedloss::cpu
