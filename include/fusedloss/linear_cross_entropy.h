// fusedloss: linear cross-entropy, the LM head's projection fused with the loss.
//
//   logits = hidden @ weight^T (+ bias)   hidden [N, H], weight [V_local, H] (a vocab shard),
//                                         bias [V_local] (optional: this shard's columns)
//   loss   = cross_entropy(softcap(logits), target)   (every CrossEntropyOptions option)
//
// The logits never exist whole: they are computed one token chunk at a time into a bounded
// workspace (one [chunk, V_local] buffer in the inputs' dtype; two with FUSEDLOSS_LCE_BUFFERS=2,
// which overlap a chunk's cross-entropy with the next chunk's GEMMs), and each chunk's
// cross-entropy (local stats, the vocab-parallel hook, merge, gradient) runs on it before the
// buffer is reused. GEMMs: cuBLASLt on CUDA (fp32 accumulation), plain loops on the CPU.
//
// Two backward modes, both exact:
//   InForward  (Sum/Mean reductions, fp32/bf16 inputs: a unit gradient in fp16 would flush the
//              entries a loss scale keeps) the forward also computes the gradients of the reduced
//              loss for an upstream gradient of 1 (3 GEMMs in all); the backward only scales
//              them by the upstream scalar, read on the device. Also Reduction::None with row
//              weights w (LinearCrossEntropyOutputs::row_weight, e.g. Megatron's loss_mask):
//              the gradients of sum(w * loss), for an upstream gradient c * w.
//   Recompute  (any reduction, any per-row upstream gradient) the forward keeps lse (4 B/row);
//              the backward recomputes each chunk's logits (4 GEMMs in all).
//
// Vocab-parallel (a communicator of size > 1): per chunk, the local stats of this shard, one
// all-gather of 16 B/row, the merge; the shard agreement of the cross-entropy runs once per
// call before any collective. dhidden is this rank's partial sum over its vocab shard: the
// caller all-reduces it over the TP group, or reduce-scatters it along tokens (sequence
// parallel). dweight and dbias are this rank's own shard, complete.
//
// The bias (LinearCrossEntropyOutputs::bias) starts each chunk's logits buffer, and the logits
// GEMM adds hidden @ weight^T to it in fp32 (beta = 1): the biased logit is rounded once into
// the chunk's dtype, as torch's addmm rounds it, before the cross-entropy reads it (the soft-cap
// sees the biased logit). Its gradient dbias[v] = sum over the tokens of dlogits[:, v] sums
// each chunk's dlogits in fp32 (one write of the chunk before its GEMM, one read after the
// gradient step, on the steps' stream).
//
// Memory beside the caller's buffers: the chunk buffer(s) and on CUDA the cuBLASLt workspace
// (workspace_bytes together), O(N) floats, and with vocab_block (recompute) fp32 [N, H] and
// [block, H] accumulators.
// CUDA calls enqueue on `stream` (plus a cached side stream joined back before returning) and
// never synchronise the host at TP=1; they are CUDA-graph capturable with
// check_shard_agreement = false at TP>1.
#pragma once
#include <cstddef>
#include <cstdint>
#include "fusedloss/communicator.h"
#include "fusedloss/cross_entropy.h"
#include "fusedloss/options.h"
#include "fusedloss/types.h"

