#include "cpu/linear_ce_cpu.h"

#include <algorithm>
#include "core/dispatch.h"
#include "core/lce_bias.h"
#include "core/row_weight.h"
#include "common/error.h"
#include "cpu/parallel.h"

namespace fusedloss::cpu {
namespace {

float load(const MatrixView& m, int64_t r, int64_t c) {
  const int64_t i = r * m.row_stride + c;
  switch (m.dtype) {
    case DType::F32: return static_cast<const float*>(m.data)[i];
    case DType::F16: return core::half_to_float(static_cast<const uint16_t*>(m.data)[i]);
    case DType::BF16: return core::bf16_to_float(static_cast<const uint16_t*>(m.data)[i]);
    default: break;
  }
  detail::fail("linear cross-entropy (cpu): dtype ", to_string(m.dtype), " is not a GEMM operand");
}

void store(const MatrixView& m, int64_t r, int64_t c, float v) {
  const int64_t i = r * m.row_stride + c;
  switch (m.dtype) {
    case DType::F32: static_cast<float*>(m.data)[i] = v; return;
    case DType::F16: static_cast<uint16_t*>(m.data)[i] = core::float_to_half(v); return;
    case DType::BF16: static_cast<uint16_t*>(m.data)[i] = core::float_to_bf16(v); return;
    default: break;
  }
  detail::fail("linear cross-entropy (cpu): dtype ", to_string(m.dtype), " is not a GEMM output");
}

// Element i of a GEMM operand stored as K, as float.
template <core::StorageKind K>
float read(const void* data, int64_t i) {
  return core::St<K>::load(static_cast<const core::Elem<K>*>(data)[i]);
}

// C[m, n] (+)= op(A)[m, k] @ op(B)[k, n] for operands of dtypes DA, DB, read in place: the loop
// allocates nothing (at TP > 1 it runs between collectives, where a rank must not fail alone).
template <core::StorageKind DA, core::StorageKind DB>
void gemm_typed(const MatrixView& A, bool ta, const MatrixView& B, bool tb, const MatrixView& C,
                bool accumulate) {
  const int64_t m = C.rows, n = C.cols, k = ta ? A.rows : A.cols;
  // op(A)(i, q) = A.data[i * a_i + q * a_q], op(B)(q, j) = B.data[q * b_q + j * b_j]
  const int64_t a_i = ta ? 1 : A.row_stride, a_q = ta ? A.row_stride : 1;
  const int64_t b_q = tb ? 1 : B.row_stride, b_j = tb ? B.row_stride : 1;
  if (b_j == 1) {  // op(B)'s rows are contiguous: a block of C's row accumulates along them
    constexpr int64_t kBlock = 64;  // (the same order of the k terms per element as below)
#pragma omp parallel for schedule(static) if (worth_threads(m * n * k))
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
        const int64_t nb = std::min(kBlock, n - j0);
        double acc[kBlock];
        for (int64_t jj = 0; jj < nb; ++jj) acc[jj] = accumulate ? double(load(C, i, j0 + jj)) : 0.0;
        for (int64_t q = 0; q < k; ++q) {
          const double a = double(read<DA>(A.data, i * a_i + q * a_q));
          const int64_t row = q * b_q + j0;
          for (int64_t jj = 0; jj < nb; ++jj) acc[jj] += a * double(read<DB>(B.data, row + jj));
        }
        for (int64_t jj = 0; jj < nb; ++jj) store(C, i, j0 + jj, float(acc[jj]));
      }
    return;
  }
#pragma omp parallel for schedule(static) if (worth_threads(m * n * k))
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = accumulate ? double(load(C, i, j)) : 0.0;
      for (int64_t q = 0; q < k; ++q)
        acc += double(read<DA>(A.data, i * a_i + q * a_q)) * double(read<DB>(B.data, q * b_q + j * b_j));
      store(C, i, j, float(acc));
    }
}

// C[m, n] (+)= op(A)[m, k] @ op(B)[k, n], row-major views; double accumulation.
void gemm(const MatrixView& A, bool ta, const MatrixView& B, bool tb, const MatrixView& C,
          bool accumulate) {
  core::dispatch_dtype(A.dtype, [&](auto a) {
    core::dispatch_dtype(B.dtype, [&](auto b) {
      gemm_typed<decltype(a)::value, decltype(b)::value>(A, ta, B, tb, C, accumulate);
    });
  });
}

