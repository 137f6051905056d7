// CPU backend of the linear cross-entropy: the chunk loop, its GEMMs through cpu/gemm_cpu.h
// (BLAS where the build found one; inputs as stored, one rounding into the output's dtype).
#pragma once
#include "core/linear_ce_plan.h"

namespace fusedloss::cpu {

// For each chunk: logits = hidden_c @ weight^T into a chunk buffer, steps.forward, then (when
// steps.gradient is set) steps.gradient, dhidden_c = G @ weight, dweight (+)= G^T @ hidden_c.
// `memory`: core::lce_loop_bytes(plan, Device::CPU), the chunk buffer and the GEMMs' stage.
void lce_run(const core::LcePlan& plan, const MatrixView& hidden, const MatrixView& weight,
             const core::LceSteps& steps, const core::LceGrads& grads, void* memory);

// logits[r, c] = bias[c] in the logits' dtype, the start the logits GEMM adds to (bias:
// logits.cols elements of the logits' dtype or fp32; core/lce_bias.h).
void lce_fill_bias(const MatrixView& logits, const VectorView& bias);

// acc[c] += the sum of column c of g over its rows, in fp32 (acc: g.cols floats).
void lce_add_column_sums(const MatrixView& g, float* acc);

// dst = scale[0] * src, or dst += scale[0] * src (same shape; dst may be src itself).
void lce_scale(const MatrixView& src, const MatrixView& dst, const float* scale, bool accumulate);

// The c with grad_loss == c * row_weight over n rows (core/row_weight.h); NaN when grad_loss
// has a non-finite entry (the gradients are then NaN, as a recomputed backward's would be).
// Throws Error naming the first row that does not fit.
float lce_row_weight_scale(const float* grad_loss, const float* row_weight, int64_t n);

}  // namespace fusedloss::cpu
