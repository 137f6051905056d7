#include "cpu/linear_ce_cpu.h"

#include <algorithm>
#include <vector>
#include "core/dispatch.h"
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

// A [rows, cols] matrix as dense floats (op(m): transposed when `t`).
std::vector<float> dense(const MatrixView& m, bool t) {
  std::vector<float> out(size_t(m.rows * m.cols));
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c)
      out[size_t(t ? c * m.rows + r : r * m.cols + c)] = load(m, r, c);
  return out;
}

// C[m, n] (+)= op(A)[m, k] @ op(B)[k, n], row-major views; double accumulation.
void gemm(const MatrixView& A, bool ta, const MatrixView& B, bool tb, const MatrixView& C,
          bool accumulate) {
  const int64_t m = C.rows, n = C.cols, k = ta ? A.rows : A.cols;
  const std::vector<float> a = dense(A, ta);   // [m, k]
  const std::vector<float> bt = dense(B, !tb);  // op(B)^T: [n, k]
#pragma omp parallel for schedule(static) if (worth_threads(m * n * k))
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = accumulate ? double(load(C, i, j)) : 0.0;
      const float* ar = &a[size_t(i * k)];
      const float* br = &bt[size_t(j * k)];
      for (int64_t q = 0; q < k; ++q) acc += double(ar[q]) * double(br[q]);
      store(C, i, j, float(acc));
    }
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
    gemm(h, false, weight, true, logits, false);  // [n, V] = h @ W^T
    core::lce_run_steps(plan, steps, logits, row0, nullptr);
    if (!with_grads) continue;
    gemm(logits, false, weight, false, rows_of(grads.dhidden, row0, n),
         grads.accumulate_dhidden);                                           // G @ W
    gemm(logits, true, h, false, grads.dweight, true);                           // G^T @ h
  }
}

void lce_scale(const MatrixView& src, const MatrixView& dst, const float* scale, bool accumulate) {
  const float s = scale[0];
  for (int64_t r = 0; r < src.rows; ++r)
    for (int64_t c = 0; c < src.cols; ++c)
      store(dst, r, c, s * load(src, r, c) + (accumulate ? load(dst, r, c) : 0.0f));
}

}  // namespace fusedloss::cpu
