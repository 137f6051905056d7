// fusedloss: a distillation loss between a student's and a teacher's next-token distributions,
// from each model's last hidden states and LM-head weight, without the [N, V] logits of either:
//
//   s = student_hidden @ student_weight^T / T      q = softmax(s)   (the student)
//   t = teacher_hidden @ teacher_weight^T / T      p = softmax(t)   (the teacher)
//   forward_kl   KL(p || q) = sum_j p_j (log p_j - log q_j)
//   reverse_kl   KL(q || p) = sum_j q_j (log q_j - log p_j)
//   jsd          beta KL(p || m) + (1 - beta) KL(q || m),   m = beta p + (1 - beta) q
//   loss_i       = (1 - w) soft_i + w (lse(z_i) - z_i[target_i]),   z = the student's logits at
//                  T = 1, w = hard_label_weight (a hard-label cross-entropy mixed in)
//
// Rows whose target is ignore_index have loss 0 and no gradient. The student's gradients are
// those of sum_i grad_loss[i] loss_i; the teacher is a constant (no gradient). Per-row losses and
// per-row upstream gradients: the caller reduces (sum, or mean over the counted rows) and
// expands the reduction's gradient.
//
// The token-chunk pipeline is the linear cross-entropy's (linear_cross_entropy.h), with the
// teacher's logits of each chunk in a second buffer: the forward runs 2 GEMMs a chunk and keeps
// DistillRowStats (32 B a row); the backward recomputes both logits (2 GEMMs) and runs the
// student's dhidden and dweight GEMMs. A forward given gradient buffers (a caller that knows
// the upstream gradients already: a mean or a sum) runs those GEMMs in the same pass, 4 GEMMs
// in all and no backward. Memory: the student's chunk buffers, the teacher's one, and both
// GEMMs' workspaces, within workspace_bytes (the chunks are sized for all of them).
//
// Vocab-parallel (tensor-parallel size > 1): each rank holds the rows [vocab_start, vocab_start
// + V_local) of both weights. linear_distillation_local_partials gives this shard's
// DistillPartial (32 B a row: the online max / sum-exp of both distributions, the KL's cross
// term, the target's logit); one all-gather of them and distill_merge give every rank the same
// row stats and losses. jsd needs one more round over the logits (a second GEMM pass):
// linear_distillation_jsd_sums gives this shard's two sums a row (8 B), which add over the
// ranks (an all-reduce) into distill_add_jsd. The backward is local (this rank's dweight and
// its partial dhidden, which the caller reduces over the ranks).
#pragma once
#include <cstddef>
#include <cstdint>
#include "fusedloss/linear_cross_entropy.h"  // LinearCrossEntropyGrads
#include "fusedloss/types.h"

