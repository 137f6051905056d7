// CPU backend of the linear distillation loss's row math (core/distill_math.h), one row per
// OpenMP iteration. Arguments arrive validated (src/api/linear_distillation.cpp). A chunk's rows:
// the student's logits xs and the teacher's xt ([rows, V_local] each, as the GEMMs wrote them),
// the rows' targets (data null: none; global ids), this shard's first global column.
#pragma once
#include "core/distill_math.h"

namespace fusedloss::cpu {

// Pass 1 over this shard's columns -> the rows' partial statistics.
void distill_partials(const MatrixView& xs, const MatrixView& xt, const IndexView& target,
                      int64_t vocab_start, const core::DistillParams& p,
                      core::DistillPartial* partials);

// world shards' partials ([world, rows], shard-major) -> each row's stats and loss (jsd: the
// hard-label part only; distill_add_jsd adds the soft term). Ignored rows: zeros.
void distill_merge(const core::DistillPartial* partials, int world, int64_t rows,
                   const IndexView& target, int64_t ignore_index, const core::DistillParams& p,
                   DistillRowStats* stats, float* loss);

// jsd's pass 2 over this shard's columns with the rows' merged stats -> sums [rows, 2]
// (soft, soft_student) of this shard.
void distill_jsd_sums(const MatrixView& xs, const MatrixView& xt, const core::DistillParams& p,
                      const DistillRowStats* stats, float* sums);

// Every shard's jsd sums added ([rows, 2]) -> stats.soft, stats.soft_student, and the loss's
// soft term. Ignored rows stay zero.
void distill_add_jsd(const float* sums, int64_t rows, const IndexView& target,
                     int64_t ignore_index, const core::DistillParams& p, DistillRowStats* stats,
                     float* loss);

// One shard's whole forward of a chunk (vocab_start 0, world 1): pass 1, the row stats and
// losses, and jsd's pass 2.
void distill_rows(const MatrixView& xs, const MatrixView& xt, const IndexView& target,
                  int64_t ignore_index, const core::DistillParams& p, float* loss,
                  DistillRowStats* stats);

// In place: the student's logits xs -> the gradient over them, for the rows' upstream grad_loss
// (null: 1 for every row).
void distill_gradient(const MatrixView& xs, const MatrixView& xt, const IndexView& target,
                      int64_t vocab_start, int64_t ignore_index, const core::DistillParams& p,
                      const DistillRowStats* stats, const float* grad_loss);

}  // namespace fusedloss::cpu
