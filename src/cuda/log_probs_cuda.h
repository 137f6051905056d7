// CUDA backend of the log-prob head (core/log_probs_math.h): one block per row, 16-byte loads
// of the chunk's logits (the chunk loop's buffers: rows on 16-byte boundaries).
#pragma once
#include "cuda/runtime.h"
#include "fusedloss/linear_log_probs.h"

namespace fusedloss::cuda {

// As the cpu:: functions of the same names (cpu/log_probs_cpu.h), enqueued on `stream`.
void lp_local_stats(const MatrixView& logits, const IndexView& tokens, float inv_t,
                    int64_t vocab_start, LogProbStats* stats, Stream stream);
void lp_merge(const LogProbStats* stats, int world, int64_t rows, const IndexView& tokens,
              const LinearLogProbsOptions& o, const LinearLogProbsOutputs& out, Stream stream);
void lp_gradient(const MatrixView& logits, const IndexView& tokens, const float* lse,
                 const float* entropy, const float* g, const float* e, float inv_t,
                 int64_t vocab_start, int64_t ignore_index, Stream stream);

}  // namespace fusedloss::cuda
