// CUDA backend of RMSNorm: the same entry points as src/cpu/rms_norm_cpu.h, on a stream.
#pragma once
#include <cstddef>
#include "core/rms_norm_math.h"
#include "cuda/runtime.h"

namespace fusedloss::cuda {

size_t rms_norm_workspace_bytes(int64_t rows, int64_t hidden);
void rms_norm_forward(const MatrixView& x, const core::RmsNormParams& p, const MatrixView& y,
                      float* rstd, const MatrixView& residual, const MatrixView& residual_out,
                      Stream stream);
// workspace: nullptr (allocated stream-ordered here) or rms_norm_workspace_bytes() bytes.
// grad_residual_out: rows == 0 when absent.
void rms_norm_backward(const MatrixView& grad_y, const MatrixView& x_or_s,
                       const core::RmsNormParams& p, const float* rstd, const MatrixView& grad_x,
                       float* grad_weight, void* workspace, const MatrixView& grad_residual_out,
                       Stream stream);

}  // namespace fusedloss::cuda