MatrixView rows_of(const MatrixView& m, int64_t row0, int64_t rows) {
  MatrixView v = m;
  v.data = static_cast<char*>(m.data) + row0 * m.row_stride * detail::element_size(m.dtype);
  v.rows = rows;
  return v;
}

}  // namespace

void lce_run(const core::LcePlan& plan, const MatrixView& hidden, const MatrixView& weight,
             const core::LceSteps& steps, const core::LceGrads& grads, void* memory) {
  const bool with_grads = bool(steps.gradient);
  if (with_grads && !grads.accumulate_dweight)  // also right for N == 0: a zero gradient
    for (int64_t v = 0; v < plan.vocab_local; ++v)
      for (int64_t h = 0; h < plan.hidden; ++h) store(grads.dweight, v, h, 0.0f);
  for (int64_t row0 = 0; row0 < plan.rows; row0 += plan.chunk) {
    const int64_t n = std::min(plan.chunk, plan.rows - row0);
    const MatrixView h = rows_of(hidden, row0, n);
    const MatrixView logits{memory, n, plan.vocab_local, plan.stride, plan.dtype, Device::CPU};
    if (steps.prefill) steps.prefill(logits, row0, nullptr);
    gemm(h, false, weight, true, logits, bool(steps.prefill));  // [n, V] (+)= h @ W^T
    core::lce_run_steps(plan, steps, logits, row0, nullptr);
    if (!with_grads) continue;
    gemm(logits, false, weight, false, rows_of(grads.dhidden, row0, n),
         grads.accumulate_dhidden);                                           // G @ W
    gemm(logits, true, h, false, grads.dweight, true);                           // G^T @ h
  }
}

void lce_fill_bias(const MatrixView& logits, const VectorView& bias) {
  core::dispatch_dtype(logits.dtype, [&](auto kl) {
    core::dispatch_dtype(bias.dtype, [&](auto kb) {
      constexpr core::StorageKind KL = decltype(kl)::value, KB = decltype(kb)::value;
      const auto* b = static_cast<const core::Elem<KB>*>(bias.data);
#pragma omp parallel for schedule(static) if (worth_threads(logits.rows * logits.cols))
      for (int64_t r = 0; r < logits.rows; ++r) {
        auto* row = static_cast<core::Elem<KL>*>(logits.data) + r * logits.row_stride;
        for (int64_t c = 0; c < logits.cols; ++c) row[c] = core::lce_bias_start<KL, KB>(b[c]);
      }
    });
  });
}

void lce_add_column_sums(const MatrixView& g, float* acc) {
  core::dispatch_dtype(g.dtype, [&](auto kg) {
    constexpr core::StorageKind KG = decltype(kg)::value;
    const auto* data = static_cast<const core::Elem<KG>*>(g.data);
#pragma omp parallel for schedule(static) if (worth_threads(g.rows * g.cols))
    for (int64_t c = 0; c < g.cols; ++c)
      acc[c] = core::lce_column_sum<KG>(data, g.row_stride, g.rows, c, acc[c]);
  });
}

void lce_scale(const MatrixView& src, const MatrixView& dst, const float* scale, bool accumulate) {
  const float s = scale[0];
  for (int64_t r = 0; r < src.rows; ++r)
    for (int64_t c = 0; c < src.cols; ++c)
      store(dst, r, c, s * load(src, r, c) + (accumulate ? load(dst, r, c) : 0.0f));
}

float lce_row_weight_scale(const float* grad_loss, const float* row_weight, int64_t n) {
  int64_t first = 0;
  while (first < n && row_weight[first] == 0.0f) ++first;
  const float c = first < n ? core::row_weight_scale(grad_loss[first], row_weight[first]) : 0.0f;
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(grad_loss[i])) return std::nanf("");
  for (int64_t i = 0; i < n; ++i)
    detail::require(core::fits_row_weight(grad_loss[i], row_weight[i], c),
                    "linear_cross_entropy_backward: grad_loss[", i, "]: got ", grad_loss[i],
                    " where row_weight[", i, "] (Python: loss_mask) is ", row_weight[i],
                    ", expected c * row_weight (here c = ", c, ", from row ", first, ")",
                    core::kNotRowWeightedWhy);
  return c;
}

}  // namespace fusedloss::cpu