namespace fusedloss {

enum class LinearCeBackward {
  Auto,       // InForward for Reduction::Sum / Mean and for None with row weights, Recompute
              // for None without them and for fp16
  InForward,  // Sum / Mean or None with row weights, fp32 or bf16 inputs only
  Recompute,
};

// What linear_cross_entropy_* write into dhidden at TP > 1. Partial: this rank's
// contribution, sum it over the TP group yourself (all-reduce, or reduce-scatter along tokens).
enum class DHiddenForm { Partial };

struct LinearCrossEntropyOptions {
  // Bound on the chunk buffers and the GEMM workspace together (bytes). The GEMM workspace is
  // an eighth of it, at most 4 MiB (cuBLASLt's on CUDA; the CPU backend plans the same chunks
  // and leaves it unallocated). With chunk_rows == 0 the chunk is the most tokens whose
  // [chunk, V_local] buffer (two with FUSEDLOSS_LCE_BUFFERS=2) fits in the rest, rounded down
  // to whole GEMM tiles (a multiple of 256 or 128 rows when that gives up at most a quarter of
  // it, else of 64; never less than 1 token, which may exceed the bound).
  size_t workspace_bytes = size_t(256) << 20;
  // > 0: exactly this many tokens per chunk (the last chunk takes the remainder), whatever
  // workspace_bytes says. Mostly for tests; 0 derives it from workspace_bytes.
  int64_t chunk_rows = 0;
  // fp32 inputs only: the GEMMs may use TF32 tensor cores (torch's
  // torch.backends.cuda.matmul.allow_tf32). bf16/fp16 inputs always accumulate in fp32.
  // The CPU backend computes in fp32 either way.
  bool allow_tf32 = false;
  // > 0: the loss sees c * tanh(logit / c) (Gemma-2's final logit soft-capping); 0: off.
  float logit_softcap = 0.0f;
  LinearCeBackward backward_mode = LinearCeBackward::Auto;
  // Recompute backward only. > 0: the vocabulary in blocks of this many columns (outer loop)
  // and the tokens in chunks (inner loop): each block's dweight sums over all tokens in fp32
  // before its one rounding (as exact as one GEMM over all tokens, into any dweight dtype),
  // dhidden sums over the blocks in fp32. Scratch: fp32 [N, H] + fp32 [block, H] beside the
  // workspace. 0: tokens outer; dweight accumulates chunk pair by chunk pair in its own dtype.
  int64_t vocab_block = 0;
  DHiddenForm dhidden_form = DHiddenForm::Partial;
};

// The vocab_block the adapters pass for an exact recompute backward into a 16-bit dweight: the
// columns whose fp32 [block, H] buffer is 128 MiB, in multiples of 64, at least 64.
inline int64_t linear_cross_entropy_default_vocab_block(int64_t hidden) {
  constexpr int64_t kBlockBytes = int64_t(128) << 20;
  const int64_t block = kBlockBytes / (4 * (hidden > 0 ? hidden : 1)) / 64 * 64;
  return block > 64 ? block : 64;
}

// The vocab_block an adapter passes to a backward of the resolved `mode` writing a dweight of
// `dweight_dtype`: the default block where a Recompute backward into a 16-bit dweight is to be
// exact (fp32_accumulation: each block's dweight sums over all tokens in an fp32 buffer), else 0.
inline int64_t linear_cross_entropy_backward_vocab_block(LinearCeBackward mode,
                                                         bool fp32_accumulation,
                                                         DType dweight_dtype, int64_t hidden) {
  return mode == LinearCeBackward::Recompute && fp32_accumulation && dweight_dtype != DType::F32
             ? linear_cross_entropy_default_vocab_block(hidden)
             : 0;
}

// The mode `Auto` resolves to for `reduction`, the inputs' `dtype` and whether the call has row
// weights (Recompute for None without row weights and for fp16 inputs, whose unit gradient
// would flush the entries a loss scale keeps; else InForward), and the check of an explicit
// InForward against them. Throws Error.
LinearCeBackward resolve_linear_ce_backward(LinearCeBackward mode, Reduction reduction, DType dtype,
                                            bool row_weighted = false);

// Forward outputs, in the inputs' memory space (host or device).
struct LinearCrossEntropyOutputs {
  float* loss = nullptr;         // [N] for Reduction::None, else [1]
  float* lse = nullptr;          // [N]: log-sum-exp over the global vocabulary (for Recompute)
  float* valid_count = nullptr;  // [1]: rows whose target != ignore_index (Mean's divisor).
                                 // Optional (null: kept in the call's scratch), but the
                                 // Recompute backward of a Reduction::Mean reads the forward's
                                 // count: pass a buffer then
  // InForward only (ignored for Recompute): the gradients of the reduced loss for an upstream
  // gradient of 1. dhidden [N, H] (at TP > 1 this rank's partial), dweight [V_local, H]; each
  // fp32, or the inputs' dtype (bf16/fp16 inputs). An fp32 dweight is the exact choice: it
  // accumulates over the token chunks in fp32.
  MatrixView dhidden;
  MatrixView dweight;
  // An input: the LM head's bias [V_local] (at TP > 1 this rank's shard of the [V_global]
  // bias, the weight's rows), contiguous, of the inputs' dtype or fp32, with the inputs.
  // Absent (data null): no bias, and nothing of it is computed. The backward reads the same
  // bias as `saved.bias` (a Recompute backward adds it to the recomputed logits). At TP > 1
  // every rank has one or none: the agreement compares its presence.
  VectorView bias;
  // InForward with a bias only (null otherwise, or: no bias gradient is computed): fp32 [V_local]
  // receiving the bias gradient for an upstream gradient of 1 (summed over the token chunks
  // in fp32), which the backward scales into LinearCrossEntropyGrads::dbias.
  float* dbias = nullptr;
  // An input, Reduction::None only (null otherwise): fp32 row weights w [N] with the inputs.
  // The InForward gradients are then those of sum(w * loss), and the backward needs an upstream
  // gradient grad_loss = c * w for one scalar c (Megatron's loss_func reduces
  // c * sum(loss_mask * loss)): it finds c on the device and scales by it. Another grad_loss
  // has no such c: on CUDA the gradients are NaN and check_device_errors() throws; on the host
  // the backward throws. A non-finite grad_loss (a NaN loss upstream) or weight gives NaN
  // gradients without an error, as it gives the caller's sum(w * loss). The loss itself is not
  // weighted. Recompute (fp16 inputs, or asked for) does not read it. At TP > 1 the same on
  // every rank: the agreement compares a checksum of it with the targets' (InForward). With
  // N == 0 a null pointer reads as no row weights: pass Auto (or Recompute) there.
  const float* row_weight = nullptr;
  // Optional: the call's scratch (the chunk buffers and the GEMM workspace within
  // workspace_bytes, per-row losses, at TP > 1 the exchange of a chunk), in the inputs' memory
  // space, 256-byte aligned (16 on the host), at least linear_cross_entropy_forward_scratch_bytes,
  // not used by anything else until the call's work on its stream is done. Null: the call
  // allocates it (fusedloss/scratch.h), before the agreement at TP > 1. A caller that runs its
  // own agreement (check_shard_agreement = false) allocates it before that agreement, so that
  // no rank can fail alone once the per-chunk collectives have begun.
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
};

// The gradients a backward writes.
struct LinearCrossEntropyGrads {
  MatrixView dhidden;  // [N, H], fp32 or the inputs' dtype; written (at TP > 1: partial)
  MatrixView dweight;  // [V_local, H], fp32 or the inputs' dtype
  // true: dweight += the gradient (beta = 1; e.g. Megatron's fp32 main_grad under gradient-
  // accumulation fusion); false: dweight = the gradient.
  bool accumulate_dweight = false;
  // With a bias (saved.bias) only: [V_local] of dbias_dtype (fp32 or the bias's dtype),
  // contiguous, receiving sum over the tokens of dlogits, summed in fp32 and rounded once;
  // written, never accumulated. Null: no bias gradient (a bias that needs none), at no cost.
  // The InForward backward scales the forward's saved.dbias into it (required then).
  void* dbias = nullptr;
  DType dbias_dtype = DType::F32;
};

// Checks everything about the options that needs no data (shapes: N rows, V_local, H).
// Throws Error with the same messages as the entry points.
void validate_linear_cross_entropy_options(const CrossEntropyOptions& ce,
                                           const LinearCrossEntropyOptions& options, int64_t rows,
                                           int64_t vocab_local, int64_t hidden);

// The chunk (tokens) a call with these sizes uses: its logits buffers take chunk x vocab_local
// elements each (of dtype). A backward with vocab_block plans with vocab_local = the block.
int64_t linear_cross_entropy_chunk_rows(const LinearCrossEntropyOptions& options, int64_t rows,
                                        int64_t vocab_local, DType dtype);

// The bytes of LinearCrossEntropyOutputs::scratch that a forward with these arguments needs on
// a communicator of comm_size ranks (hidden and weight: their shapes, dtype and device).
size_t linear_cross_entropy_forward_scratch_bytes(const MatrixView& hidden,
                                                  const MatrixView& weight,
                                                  const CrossEntropyOptions& ce,
                                                  const LinearCrossEntropyOptions& options,
                                                  int comm_size = 1);

// Diagnostics: the CUDA chunk loop's device time per phase (CUDA events around the logits
// GEMMs, the cross-entropy steps, the dhidden GEMMs and the dweight GEMMs of every chunk), and
// the whole loop's, summed over the loops run with FUSEDLOSS_LCE_TIMING=1 since the last reset.
// Phases on the side stream overlap the GEMMs, so the phases can sum to more than the loop.
// The FUSEDLOSS_LCE_* variables select the pipeline's variants (src/core/lce_tuning.h).
struct LinearCePhaseTimes {
  double logits_ms = 0, ce_ms = 0, dhidden_ms = 0, dweight_ms = 0, loop_ms = 0;
  int64_t loops = 0;
};
LinearCePhaseTimes linear_cross_entropy_phase_times(bool reset);

// hidden  [N, H]       fp32/fp16/bf16, columns contiguous, any row stride, CPU or CUDA
// weight  [V_local, H] same dtype and device as hidden (rank r's rows [r V_local, (r+1) V_local)
//                      of the full [V_global, H] weight at TP > 1)
// target  [N]          int32/int64 global class ids (or ignore_index), same device
// ce                   the cross-entropy options; vocab_start / vocab_global as for
//                      cross_entropy_forward (defaults: the whole vocabulary on one rank)
// comm                 null or the TP group's communicator (size 1: no communication)
// stream               a cudaStream_t for CUDA views (null: the legacy default stream)
void linear_cross_entropy_forward(const MatrixView& hidden, const MatrixView& weight,
                                  const IndexView& target, const CrossEntropyOptions& ce,
                                  const LinearCrossEntropyOptions& options,
                                  const LinearCrossEntropyOutputs& out,
                                  Communicator* comm = nullptr, Stream stream = nullptr);

// The split form, for trainers that run their own collective (e.g. a torch.distributed group):
// this rank's RowStats of every row ([N], the cross-entropy's pass 1 over each chunk's
// soft-capped logits, one GEMM per chunk). Then all-gather them across the TP group,
// cross_entropy_merge (same `ce`) for loss, lse and valid_count, and the Recompute backward.
// No collective runs here. scratch (optional, as LinearCrossEntropyOutputs::scratch): at least
// linear_cross_entropy_local_stats_scratch_bytes, for a caller that allocates everything before
// its agreement; null: the call allocates the chunk buffers itself. bias: as
// LinearCrossEntropyOutputs::bias (added before the stats), absent by default.
void linear_cross_entropy_local_stats(const MatrixView& hidden, const MatrixView& weight,
                                      const IndexView& target, const CrossEntropyOptions& ce,
                                      const LinearCrossEntropyOptions& options, RowStats* stats,
                                      Stream stream = nullptr, void* scratch = nullptr,
                                      size_t scratch_bytes = 0, const VectorView& bias = {});
size_t linear_cross_entropy_local_stats_scratch_bytes(const MatrixView& hidden,
                                                      const MatrixView& weight,
                                                      const LinearCrossEntropyOptions& options);

// Creates what a call on `stream` creates on first use (CUDA: the chunk loop's side stream and
// events, the cuBLASLt handle; nothing on the host). The forward does it before its agreement;
// a caller running its own agreement around local_stats calls this before it too.
void linear_cross_entropy_prepare(Device device, Stream stream = nullptr);

// Backward. Same inputs and options as the forward (resolved to the same mode).
//   InForward: grads = grad_loss[0] x the forward's out.dhidden / out.dweight / out.dbias (`saved`),
//              elementwise on the device; hidden, weight, lse and valid_count are not read.
//              With saved.row_weight (None): grad_loss is [N] = c x row_weight, and the
//              scale is c (see LinearCrossEntropyOutputs::row_weight).
//              grads may be the saved buffers themselves (scaled in place: they are then
//              consumed, and a second backward over them would scale them again).
//   Recompute: grad_loss is [N] for Reduction::None, else [1]; lse and valid_count (Mean) are
//              the forward's; each chunk's logits are recomputed (no communication), with
//              saved.bias (the forward's bias) added.
// grad_loss lives with the inputs (host or device) and is read there, never copied to the host.
void linear_cross_entropy_backward(const MatrixView& hidden, const MatrixView& weight,
                                   const IndexView& target, const float* lse,
                                   const float* grad_loss, const float* valid_count,
                                   const CrossEntropyOptions& ce,
                                   const LinearCrossEntropyOptions& options,
                                   const LinearCrossEntropyOutputs& saved,
                                   const LinearCrossEntropyGrads& grads, Stream stream = nullptr);

}  // namespace fusedloss
