// CUDA backend of the linear distillation loss's row math (core/distill_math.h): one block per
// row, the student's and the teacher's rows read side by side in 8-element units (16-byte loads
// of the chunk buffers: rows on 16-byte boundaries); on sm_90, with FUSEDLOSS_DISTILL_CLUSTERS=1,
// the forward's rows in a thread-block cluster each, held in shared memory between the passes. As the cpu:: functions of the same names
// (cpu/distill_cpu.h), enqueued on `stream`.
#pragma once
#include "core/distill_math.h"
#include "cuda/runtime.h"

namespace fusedloss::cuda {

void distill_rows(const MatrixView& xs, const MatrixView& xt, const IndexView& target,
                  int64_t ignore_index, const core::DistillParams& p, float* loss,
                  DistillRowStats* stats, Stream stream);
void distill_partials(const MatrixView& xs, const MatrixView& xt, const IndexView& target,
                      int64_t vocab_start, const core::DistillParams& p,
                      core::DistillPartial* partials, Stream stream);
void distill_merge(const core::DistillPartial* partials, int world, int64_t rows,
                   const IndexView& target, int64_t ignore_index, int64_t vocab_global,
                   const core::DistillParams& p, DistillRowStats* stats, float* loss,
                   Stream stream);
void distill_jsd_sums(const MatrixView& xs, const MatrixView& xt, const core::DistillParams& p,
                      const DistillRowStats* stats, float* sums, Stream stream);
void distill_add_jsd(const float* sums, int64_t rows, const IndexView& target,
                     int64_t ignore_index, const core::DistillParams& p, DistillRowStats* stats,
                     float* loss, Stream stream);
void distill_gradient(const MatrixView& xs, const MatrixView& xt, const IndexView& target,
                      int64_t vocab_start, int64_t ignore_index, const core::DistillParams& p,
                      const DistillRowStats* stats, const float* grad_loss, Stream stream);
// distill_rows, then distill_gradient of one shard (vocab_start 0) with those stats: in one
// kernel that reads each row pair once (a thread-block cluster a row: sm_90, opted into),
// else the two.
void distill_rows_and_gradient(const MatrixView& xs, const MatrixView& xt, const IndexView& target,
                               int64_t ignore_index, const core::DistillParams& p, float* loss,
                               DistillRowStats* stats, const float* grad_loss, Stream stream);

}  // namespace fusedloss::cuda
