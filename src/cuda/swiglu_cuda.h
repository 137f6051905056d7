// CUDA backend of SwiGLU: the same entry points as src/cpu/swiglu_cpu.h, on a stream.
#pragma once
#include "core/swiglu_params.h"
#include "cuda/runtime.h"

namespace fusedloss::cuda {

void swiglu_forward(const core::GateUpViews& in, const core::SwigluParams& p, const MatrixView& out,
                    const core::GateUpViews& in_fp8, Stream stream);
void swiglu_backward(const MatrixView& grad_out, const core::GateUpViews& in,
                     const core::SwigluParams& p, const core::GateUpViews& grad, float* grad_weights,
                     float* grad_bias, Stream stream);

}  // namespace fusedloss::cuda
