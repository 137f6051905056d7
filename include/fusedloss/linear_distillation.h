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
// DistillRowStats (20 B a row); the backward recomputes both logits (2 GEMMs) and runs the
// student's dhidden and dweight GEMMs. Memory: the student's chunk buffers, the teacher's one,
// and the GEMMs' stage, within about 2 x workspace_bytes.
//
// This version runs on the CPU backend at tensor-parallel size 1; CUDA inputs are refused.
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
  size_t workspace_bytes = size_t(256) << 20;  // as LinearCrossEntropyOptions::workspace_bytes
  int64_t chunk_rows = 0;          // as LinearCrossEntropyOptions::chunk_rows
  bool allow_tf32 = false;         // fp32 inputs only: TF32 GEMMs
};

// What the backward reads of each row (written by the forward; zeros for an ignored row).
struct DistillRowStats {
  float lse_student;  // log-sum-exp of s
  float lse_teacher;  // log-sum-exp of t
  float lse_hard;     // log-sum-exp of the student's logits at T = 1 (hard_label_weight > 0)
  float soft;         // the row's divergence
  float soft_student; // jsd: sum_j q_j log(q_j / m_j) (its gradient's row term); else 0
};

// Checks the options against the shapes (N rows, V, the two hidden sizes); throws Error as the
// calls do.
void validate_linear_distillation_options(const LinearDistillationOptions& options, int64_t rows,
                                          int64_t vocab, bool has_target);

// student_hidden [N, H_s] with student_weight [V, H_s] (one dtype: fp32/fp16/bf16), teacher_hidden
// [N, H_t] with teacher_weight [V, H_t] (one dtype, which may differ from the student's), columns
// contiguous; target [N] int32/int64 class ids or ignore_index, or none (data null: every row
// counts, hard_label_weight must be 0). Writes loss [N] and stats [N].
void linear_distillation_forward(const MatrixView& student_hidden, const MatrixView& student_weight,
                                 const MatrixView& teacher_hidden, const MatrixView& teacher_weight,
                                 const IndexView& target, const LinearDistillationOptions& options,
                                 float* loss, DistillRowStats* stats, Stream stream = nullptr);

// The student's gradients of sum_i grad_loss[i] loss_i from the forward's stats: grads.dhidden
// [N, H_s] and grads.dweight [V, H_s] (= or += with accumulate_dweight), each fp32 or the
// student's dtype; grads.dbias unused.
void linear_distillation_backward(const MatrixView& student_hidden,
                                  const MatrixView& student_weight,
                                  const MatrixView& teacher_hidden,
                                  const MatrixView& teacher_weight, const IndexView& target,
                                  const DistillRowStats* stats, const float* grad_loss,
                                  const LinearDistillationOptions& options,
                                  const LinearCrossEntropyGrads& grads, Stream stream = nullptr);

}  // namespace fusedloss
