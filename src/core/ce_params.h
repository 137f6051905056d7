// Validated, resolved cross-entropy parameters that the backends receive.
#pragma once
#include <cstdint>
#include "core/cross_entropy_math.h"
#include "fusedloss/cross_entropy.h"

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
};

// Resolves options against a shard of `vocab_local` columns; throws Error on bad options.
CeParams resolve_params(const CrossEntropyOptions& options, int64_t rows, int64_t vocab_local);

}  // namespace fusedloss::core
