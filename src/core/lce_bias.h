// The linear heads' LM-head bias (logits = hidden @ weight^T + bias), the math both backends
// share. The bias, in the logits' dtype (exact for a bias of that dtype; an fp32 bias beside
// 16-bit logits is rounded to theirs first), is added to the logits GEMM's fp32 sum, and the
// biased logit is rounded once to the chunk's dtype, as torch's F.linear rounds it; every
// cross-entropy step, the soft-cap first, sees it. The CPU backend starts each row of a chunk's
// buffer as the bias and its GEMM adds hidden @ weight^T in an fp32 tile (beta = 1); the CUDA
// backend gives cuBLASLt the bias for its bias epilogue (CUBLASLT_EPILOGUE_BIAS). Not beta = 1
// there: cuBLASLt's 16-bit kernels round the product to the output type before adding C, two
// roundings (a 1-ulp logit error, 10x torch's dhidden error on bf16 logits of magnitude 10).
// The bias's gradient is the column sum of the chunk's dlogits (the gradient step's output, in
// the chunk's dtype, as the weight-gradient GEMM reads it), summed in fp32 across chunks.
#pragma once
#include <cstdint>
#include "core/numeric.h"
#include "core/platform.h"

namespace fusedloss::core {

// A logits buffer's initial element: the bias in the chunk's dtype (exact for a bias of that
// dtype; an fp32 bias beside 16-bit logits is rounded to theirs first).
template <StorageKind KL, StorageKind KB>
FL_HD Elem<KL> lce_bias_start(Elem<KB> bias) {
  return St<KL>::store(St<KB>::load(bias));
}

// acc plus column c of rows [0, rows) of g (row stride `stride`), in row order: every backend
// sums a column in the same order, so dbias does not depend on the backend's thread layout.
template <StorageKind KG>
FL_HD float lce_column_sum(const Elem<KG>* g, int64_t stride, int64_t rows, int64_t c,
                           float acc) {
  for (int64_t r = 0; r < rows; ++r) acc += St<KG>::load(g[r * stride + c]);
  return acc;
}

}  // namespace fusedloss::core
