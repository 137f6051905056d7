// CUDA backend of SwiGLU: the same entry points as src/cpu/swiglu_cpu.h, on a stream.
#pragma once
#include "core/swiglu_params.h"
#include "cuda/runtime.h"

namespace fusedloss::cuda {

void swiglu_forward(const MatrixView& y, const core::SwigluParams& p, const MatrixView& out,
                    const MatrixView& y_fp8, Stream stream);
void swiglu_backward(const MatrixView& grad_out, const MatrixView& y, const core::SwigluParams& p,
                     const MatrixView& grad_y, float* grad_weights, float* grad_bias,
                     Stream stream);

}  // namespace fusedloss::cuda
