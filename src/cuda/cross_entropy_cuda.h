// CUDA backend of the cross-entropy: the same entry points as src/cpu, enqueued on a stream.
#pragma once
#include <cstddef>
#include "core/ce_params.h"
#include "fusedloss/cross_entropy.h"  // CrossEntropyOutputs
#include "cuda/runtime.h"

namespace fusedloss::cuda {

void ce_local_stats(const MatrixView& logits, const IndexView& target, const core::CeParams& p,
                    RowStats* stats, Stream stream);
// TP=1: stats, lse and per-row loss in one pass (no merge pass), then the reduction.
void ce_forward_tp1(const MatrixView& logits, const IndexView& target, const core::CeParams& p,
                    const CrossEntropyOutputs& out, Stream stream);
void ce_prepare_sum(const RowStats* local, const float* global_max, const IndexView& target,
                    const core::CeParams& p, int rank, RowStats* summable, Stream stream);
// row_scratch: p.rows floats for the per-row losses of a Sum / Mean (null: allocated here).
void ce_merge(const RowStats* combined, int parts, const RowStats* local, const IndexView& target,
              const core::CeParams& p, const CrossEntropyOutputs& out, Stream stream,
              float* row_scratch = nullptr);
// As cpu::ce_reduce: Sum / Mean of row_losses into out.loss, the count into out.valid_count
// (when not null); row_losses may be null (the count alone).
void ce_reduce(const float* row_losses, const IndexView& target, const core::CeParams& p,
               const CrossEntropyOutputs& out, Stream stream);
void ce_backward(const MatrixView& logits, const IndexView& target, const float* lse,
                 const float* grad_loss, const float* valid_count, const core::CeParams& p,
                 const MatrixView& grad, Stream stream);
// TP=1, Sum/Mean: the forward of ce_forward_tp1 and the gradient for a unit upstream gradient
// (grad may be the logits), each row read from memory once (cross_entropy_forward_with_grad).
void ce_forward_with_grad_tp1(const MatrixView& logits, const IndexView& target,
                              const core::CeParams& p, const CrossEntropyOutputs& out,
                              const MatrixView& grad, Stream stream);
// grad *= grad_loss[0] in place, skipped on the device when it is exactly 1.
void ce_scale_grad(const MatrixView& grad, const float* grad_loss, Stream stream);
// stats[r].max -> maxima[r]
void ce_extract_max(const RowStats* stats, int64_t rows, float* maxima, Stream stream);
// *out += sum over rows of core::target_checksum_term (out: device memory, zeroed by the
// caller).
void ce_target_checksum(const IndexView& target, uint64_t* out, Stream stream);
// *out += sum over rows of core::row_weight_checksum_term.
void ce_row_weight_checksum(const float* weight, int64_t rows, uint64_t* out, Stream stream);

// The device error word (the first out-of-range target, or upstream gradient that does not
// fit lce_row_weight_scale); see check_device_errors().
void check_device_errors(Stream stream);

// *scale = the c with grad_loss == c * row_weight over n rows (core/row_weight.h), one block on
// the device; NaN when grad_loss has a non-finite entry, and NaN with the first row that does
// not fit reported into the device error word (here, beside the word's one definition).
void lce_row_weight_scale(const float* grad_loss, const float* row_weight, int64_t n,
                          float* scale, Stream stream);

}  // namespace fusedloss::cuda
