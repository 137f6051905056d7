// CPU reference backend: the same math as the kernels, one row per OpenMP iteration.
// Arguments arrive validated (src/api); targets were range-checked before any write.
#pragma once
#include "core/ce_params.h"
#include "fusedloss/cross_entropy.h"  // CrossEntropyOutputs

namespace fusedloss::cpu {

void ce_local_stats(const MatrixView& logits, const IndexView& target, const core::CeParams& p,
                    RowStats* stats);
void ce_prepare_sum(const RowStats* local, const float* global_max, const IndexView& target,
                    const core::CeParams& p, int rank, RowStats* summable);
// row_scratch: p.rows floats for the per-row losses of a Sum / Mean (null: allocated here).
void ce_merge(const RowStats* combined, int parts, const RowStats* local, const IndexView& target,
              const core::CeParams& p, const CrossEntropyOutputs& out,
              float* row_scratch = nullptr);
// The reduction of per-row losses (Sum / Mean into out.loss[0]) and the non-ignored count
// (into out.valid_count when not null). row_losses may be null: the count alone.
void ce_reduce(const float* row_losses, const IndexView& target, const core::CeParams& p,
               const CrossEntropyOutputs& out);
void ce_backward(const MatrixView& logits, const IndexView& target, const float* lse,
                 const float* grad_loss, const float* valid_count, const core::CeParams& p,
                 const MatrixView& grad);
// First row whose target is neither ignore_index nor in [0, V_global); -1 if none.
// grad *= grad_loss[0], in place; nothing when it is exactly 1.
void ce_scale_grad(const MatrixView& grad, const float* grad_loss);
int64_t first_bad_target(const IndexView& target, const core::CeParams& p, int64_t* value);

}  // namespace fusedloss::cpu
