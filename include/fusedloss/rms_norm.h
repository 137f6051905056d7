// fusedloss: RMSNorm over the last dimension of [T, H] rows, forward and backward.
//
//   forward   s = x (+ residual)                      (the fused residual add, optional)
//             rstd = 1 / sqrt(mean_j(s_j^2) + eps)    per row, fp32, saved for the backward
//             y = s * rstd * gamma                    gamma = weight, or 1 + weight when
//                                                     zero_centered_gamma (the weight stores g - 1)
//   backward  xhat = s * rstd,  c = mean_j(dy_j * gamma_j * xhat_j)
//             grad_s = rstd * (dy * gamma - xhat * c)  (+ grad_residual_out, when given)
//             grad_weight = sum over rows of dy * xhat  (fp32 sums in a fixed order: the
//                                                       same bits on every call; rounded
//                                                       once into grad_weight's dtype)
//
// All math is fp32 whatever the storage dtype; every output is rounded once. Each row is
// independent, so a row of zeros gives y = 0 and grad_s = rstd * dy * gamma (finite: eps > 0).
// With the fused residual the gradient reaching s is the gradient of both x and residual.
//
// Views: every matrix is [T, H] with its own row stride (MatrixView: columns contiguous,
// row_stride >= H); vectors are contiguous. All views of one call live on one device (CPU or
// CUDA); on CUDA the work runs on `stream` (nullptr: the legacy default stream) and nothing
// synchronises the host.
#pragma once
#include <cstddef>
#include <cstdint>
#include "fusedloss/types.h"

namespace fusedloss {

struct RmsNormOptions {
  float eps = 1e-5f;                 // > 0 and finite
  bool zero_centered_gamma = false;  // gamma = 1 + weight (Megatron's layernorm_zero_centered_gamma)
};

// Checks the options alone (no views, no data): the same checks and messages the entry points
// run first. Throws Error.
void validate_rms_norm_options(const RmsNormOptions& options);

// Whether the kernels read a weight of dtype `weight` with x of dtype `x` as it is: x's own dtype
// or fp32, and bf16 or fp16 with fp32 x. The adapters hand any other float weight over in fp32.
inline bool rms_norm_reads_weight_as_is(DType x, DType weight) {
  return weight == x || weight == DType::F32 ||
         (x == DType::F32 && (weight == DType::BF16 || weight == DType::F16));
}

// x             [T, H] fp32, fp16 or bf16, any row stride. T may be 0.
// weight        [H] contiguous, a dtype rms_norm_reads_weight_as_is takes with x's.
// y             [T, H] of x's dtype, any row stride; must not overlap any input or output.
// rstd          [T] fp32 (device memory on CUDA), receives 1 / sqrt(mean(s^2) + eps).
// residual      absent (data == nullptr) or [T, H] of x's dtype: s = x + residual is normalised.
// residual_out  [T, H] of x's dtype receiving s, required iff residual is given (the backward
//               reads it as its x_or_s); must not overlap x, residual or y.
// Throws Error for a bad argument, naming it, the value and what was expected.
void rms_norm_forward(const MatrixView& x, const VectorView& weight, const RmsNormOptions& options,
                      const MatrixView& y, float* rstd, const MatrixView& residual = {},
                      const MatrixView& residual_out = {}, Stream stream = nullptr);

// Bytes of the backward's scratch memory (the weight gradient's fp32 partial sums, one row of
// H per block of the fixed grid: the size does not grow with T) for `rows` rows of `hidden`
// columns on `device` (CUDA: the current device). 0 on the CPU.
size_t rms_norm_backward_workspace_bytes(int64_t rows, int64_t hidden, Device device);

// grad_y             [T, H], x_or_s's dtype, any row stride: the gradient of y.
// x_or_s             [T, H] fp32/fp16/bf16: the forward's x, or its residual_out (s) with the
//                    fused residual.
// weight             [H], as in the forward.
// rstd               [T] fp32: the forward's.
// grad_x             [T, H] of x_or_s's dtype, any row stride: receives the gradient of s (of x
//                    and of residual, with the fused residual). It may be grad_y, x_or_s or
//                    grad_residual_out itself (the same view: in place); otherwise it must not
//                    overlap any input.
// grad_weight        [H] of grad_weight_dtype (fp32, fp16 or bf16; the overload without it:
//                    fp32), contiguous, receives sum_rows(dy * xhat) summed in fp32 and rounded
//                    once (also with zero-centred gamma, whose gamma - weight is a constant):
//                    a 16-bit weight's gradient needs no conversion pass. Zeros when T == 0.
// workspace          absent (nullptr: allocated and freed stream-ordered inside), or a buffer
//                    of rms_norm_backward_workspace_bytes(T, H, device) bytes on the views'
//                    device, 16-byte aligned, not overlapping any other buffer of the call
//                    (refused, naming both); its contents on entry do not matter.
// grad_residual_out  absent or [T, H] of x_or_s's dtype: the gradient reaching residual_out in
//                    the forward, added into grad_x (one pass instead of two).
void rms_norm_backward(const MatrixView& grad_y, const MatrixView& x_or_s, const VectorView& weight,
                       const float* rstd, const RmsNormOptions& options, const MatrixView& grad_x,
                       void* grad_weight, DType grad_weight_dtype, void* workspace = nullptr,
                       const MatrixView& grad_residual_out = {}, Stream stream = nullptr);
void rms_norm_backward(const MatrixView& grad_y, const MatrixView& x_or_s, const VectorView& weight,
                       const float* rstd, const RmsNormOptions& options, const MatrixView& grad_x,
                       float* grad_weight, void* workspace = nullptr,
                       const MatrixView& grad_residual_out = {}, Stream stream = nullptr);

}  // namespace fusedloss
