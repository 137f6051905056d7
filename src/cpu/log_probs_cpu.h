// CPU reference backend of the log-prob head (core/log_probs_math.h), one row per OpenMP
// iteration. Arguments arrive validated (src/api).
#pragma once
#include "fusedloss/linear_log_probs.h"

namespace fusedloss::cpu {

// This shard's statistics of each row of a chunk's logits z (columns: global ids from
// vocab_start), at inv_t = 1 / temperature.
void lp_local_stats(const MatrixView& logits, const IndexView& tokens, float inv_t,
                    int64_t vocab_start, LogProbStats* stats);

// stats [world, rows] -> out. A token neither ignore_index nor in [0, vocab_global) gives NaN.
void lp_merge(const LogProbStats* stats, int world, int64_t rows, const IndexView& tokens,
              const LinearLogProbsOptions& o, const LinearLogProbsOutputs& out);

// In place: a chunk's logits -> the gradient over them (lse, entropy and the upstream gradients
// g, e of the chunk's rows; entropy, g and e may be null: 0).
void lp_gradient(const MatrixView& logits, const IndexView& tokens, const float* lse,
                 const float* entropy, const float* g, const float* e, float inv_t,
                 int64_t vocab_start, int64_t ignore_index);

}  // namespace fusedloss::cpu
