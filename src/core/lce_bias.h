// The linear heads' LM-head bias (logits = hidden @ weight^T + bias), the math both backends
// share. The bias is added to a chunk's logits in place after the logits GEMM and before any
// cross-entropy step reads them, so the soft-cap sees the biased logit (torch: F.linear, then
// the cap). Its gradient is the column sum of the chunk's dlogits (the gradient step's output,
// in the chunk's dtype, as the weight-gradient GEMM reads it), summed in fp32 across chunks.
#pragma once
#include <cstdint>
#include "core/numeric.h"
#include "core/platform.h"

namespace fusedloss::core {

// A stored logit plus its bias, rounded once back to the chunk's dtype.
template <StorageKind KL, StorageKind KB>
FL_HD Elem<KL> lce_biased(Elem<KL> logit, Elem<KB> bias) {
  return St<KL>::store(St<KL>::load(logit) + St<KB>::load(bias));
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
