// Linear cross-entropy: the resolved chunking of one call and the per-chunk cross-entropy steps
// that the API hands to a backend's chunk loop (src/cpu/linear_ce_cpu.cpp,
// src/cuda/linear_ce_cuda.cu). The loop owns the GEMMs and the chunk buffers; the steps are the
// cross-entropy's own passes (and, at TP > 1, its vocab-parallel hook).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include "common/error.h"
#include "core/lce_tuning.h"
#include "fusedloss/types.h"

namespace fusedloss::core {

// v rounded up to a multiple of `to` (> 0).
template <class T>
constexpr T round_up(T v, T to) {
  return (v + to - 1) / to * to;
}

// The GEMM library's workspace out of a call's workspace_bytes: an eighth of it, at most `cap`
// (LceTuning::gemm_workspace_cap), in whole 256-byte blocks. The chunk buffers get the rest, so
// workspace_bytes bounds everything a call allocates for its chunks (the CPU backend plans the
// same chunks; its GEMMs stage 16-bit operands as fp32 in this share: lce_cpu_stage_bytes).
constexpr size_t lce_gemm_workspace_bytes(size_t workspace_bytes, size_t cap) {
  const size_t eighth = workspace_bytes / 8 / 256 * 256;
  return eighth < cap ? eighth : cap;
}

struct LcePlan {
  int64_t rows = 0;         // N tokens
  int64_t hidden = 0;       // H
  int64_t vocab_local = 0;  // V_local: the logits' columns
  int64_t chunk = 1;        // tokens per chunk (the last chunk takes the remainder)
  int64_t stride = 0;       // row stride of a chunk buffer (V_local rounded up to 16 bytes)
  DType dtype = DType::F32; // of hidden, weight and the chunk buffers
  bool tf32 = false;        // fp32 GEMMs may use TF32 (CUDA)
  size_t gemm_workspace = 0;  // bytes for the GEMM library (lce_gemm_workspace_bytes)
  // Rows per step call when both steps run (0: the whole chunk at once). Slices small enough
  // for the L2 cache let the gradient step re-read what the forward step just read from there
  // instead of HBM. Set only at TP = 1: at TP > 1 every forward step is a collective.
  int64_t step_rows = 0;
  // The pipeline knobs, read once per call here: the chunk above is sized for tuning.buffers,
  // and the loop must allocate exactly that.
  LceTuning tuning;
};

// The chunk loop's memory, one block the caller allocates: the chunk buffers (adjacent; the
// CUDA loop fills tuning.buffers of them, the CPU loop one), then at a 256-byte boundary the
// GEMM library's workspace (CUDA) or the CPU GEMMs' stage, then on CUDA at a 256-byte boundary
// the bias in the logits' dtype (V_local elements, whether or not a call has a bias: the size
// must not depend on it). None without rows.
constexpr size_t kLceAlign = 256;
inline size_t lce_buffer_bytes(const LcePlan& plan) {
  return size_t(plan.chunk) * size_t(plan.stride) * size_t(detail::element_size(plan.dtype));
}
inline size_t lce_gemm_workspace_at(const LcePlan& plan) {
  return round_up(size_t(plan.tuning.buffers) * lce_buffer_bytes(plan), kLceAlign);
}
// On the CPU, the GEMMs' fp32 stage of 16-bit operands (src/cpu/gemm_blas.cpp) takes the GEMM
// workspace's share, at least 1 MiB (tiles of 256 x 256 x 256): beyond workspace_bytes only
// when that is under 8 MiB.
inline size_t lce_cpu_stage_bytes(const LcePlan& plan) {
  if (plan.dtype == DType::F32) return 0;  // BLAS reads fp32 operands in place
  return std::max(plan.gemm_workspace, size_t(1) << 20);
}
inline size_t lce_cpu_stage_at(const LcePlan& plan) {
  return round_up(lce_buffer_bytes(plan), kLceAlign);
}
// CUDA: the bias's copy in the logits' dtype (what cuBLASLt's bias epilogue reads).
inline size_t lce_bias_at(const LcePlan& plan) {
  return round_up(lce_gemm_workspace_at(plan) + plan.gemm_workspace, kLceAlign);
}
inline size_t lce_bias_bytes(const LcePlan& plan) {
  return round_up(size_t(plan.vocab_local) * size_t(detail::element_size(plan.dtype)), kLceAlign);
}
inline size_t lce_loop_bytes(const LcePlan& plan, Device device) {
  if (plan.rows == 0) return 0;
  if (device == Device::CPU) {
    const size_t stage = lce_cpu_stage_bytes(plan);
    return stage ? lce_cpu_stage_at(plan) + stage : lce_buffer_bytes(plan);
  }
  return lce_bias_at(plan) + lce_bias_bytes(plan);
}

// One step over the chunk of rows [row0, row0 + logits.rows) whose logits (stride plan.stride)
// are in `logits`; enqueued on `stream` (the loop's cross-entropy stream on CUDA).
using LceStep = std::function<void(const MatrixView& logits, int64_t row0, Stream stream)>;

struct LceSteps {
  // The LM head's bias over the logits' columns (V_local elements of the inputs' dtype or fp32;
  // data null: none), added to every row of the logits before their one rounding
  // (core/lce_bias.h says how each backend adds it).
  VectorView bias;
  LceStep forward;   // stats -> hook -> merge: writes the chunk's lse and row losses (or null)
  LceStep gradient;  // writes the chunk's dloss/dlogits over the logits (or null: no gradients)
};

// The steps of one chunk whose logits are in `logits` (rows [row0, row0 + logits.rows)), in
// slices of plan.step_rows when both run; every backend's loop calls this.
inline void lce_run_steps(const LcePlan& plan, const LceSteps& steps, const MatrixView& logits,
                          int64_t row0, Stream stream) {
  const bool both = steps.forward && steps.gradient;
  const int64_t slice = both && plan.step_rows > 0 ? plan.step_rows : logits.rows;
  for (int64_t r = 0; r < logits.rows; r += slice) {
    MatrixView part = logits;
    part.data = static_cast<char*>(logits.data) +
                r * logits.row_stride * detail::element_size(logits.dtype);
    part.rows = std::min(slice, logits.rows - r);
    if (steps.forward) steps.forward(part, row0 + r, stream);
    if (steps.gradient) steps.gradient(part, row0 + r, stream);
  }
}

// The gradient GEMMs' outputs (used when steps.gradient is set).
struct LceGrads {
  MatrixView dhidden;  // [N, H]
  MatrixView dweight;  // [V_local, H]
  bool accumulate_dweight = false;
  bool accumulate_dhidden = false;  // dhidden += (beta = 1) instead of =
};

}  // namespace fusedloss::core
