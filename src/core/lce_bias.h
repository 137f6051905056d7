// The linear heads' LM-head bias (logits = hidden @ weight^T + bias), the math both backends
// share. Each row of a chunk's logits buffer starts as the bias, and the logits GEMM adds
// hidden @ weight^T to it in its fp32 accumulator (beta = 1): the biased logit is rounded once
// to the chunk's dtype, as torch's F.linear (addmm) rounds it, and every cross-entropy step,
// the soft-cap first, sees it. Its gradient is the column sum of the chunk's dlogits (the
// gradient step's output, in the chunk's dtype, as the weight-gradient GEMM reads it), summed
// in fp32 across chunks.
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
