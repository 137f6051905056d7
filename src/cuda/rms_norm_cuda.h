// CUDA backend of RMSNorm: the same entry points as src/cpu/rms_norm_cpu.h, on a stream.
#pragma once
#include <cstddef>
#include <string>
#include "core/rms_norm_math.h"
#include "cuda/runtime.h"

namespace fusedloss::cuda {

// Launch shape of the vector ("rows") kernels. The defaults are the shipped kernels; the
// tests run the others too (every one must give correct results), and the benchmark measures
// them (bench/rms_norm_bench --variants). rms_norm_workspace_bytes follows the shipped
// bwd_blocks_per_sm, never this one, and the backward's partial rows never exceed it: a larger
// bwd_blocks_per_sm here is capped there (with or without a caller's workspace, the same grid).
struct RmsNormTuning {
  // Threads per row, a target: a row gets the fewest vectors a thread (1, 2, 4) that need at
  // most this many threads (rounded up to warps); rows too long for that take more threads.
  int fwd_tpr = 64;
  int fwd_block = 256;          // threads per block, a target (several rows when they are short)
  int fwd_blocks_per_sm = 0;    // 0: a block per `fwd_block / tpr` rows; n: a persistent grid
  int bwd_tpr = 64;             // 4 vectors a thread from 2048 bf16 columns: bytes in flight
  int bwd_block = 128;          // <= 512; several blocks an SM drift apart
  int bwd_blocks_per_sm = 4;    // the backward grid per SM at most (its partial rows; see above)
  bool fwd_prefetch = false;    // the group's next row into L2 (matters with a persistent grid)
  bool bwd_prefetch = true;
  // The weight gradient's column sum launched while the row kernel still runs
  // (dependent_launch.cuh; sm_90 and later): 1-2% of the backward.
  bool bwd_overlap_sum = true;
  // The backward splits a row that needs more threads than this (4 vectors a thread) over a
  // thread-block cluster of equal blocks of whole warps, at most this many threads each, or
  // failing that at most 512 (sm_90 and later; up to 8 blocks and 2048 threads a row; a row
  // whose warps divide no such way, e.g. 17, is not split): 0, never (a row is one block; fp32 rows
  // of 8196..16384 columns take 8 vectors a thread and read half of them twice, longer rows the
  // element-wise kernel). A multiple of 32. Smaller values measured slower (bench/NOTES.md).
  int bwd_cluster_threads = 512;
  // The forward reads a row twice (forward_reread_kernel: one block a row at few registers a
  // thread, the second read from L1/L2) where the row at 4 vectors a thread takes at least
  // fwd_reread_from threads, and where no held layout fits; 0: only there. fwd_reread_block:
  // its block, 0 for as many threads as 4 vectors a thread take (up to 1024).
  int fwd_reread_from = 512;
  int fwd_reread_block = 0;
};
RmsNormTuning rms_norm_tuning();
// Throws naming the field, its value and the range when a field is out of range.
void set_rms_norm_tuning(const RmsNormTuning& t);
// "field=value,..." (the field names above; booleans 0/1) over the defaults; throws naming an
// unknown field or a bad value.
RmsNormTuning parse_rms_norm_tuning(const std::string& spec);

size_t rms_norm_workspace_bytes(int64_t rows, int64_t hidden);
// Whether the backward on the current device launches its column sum overlapped
// (bwd_overlap_sum and the column sum's code compiled for sm_90 or later).
bool rms_norm_column_sum_overlapped();
// The blocks (a cluster) the backward splits a row of `hidden` columns over on the current
// device with the tuning in force, for a contiguous 16-byte-aligned view: 1 where a row is one
// block or takes the element-wise kernel.
int rms_norm_backward_row_split(int64_t hidden, DType dtype, DType weight_dtype);
void rms_norm_forward(const MatrixView& x, const core::RmsNormParams& p, const MatrixView& y,
                      float* rstd, const MatrixView& residual, const MatrixView& residual_out,
                      Stream stream);
// workspace: nullptr (allocated stream-ordered here) or rms_norm_workspace_bytes() bytes.
// grad_residual_out: rows == 0 when absent.
void rms_norm_backward(const MatrixView& grad_y, const MatrixView& x_or_s,
                       const core::RmsNormParams& p, const float* rstd, const MatrixView& grad_x,
                       void* grad_weight, DType grad_weight_dtype, void* workspace,
                       const MatrixView& grad_residual_out, Stream stream);

}  // namespace fusedloss::cuda
