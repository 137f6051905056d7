// Validated, resolved cross-entropy parameters that the backends receive.
#pragma once
#include <cstdint>
#include "core/cross_entropy_math.h"
#include "fusedloss/options.h"

namespace fusedloss {
struct CrossEntropyOptions;
}

namespace fusedloss::core {

struct CeParams {
  int64_t rows = 0;
  int64_t vocab_local = 0;
  int64_t vocab_start = 0;
  int64_t vocab_global = 0;
  int64_t ignore_index = -100;
  Smoothing smoothing{0.0f, 0.0f};
  bool partition_scope = false;
  bool need_sum_logits = false;  // label smoothing on
  float z_loss = 0.0f;
  Reduction reduction = Reduction::Mean;
  float softcap = 0.0f;  // > 0: the loss sees cap_logit(x, softcap)
};

// A merged row's lse and reported loss. `local_sum_logits` is this rank's own sum, which the
// partition smoothing scope averages instead of the merged one.
FL_HD void finish_row(const RowStats& merged, float local_sum_logits, TargetKind kind,
                      const CeParams& p, float& lse, float& loss) {
  const float log_s = logf(merged.sum_exp);
  lse = merged.max + log_s;
  float sx = p.partition_scope ? local_sum_logits : merged.sum_logits;
  loss = reported_loss(kind, merged.max, log_s, merged.target_logit, sx, p.smoothing, p.z_loss);
}

// This rank's own sum of logits for row r, which only the partition scope reads: `local` may be
// null under the global scope (the public merge documents it so).
FL_HD float own_sum_logits(const RowStats* local, int64_t r, const CeParams& p) {
  return p.partition_scope ? local[r].sum_logits : 0.0f;
}

// The upstream gradient of row r's loss: grad_loss[r] (Reduction::None) or grad_loss[0], over the
// valid count for Mean. grad_loss null stands for a unit upstream gradient: the gradient the
// forward writes for a sum/mean loss (cross_entropy_forward_with_grad), scaled later.
FL_HD float row_grad_scale(const CeParams& p, const float* grad_loss, const float* valid_count,
                           int64_t r) {
  const float g = grad_loss == nullptr ? 1.0f : grad_loss[p.reduction == Reduction::None ? r : 0];
  return p.reduction == Reduction::Mean ? g / fmaxf(valid_count[0], 1.0f) : g;
}

// Resolves options against `rows` rows and a shard of `vocab_local` columns; throws Error on
// bad options. Shape-only (no data pointers): the one implementation of the option checks,
// which every entry point and validate_cross_entropy_options run (src/core/ce_params.cpp).
CeParams resolve_params(const CrossEntropyOptions& options, int64_t rows, int64_t vocab_local);

}  // namespace fusedloss::core
