// cpu::gemm without a BLAS (the build found none): plain loops over the operands in place, in
// double, rounded once into C's dtype. Correct for any shape, not fast.
#include "cpu/gemm_cpu.h"

#include <algorithm>
#include "core/dispatch.h"
#include "cpu/matrix_cpu.h"
#include "cpu/parallel.h"

namespace fusedloss::cpu {
namespace {

// Element i of a GEMM operand stored as K, as float.
template <core::StorageKind K>
float read(const void* data, int64_t i) {
  return core::St<K>::load(static_cast<const core::Elem<K>*>(data)[i]);
}

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

}  // namespace

void gemm(const MatrixView& A, bool ta, const MatrixView& B, bool tb, const MatrixView& C,
          bool accumulate, GemmStage) {
  core::dispatch_dtype(A.dtype, [&](auto a) {
    core::dispatch_dtype(B.dtype, [&](auto b) {
      gemm_typed<decltype(a)::value, decltype(b)::value>(A, ta, B, tb, C, accumulate);
    });
  });
}

}  // namespace fusedloss::cpu
