// fusedloss: the log-prob head for RL post-training: per token, from hidden states and the LM
// head's weight, without the [N, V] logits,
//
//   y          = hidden @ weight^T / temperature        (one token chunk at a time)
//   log_prob   = log_softmax(y)[token]
//   entropy    = -sum_j p_j log p_j,  p = softmax(y)
//   argmax     = the smallest id of the largest y
//
// and their gradients for any upstream gradients of log_prob and entropy (a PPO / GRPO loss
// differentiates both). The chunked GEMM pipeline is the linear cross-entropy's
// (linear_cross_entropy.h): the forward runs 1 GEMM a chunk and keeps lse and entropy (8 B a
// row); the backward recomputes each chunk's logits (the upstream gradients of a clipped-ratio
// loss are known only after the forward): 4 GEMMs in all.
//
// Vocab-parallel: weight is this rank's vocabulary shard. linear_log_probs_local_stats gives this
// shard's LogProbStats of every row; all-gather them across the group (24 B a row),
// log_probs_merge gives every rank the same results. linear_log_probs_forward does the three
// with a Communicator. The backward needs no communication: dhidden is this rank's partial sum
// (the caller all-reduces it, or reduce-scatters it along tokens), dweight this rank's shard.
#pragma once
#include <cstddef>
#include <cstdint>
#include "fusedloss/communicator.h"
#include "fusedloss/linear_cross_entropy.h"  // LinearCrossEntropyGrads
#include "fusedloss/types.h"

namespace fusedloss {

struct LinearLogProbsOptions {
  float temperature = 1.0f;      // > 0, finite
  int64_t ignore_index = -100;   // rows whose token is this: log_prob = entropy = 0, no gradient
  int64_t vocab_start = 0;       // this shard's first global column
  int64_t vocab_global = 0;      // the whole vocabulary (0: V_local, one rank)
  size_t workspace_bytes = size_t(256) << 20;  // as LinearCrossEntropyOptions::workspace_bytes
  int64_t chunk_rows = 0;        // as LinearCrossEntropyOptions::chunk_rows
  bool allow_tf32 = false;       // fp32 inputs only: TF32 GEMMs
};

// One shard's statistics of one row (core/log_probs_math.h): over its columns j,
// max = max y_j, sum_exp = sum exp(y_j - max), sum_exp_shifted = sum exp(y_j - max) (y_j - max),
// target = y of the row's token if this shard holds it (else -inf), argmax = the global id of
// the shard's largest y (the smallest such).
struct LogProbStats {
  float max;
  float sum_exp;
  float sum_exp_shifted;
  float target;
  int64_t argmax;
};

// Per-row results, in the inputs' memory space; any but lse may be null. lse and entropy are
// what the backward reads.
struct LinearLogProbsOutputs {
  float* log_probs = nullptr;  // [N]
  float* entropy = nullptr;    // [N]
  int64_t* argmax = nullptr;   // [N], global ids
  float* lse = nullptr;        // [N]: log-sum-exp of y over the whole vocabulary
};

// Checks the options against the shapes (N rows, V_local, H); throws Error as the calls do.
void validate_linear_log_probs_options(const LinearLogProbsOptions& options, int64_t rows,
                                       int64_t vocab_local, int64_t hidden);

// hidden [N, H] and weight [V_local, H] (fp32/fp16/bf16, one dtype, columns contiguous, CPU or
// CUDA), tokens [N] int32/int64 global ids (or ignore_index). Writes stats [N] (this shard's).
// scratch: optional, at least linear_log_probs_local_stats_scratch_bytes (null: allocated).
void linear_log_probs_local_stats(const MatrixView& hidden, const MatrixView& weight,
                                  const IndexView& tokens, const LinearLogProbsOptions& options,
                                  LogProbStats* stats, Stream stream = nullptr,
                                  void* scratch = nullptr, size_t scratch_bytes = 0);
size_t linear_log_probs_local_stats_scratch_bytes(const MatrixView& hidden,
                                                  const MatrixView& weight,
                                                  const LinearLogProbsOptions& options);

// stats [world, N] (every shard's, in rank order) -> outputs; on `device` (where stats live).
void log_probs_merge(const LogProbStats* stats, int world, int64_t rows, const IndexView& tokens,
                     const LinearLogProbsOptions& options, const LinearLogProbsOutputs& out,
                     Device device, Stream stream = nullptr);

// local_stats, then (comm of size > 1) an all-gather of the stats through comm, then the merge.
void linear_log_probs_forward(const MatrixView& hidden, const MatrixView& weight,
                              const IndexView& tokens, const LinearLogProbsOptions& options,
                              const LinearLogProbsOutputs& out, Communicator* comm = nullptr,
                              Stream stream = nullptr);

// The gradients of sum_i grad_log_probs[i] log_prob_i + grad_entropy[i] entropy_i (either may be
// null: 0), from the forward's lse and entropy (entropy may be null when grad_entropy is).
// grads.dhidden [N, H] (at TP > 1 this rank's partial), grads.dweight [V_local, H] (= or +=
// with accumulate_dweight), each fp32 or the inputs' dtype.
void linear_log_probs_backward(const MatrixView& hidden, const MatrixView& weight,
                               const IndexView& tokens, const float* lse, const float* entropy,
                               const float* grad_log_probs, const float* grad_entropy,
                               const LinearLogProbsOptions& options,
                               const LinearCrossEntropyGrads& grads, Stream stream = nullptr);

}  // namespace fusedloss