namespace fusedloss {

enum class Divergence : int { ForwardKL = 0, ReverseKL = 1, JSD = 2 };

struct LinearDistillationOptions {
  Divergence divergence = Divergence::ForwardKL;
  float beta = 0.5f;               // jsd's mixture weight, in (0, 1)
  float temperature = 1.0f;        // > 0, finite: divides both models' logits of the soft term
  float hard_label_weight = 0.0f;  // w in [0, 1]; > 0 needs targets
  int64_t ignore_index = -100;     // rows whose target is this count for nothing
  // As LinearCrossEntropyOptions::workspace_bytes, for the student's and the teacher's chunk
  // buffers and both GEMM workspaces together. 312 MiB: 512-token chunks of both logits at
  // V = 128256 and 151936 in bf16 (304 MiB gave 384 at 151936, 256 MiB 384 at both); each
  // chunk re-reads and rewrites the [V, H] dweight, so fewer, larger chunks are faster
  // (bench/NOTES.md).
  size_t workspace_bytes = size_t(312) << 20;
  int64_t chunk_rows = 0;          // as LinearCrossEntropyOptions::chunk_rows
  bool allow_tf32 = false;         // fp32 inputs only: TF32 GEMMs
  // Vocab-parallel: the shard's first global class and the whole vocabulary (0: V_local, one
  // shard). Targets are global class ids.
  int64_t vocab_start = 0;
  int64_t vocab_global = 0;
};

// What the backward reads of each row (written by the forward; zeros for an ignored row).
struct DistillRowStats {
  // Each log-sum-exp as its max and the log of its sum-exp, kept apart: a log-probability is
  // then (s_j - max) - log_sum, exact near the max, where one float lse = max + log_sum would
  // be off by up to half an ulp of the logits (8e-6 at 128): more than a peaked row's gradient.
  float max_student, log_sum_student;  // of s
  float max_teacher, log_sum_teacher;  // of t
  float max_hard, log_sum_hard;        // of the student's logits at T = 1 (hard_label_weight > 0)
  float soft;                          // the row's divergence
  float soft_student;                  // jsd: sum_j q_j log(q_j / m_j) (its gradient's row term)
};

// A shard's pass-1 statistics of one row (core/distill_math.h has the math): 32 bytes.
struct DistillPartial {
  float max_s, sum_s, max_t, sum_t, max_z, sum_z, cross, target;
};
constexpr size_t kDistillPartialBytes = sizeof(DistillPartial);

// Checks the options against the shapes (N rows, V_local = the weights' rows); throws Error as
// the calls do.
void validate_linear_distillation_options(const LinearDistillationOptions& options, int64_t rows,
                                          int64_t vocab_local, bool has_target);

// student_hidden [N, H_s] with student_weight [V, H_s] (one dtype: fp32/fp16/bf16), teacher_hidden
// [N, H_t] with teacher_weight [V, H_t] (one dtype, which may differ from the student's), columns
// contiguous; target [N] int32/int64 class ids or ignore_index, or none (data null: every row
// counts, hard_label_weight must be 0); each with the other inputs (host or one CUDA device).
// Writes loss [N] and stats [N]. One shard (vocab_global 0 or V_local).
//
// in_forward (optional; grads' data null: none): the student's gradients of sum_i grad_loss[i]
// loss_i for upstream gradients the caller knows before the forward (a sum: 1 each; a mean:
// 1 / counted rows, on the device), written as the backward writes them, in the same pass over
// the chunks: 4 GEMMs in all, and no backward. The caller scales them by the reduction's
// upstream gradient when it comes.
struct DistillInForward {
  LinearCrossEntropyGrads grads;      // dhidden [N, H_s], dweight [V, H_s] (dbias unused)
  const float* grad_loss = nullptr;   // [N] fp32 with the inputs; null: 1 for every row
};
void linear_distillation_forward(const MatrixView& student_hidden, const MatrixView& student_weight,
                                 const MatrixView& teacher_hidden, const MatrixView& teacher_weight,
                                 const IndexView& target, const LinearDistillationOptions& options,
                                 float* loss, DistillRowStats* stats, Stream stream = nullptr,
                                 const DistillInForward& in_forward = {});

// Vocab-parallel forward, in steps (the caller runs the collectives between them):
//   1. linear_distillation_local_partials: this shard's partials [N]
//   2. all-gather them into [world, N] (rank-major), then distill_merge -> stats [N], loss [N]
//   3. jsd only: linear_distillation_jsd_sums -> this shard's sums [N, 2]; all-reduce (sum)
//      them over the ranks; distill_add_jsd -> stats and loss complete.
void linear_distillation_local_partials(const MatrixView& student_hidden,
                                        const MatrixView& student_weight,
                                        const MatrixView& teacher_hidden,
                                        const MatrixView& teacher_weight, const IndexView& target,
                                        const LinearDistillationOptions& options,
                                        DistillPartial* partials, Stream stream = nullptr);
void distill_merge(const DistillPartial* partials, int world, int64_t rows, const IndexView& target,
                   const LinearDistillationOptions& options, DistillRowStats* stats, float* loss,
                   Device device, Stream stream = nullptr);
void linear_distillation_jsd_sums(const MatrixView& student_hidden,
                                  const MatrixView& student_weight,
                                  const MatrixView& teacher_hidden,
                                  const MatrixView& teacher_weight,
                                  const LinearDistillationOptions& options,
                                  const DistillRowStats* stats, float* sums,
                                  Stream stream = nullptr);
void distill_add_jsd(const float* sums, int64_t rows, const IndexView& target,
                     const LinearDistillationOptions& options, DistillRowStats* stats, float* loss,
                     Device device, Stream stream = nullptr);

// The student's gradients of sum_i grad_loss[i] loss_i from the forward's stats (merged over the
// shards): grads.dhidden [N, H_s] (at TP > 1 this rank's partial sum) and grads.dweight
// [V_local, H_s] (= or += with accumulate_dweight), each fp32 or the student's dtype;
// grads.dbias unused.
void linear_distillation_backward(const MatrixView& student_hidden,
                                  const MatrixView& student_weight,
                                  const MatrixView& teacher_hidden,
                                  const MatrixView& teacher_weight, const IndexView& target,
                                  const DistillRowStats* stats, const float* grad_loss,
                                  const LinearDistillationOptions& options,
                                  const LinearCrossEntropyGrads& grads, Stream stream = nullptr);

}  // namespace fusedloss
