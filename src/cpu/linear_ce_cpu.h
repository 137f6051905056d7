// CPU backend of the linear cross-entropy: the chunk loop with plain-loop GEMMs (fp32 inputs
// rounded as stored, double accumulation, one rounding into the output's dtype). For tests and
// small shapes: correctness, not speed.
#pragma once
#include "core/linear_ce_plan.h"

namespace fusedloss::cpu {

// For each chunk: logits = hidden_c @ weight^T into a chunk buffer, steps.forward, then (when
// steps.gradient is set) steps.gradient, dhidden_c = G @ weight, dweight (+)= G^T @ hidden_c.
// `memory`: core::lce_loop_bytes(plan, Device::CPU), the chunk buffer.
void lce_run(const core::LcePlan& plan, const MatrixView& hidden, const MatrixView& weight,
             const core::LceSteps& steps, const core::LceGrads& grads, void* memory);

// dst = scale[0] * src, or dst += scale[0] * src (same shape; dst may be src itself).
void lce_scale(const MatrixView& src, const MatrixView& dst, const float* scale, bool accumulate);

}  // namespace fusedloss::cpu
