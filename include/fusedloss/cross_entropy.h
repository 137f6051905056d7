// fusedloss: cross-entropy over (a vocabulary shard of) logits, split into local passes.
//
//   local stats   one read of the logits: per row max m, sum-exp s, target logit t, sum x
//   hook          all-gather of the 16-byte RowStats (or all-reduce max, then sum)
//   merge         lse = M + log S, loss = (1-a)(lse - T) + a(lse - SX/K) + z lse^2
//   (with logit_softcap c > 0 every pass sees c tanh(x / c) in place of the logit x)
//   backward      one read + one write: g = dL (p (1 + 2 z lse) - (1-a)[j==target] - a/K)
//
// Nothing of size [rows, V] is allocated; lse (4 B/row) is what backward needs.
// CPU views run on the CPU backend, CUDA views on the current build's kernels, enqueued on
// `stream` with no host synchronisation (see check_device_errors for target errors).
#pragma once
#include <cstdint>
#include "fusedloss/communicator.h"
#include "fusedloss/options.h"
#include "fusedloss/types.h"

namespace fusedloss {

struct CrossEntropyOptions {
  int64_t ignore_index = -100;
  float label_smoothing = 0.0f;  // in [0, 1)
  SmoothingFormula smoothing_formula = SmoothingFormula::PyTorch;
  // Partition reproduces Megatron's vocab_parallel_cross_entropy: the smoothing term averages
  // over the local shard only, so ranks report different losses at TP > 1.
  SmoothingScope smoothing_scope = SmoothingScope::Global;
  float z_loss = 0.0f;  // scale of the lse^2 regulariser, >= 0
  // > 0: the loss sees c * tanh(logit / c) (Gemma-2's final logit soft-capping) and the
  // gradient is taken through it; 0: off. The forward with the gradient then runs its stats and
  // gradient passes apart (3 reads of the logits, not 2).
  float logit_softcap = 0.0f;
  Reduction reduction = Reduction::Mean;
  int64_t vocab_start = 0;    // global index of this rank's first column
  int64_t vocab_global = -1;  // V_global; -1 means the logits' column count (no sharding)
  CollectiveForm collective = CollectiveForm::AllGather;
  // Vocab-parallel only (a communicator of size > 1). true: every call first all-gathers a
  // fixed-size header (rank, rows, V_local, an error flag, the collective form, a fingerprint
  // of the options, a checksum of the targets) so that a rank whose shape, options or tokens
  // differ, or whose own arguments were rejected, makes every rank throw the same Error at the
  // same call, instead of leaving its peers in a mismatched collective or with another loss. On a
  // device communicator this costs one small all-gather and one host synchronisation per call.
  // false: the caller guarantees that every rank passes agreeing shapes and valid arguments;
  // no header, no host synchronisation (needed inside CUDA graph capture). A rank that then
  // rejects its arguments throws alone, and its peers may wait in the next collective. The
  // flag itself must be the same on every rank (it decides whether the header is exchanged).
  bool check_shard_agreement = true;
};

// Forward outputs, in the logits' memory space (host or device).
struct CrossEntropyOutputs {
  float* loss = nullptr;         // [rows] for Reduction::None, else [1]
  float* lse = nullptr;          // [rows]: log-sum-exp over the global vocabulary (for backward)
  float* valid_count = nullptr;  // [1]: rows whose target != ignore_index (Mean's divisor)
};

// Checks the options against a logits shape of [rows, vocab_local], without any data: the
// same checks (and messages) that every entry point runs first, for callers that validate
// before allocating or launching (e.g. on fake tensors). Throws Error.
void validate_cross_entropy_options(const CrossEntropyOptions& options, int64_t rows,
                                    int64_t vocab_local);

// Whole forward: local stats -> hook over `comm` (may be null) -> merge.
// With a communicator of size > 1 every rank gets the same loss, bit for bit (except
// SmoothingScope::Partition, which is per-rank by definition).
void cross_entropy_forward(const MatrixView& logits, const IndexView& target,
                           const CrossEntropyOptions& options, const CrossEntropyOutputs& out,
                           Communicator* comm = nullptr, Stream stream = nullptr);

// Backward. grad_loss is [rows] for Reduction::None and [1] otherwise, or null for a unit
// upstream gradient; valid_count is the forward's (read on the device, only for Mean).
// grad_logits may be the logits themselves (same data and row stride): the gradient is then
// written in place.
void cross_entropy_backward(const MatrixView& logits, const IndexView& target, const float* lse,
                            const float* grad_loss, const float* valid_count,
                            const CrossEntropyOptions& options, const MatrixView& grad_logits,
                            Stream stream = nullptr);

// ---- The gradient in the forward (Reduction::Sum / Mean) ----
//
// A sum or mean loss has one upstream gradient for every row, so the forward can write the
// gradient for a unit upstream gradient while it reads the logits, and the backward only scales
// it. At TP=1 on CUDA one kernel does both passes of a row, keeping the row in shared memory
// between them: the logits are read from memory once and the gradient written once (2 passes,
// against 3 for forward + backward). Vocab-parallel, and on the CPU, it is the forward followed
// by the backward with a unit upstream gradient.

// The forward (same outputs, same communicator hook), plus the gradient of the reported loss
// with respect to the logits into grad_logits, which may be the logits themselves (same data
// and row stride: the logits are then overwritten). out.valid_count is required for Mean.
// The gradient is stored for a unit upstream gradient: in fp16, entries below fp16's range
// (p / N under a mean over many rows) are lost before a loss scale could lift them, so fp16
// training with loss scaling should keep cross_entropy_backward.
void cross_entropy_forward_with_grad(const MatrixView& logits, const IndexView& target,
                                     const CrossEntropyOptions& options,
                                     const CrossEntropyOutputs& out, const MatrixView& grad_logits,
                                     Communicator* comm = nullptr, Stream stream = nullptr);

// The backward of cross_entropy_forward_with_grad: grad_logits *= grad_loss[0] (one float, in
// the gradient's memory space), in place; on the device nothing is read or written past
// grad_loss when it is exactly 1, without a host synchronisation.
void cross_entropy_scale_grad(const MatrixView& grad_logits, const float* grad_loss,
                              Stream stream = nullptr);

// ---- The split passes, for trainers that run their own collective between them. ----
// Each refuses (Error naming both) an output that shares memory with another output or with
// anything it reads.

// Pass 1: stats[rows] of this rank's shard. Validates targets against [0, V_global).
void cross_entropy_local_stats(const MatrixView& logits, const IndexView& target,
                               const CrossEntropyOptions& options, RowStats* stats,
                               Stream stream = nullptr);

// All-reduce form, between the MAX all-reduce of the maxima and the SUM all-reduce:
// given global_max[rows], writes summable[rows] (max = global max on rank 0 and 0 elsewhere,
// sum_exp rescaled to the global max, target_logit 0 off its owner) so that an element-wise
// SUM over ranks gives the merged statistics.
void cross_entropy_prepare_sum(const RowStats* local, const float* global_max,
                               const IndexView& target, const CrossEntropyOptions& options,
                               int64_t vocab_local, int rank, RowStats* summable,
                               Device device, Stream stream = nullptr);

// Pass 2: combined is [parts][rows] (parts = world size after an all-gather, 1 after the
// all-reduce form). `local` is this rank's own stats (read only for SmoothingScope::Partition).
// row_scratch: rows floats (with the target) that a Sum / Mean's per-row losses may use, so
// that a caller who allocated it before its collectives allocates nothing after them; null:
// the call allocates them.
void cross_entropy_merge(const RowStats* combined, int parts, const RowStats* local,
                         const IndexView& target, const CrossEntropyOptions& options,
                         int64_t vocab_local, const CrossEntropyOutputs& out,
                         Stream stream = nullptr, float* row_scratch = nullptr);

// CUDA only: kernels flag a target outside [0, V_global) that is not ignore_index (its row's
// loss becomes NaN, nothing is read or written out of bounds). This synchronises `stream`,
// throws Error naming the first bad row and value if any was flagged since the last call, and
// clears the flag. Call it when convenient (e.g. where the step syncs anyway, or after a CUDA
// graph replay). A no-op in a build without CUDA.
void check_device_errors(Stream stream = nullptr);

}  // namespace fusedloss
