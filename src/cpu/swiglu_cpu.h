// CPU reference backend of SwiGLU. Arguments arrive validated (src/api/swiglu.cpp); the fused
// [T, 2n] layout arrives as the pair of its halves (core::halves).
#pragma once
#include "core/swiglu_params.h"

namespace fusedloss::cpu {

void swiglu_forward(const core::GateUpViews& in, const core::SwigluParams& p, const MatrixView& out,
                    const core::GateUpViews& in_fp8);
void swiglu_backward(const MatrixView& grad_out, const core::GateUpViews& in,
                     const core::SwigluParams& p, const core::GateUpViews& grad, float* grad_weights,
                     float* grad_bias);

}  // namespace fusedloss::cpu
