// Element access to a host MatrixView of a runtime dtype, for the CPU backend's loops over
// matrices of any of the GEMM dtypes (fp32, fp16, bf16).
#pragma once
#include <cstdint>
#include "common/error.h"
#include "core/numeric.h"
#include "cpu/parallel.h"
#include "fusedloss/types.h"

namespace fusedloss::cpu {

inline float load(const MatrixView& m, int64_t r, int64_t c) {
  const int64_t i = r * m.row_stride + c;
  switch (m.dtype) {
    case DType::F32: return static_cast<const float*>(m.data)[i];
    case DType::F16: return core::half_to_float(static_cast<const uint16_t*>(m.data)[i]);
    case DType::BF16: return core::bf16_to_float(static_cast<const uint16_t*>(m.data)[i]);
    default: break;
  }
  detail::fail("cpu matrix: dtype ", to_string(m.dtype), " is not fp32, fp16 or bf16");
}

inline void store(const MatrixView& m, int64_t r, int64_t c, float v) {
  const int64_t i = r * m.row_stride + c;
  switch (m.dtype) {
    case DType::F32: static_cast<float*>(m.data)[i] = v; return;
    case DType::F16: static_cast<uint16_t*>(m.data)[i] = core::float_to_half(v); return;
    case DType::BF16: static_cast<uint16_t*>(m.data)[i] = core::float_to_bf16(v); return;
    default: break;
  }
  detail::fail("cpu matrix: dtype ", to_string(m.dtype), " is not fp32, fp16 or bf16");
}

// m = 0.
inline void zero(const MatrixView& m) {
#pragma omp parallel for schedule(static) if (worth_threads(m.rows * m.cols))
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) store(m, r, c, 0.0f);
}

// Class index r of a host index vector (int32 or int64), widened.
inline int64_t index_at(const IndexView& t, int64_t r) {
  return t.type == IndexType::I32 ? int64_t(static_cast<const int32_t*>(t.data)[r])
                                  : static_cast<const int64_t*>(t.data)[r];
}

// A row's columns in blocks, each summed alone, then the blocks combined in order: the fp32 sums
// (lse's and the entropy's) carry the rounding of about kSumBlock + cols / kSumBlock additions
// instead of cols, as the CUDA kernels' threads do. At V 50257 a sequential sum left the log-prob
// head's dhidden 30 times torch's error (fp32).
constexpr int64_t kSumBlock = 256;

// Rows [row0, row0 + rows) of m.
inline MatrixView rows_of(const MatrixView& m, int64_t row0, int64_t rows) {
  MatrixView v = m;
  v.data = static_cast<char*>(m.data) + row0 * m.row_stride * detail::element_size(m.dtype);
  v.rows = rows;
  return v;
}

}  // namespace fusedloss::cpu
