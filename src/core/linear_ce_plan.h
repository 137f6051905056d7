// Linear cross-entropy: the resolved chunking of one call and the per-chunk cross-entropy steps
// that the API hands to a backend's chunk loop (src/cpu/linear_ce_cpu.cpp,
// src/cuda/linear_ce_cuda.cu). The loop owns the GEMMs and the chunk buffers; the steps are the
// cross-entropy's own passes (and, at TP > 1, its vocab-parallel hook).
#pragma once
#include <cstdint>
#include <functional>
#include "fusedloss/types.h"

namespace fusedloss::core {

struct LcePlan {
  int64_t rows = 0;         // N tokens
  int64_t hidden = 0;       // H
  int64_t vocab_local = 0;  // V_local: the logits' columns
  int64_t chunk = 1;        // tokens per chunk (the last chunk takes the remainder)
  int64_t stride = 0;       // row stride of a chunk buffer (V_local rounded up to 16 bytes)
  DType dtype = DType::F32; // of hidden, weight and the chunk buffers
  bool tf32 = false;        // fp32 GEMMs may use TF32 (CUDA)
};

// One step over the chunk of rows [row0, row0 + logits.rows) whose logits (stride plan.stride)
// are in `logits`; enqueued on `stream` (the loop's cross-entropy stream on CUDA).
using LceStep = std::function<void(const MatrixView& logits, int64_t row0, Stream stream)>;

struct LceSteps {
  LceStep forward;   // stats -> hook -> merge: writes the chunk's lse and row losses (or null)
  LceStep gradient;  // writes the chunk's dloss/dlogits over the logits (or null: no gradients)
};

// The gradient GEMMs' outputs (used when steps.gradient is set).
struct LceGrads {
  MatrixView dhidden;  // [N, H]
  MatrixView dweight;  // [V_local, H]
  bool accumulate_dweight = false;
  bool accumulate_dhidden = false;  // dhidden += (beta = 1) instead of =
};

}  // namespace fusedloss::core
