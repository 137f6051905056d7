// CUDA backend of the linear cross-entropy: the chunk loop over cuBLASLt GEMMs, pipelined over
// two chunk buffers and two streams (src/cuda/linear_ce_cuda.cu).
#pragma once
#include "core/linear_ce_plan.h"
#include "cuda/runtime.h"

namespace fusedloss::cuda {

// As cpu::lce_run, enqueued on `stream`; the cross-entropy steps run on a side stream that is
// forked from and joined back to `stream` (events), so the steps of chunk i overlap the GEMMs
// of chunk i + 1.
void lce_run(const core::LcePlan& plan, const MatrixView& hidden, const MatrixView& weight,
             const core::LceSteps& steps, const core::LceGrads& grads, void* memory,
             Stream stream);

// Creates what lce_run on `stream` creates on first use (the side stream and its events, the
// cuBLASLt handle), so that a vocab-parallel caller can do it before its agreement.
void lce_prepare(Stream stream);

// out[0 .. bias.size) = the bias in `dtype` (core::lce_bias_start), enqueued on `stream`: the
// copy the logits GEMM's bias epilogue reads.
void lce_copy_bias(void* out, DType dtype, const VectorView& bias, Stream stream);
// As cpu::lce_add_column_sums (core/lce_bias.h), enqueued on `stream`.
void lce_add_column_sums(const MatrixView& g, float* acc, Stream stream);

// dst = scale[0] * src, or dst += scale[0] * src; scale is read on the device.
void lce_scale(const MatrixView& src, const MatrixView& dst, const float* scale, bool accumulate,
               Stream stream);

// ptr[0 .. n) = value.
void lce_fill(float* ptr, float value, int64_t n, Stream stream);

}  // namespace fusedloss::cuda
