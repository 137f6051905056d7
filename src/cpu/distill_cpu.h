// CPU backend of the linear distillation loss's row math (core/distill_math.h), one row per
// OpenMP iteration. Arguments arrive validated (src/api/linear_distillation.cpp).
#pragma once
#include "core/distill_math.h"

namespace fusedloss::cpu {

// A chunk's rows: the student's logits xs and the teacher's xt ([rows, V] each, as the GEMMs
// wrote them), the rows' targets (data null: none) -> loss and stats of each row.
void distill_forward(const MatrixView& xs, const MatrixView& xt, const IndexView& target,
                     int64_t ignore_index, const core::DistillParams& p, float* loss,
                     DistillRowStats* stats);

// In place: the student's logits xs -> the gradient over them, for the rows' upstream grad_loss.
void distill_gradient(const MatrixView& xs, const MatrixView& xt, const IndexView& target,
                      int64_t ignore_index, const core::DistillParams& p,
                      const DistillRowStats* stats, const float* grad_loss);

}  // namespace fusedloss::cpu
