// cpu::gemm through the BLAS the build found (cblas_sgemm). fp32 operands are read in place;
// fp16 / bf16 ones are converted (exactly) into fp32 tiles in the caller's stage, and a 16-bit
// C accumulates in an fp32 tile, rounded once into C when its tile is done. Two bf16 operands
// go to oneDNN first where the build has it (gemm_dnnl.cpp).
#include "cpu/gemm_cpu.h"

#include <cblas.h>
#include <algorithm>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "common/error.h"
#include "core/dispatch.h"
#include "core/linear_ce_plan.h"
#include "cpu/parallel.h"

namespace fusedloss::cpu {
namespace {

// k per BLAS call when tiles are staged: as deep as OpenBLAS's own panels, so splitting k costs
// one more pass over C's tile per 256 terms (1/512 of the flops), and the staged tiles stay
// short enough to leave the budget to m and n (each tile of A is converted once per column
// tile of C, each of B once per row tile).
constexpr int64_t kDepth = 256;
// Tiles never shrink below this (a stage of 3 * 16 * 16 floats always fits one).
constexpr int64_t kLeast = 16;
// Nor grow beyond this: BLAS takes its sizes as int.
constexpr int64_t kMost = int64_t(1) << 30;

bool staged(const MatrixView& m) { return m.dtype != DType::F32; }

// A tile of a view, rows [r0, r0 + rows) x columns [c0, c0 + cols), as BLAS reads it.
struct Tile {
  float* data;
  int64_t ld;
};

// In place when fp32; else into `stage` as rows of `cols` floats (converted when `fill`).
Tile tile_of(const MatrixView& m, int64_t r0, int64_t c0, int64_t rows, int64_t cols, float* stage,
             bool fill) {
  if (!staged(m)) {  // a view of one row may have any stride; BLAS wants ld >= cols
    const int64_t ld = std::max(m.row_stride, m.cols);
    detail::require(ld <= kMost, "cpu gemm: row_stride ", ld, ", expected at most ", kMost,
                    " (BLAS takes int)");
    return {static_cast<float*>(m.data) + r0 * m.row_stride + c0, ld};
  }
  if (fill)
    core::dispatch_dtype(m.dtype, [&](auto kind) {
      constexpr core::StorageKind K = decltype(kind)::value;
      const auto* src = static_cast<const core::Elem<K>*>(m.data);
#pragma omp parallel for schedule(static) if (worth_threads(rows * cols))
      for (int64_t r = 0; r < rows; ++r) {
        const auto* s = src + (r0 + r) * m.row_stride + c0;
        float* d = stage + r * cols;
        for (int64_t c = 0; c < cols; ++c) d[c] = core::St<K>::load(s[c]);
      }
    });
  return {stage, cols};
}

// A staged tile of C back into C, each element rounded once into C's dtype.
void store_tile(const MatrixView& m, int64_t r0, int64_t c0, int64_t rows, int64_t cols,
                const float* stage) {
  core::dispatch_dtype(m.dtype, [&](auto kind) {
    constexpr core::StorageKind K = decltype(kind)::value;
    auto* dst = static_cast<core::Elem<K>*>(m.data);
#pragma omp parallel for schedule(static) if (worth_threads(rows * cols))
    for (int64_t r = 0; r < rows; ++r) {
      auto* d = dst + (r0 + r) * m.row_stride + c0;
      const float* s = stage + r * cols;
      for (int64_t c = 0; c < cols; ++c) d[c] = core::St<K>::store(s[c]);
    }
  });
}

// OpenBLAS built on pthreads runs its own pool beside OpenMP's: sized to OpenMP's setting, the
// two take turns on the same number of cores. Its OpenMP build (launch/deps.sh installs that
// one) reads omp_get_max_threads() at every call, and runs one thread inside a parallel region.
void match_openmp_threads() {
#if defined(FUSEDLOSS_OPENBLAS) && defined(_OPENMP)
  if (openblas_get_parallel() != 1) return;  // 0: sequential, 1: pthreads, 2: OpenMP
  const int threads = omp_get_max_threads();
  if (openblas_get_num_threads() != threads) openblas_set_num_threads(threads);
#endif
}

// The tile sizes for `stage_floats`: whole dimensions when nothing is staged, else k in kDepth
// and the larger of m and n halved until the staged tiles fit.
struct Tiling {
  int64_t m, n, k;
};

Tiling tiling(int64_t m, int64_t n, int64_t k, bool sa, bool sb, bool sc, int64_t stage_floats) {
  Tiling t{std::min(m, kMost), std::min(n, kMost), std::min(k, kMost)};
  if (!sa && !sb && !sc) return t;  // nothing staged: one call (below 2^30 a side)
  t.k = std::min(k, kDepth);
  const auto need = [&] { return (sa ? t.m * t.k : 0) + (sb ? t.k * t.n : 0) + (sc ? t.m * t.n : 0); };
  const auto halve = [](int64_t x) { return std::max(kLeast, core::round_up((x + 1) / 2, kLeast)); };
  while (need() > stage_floats) {
    if (std::max(t.m, t.n) > kLeast) {
      if (t.m >= t.n) t.m = halve(t.m);
      else t.n = halve(t.n);
    } else if (t.k > kLeast) {
      t.k = halve(t.k);
    } else {
      break;
    }
  }
  detail::require(need() <= stage_floats, "cpu gemm: stage of ", stage_floats,
                  " floats, expected at least ", need(), " for tiles of ", t.m, " x ", t.n,
                  " x ", t.k);
  return t;
}

}  // namespace

void gemm(const MatrixView& A, bool ta, const MatrixView& B, bool tb, const MatrixView& C,
          bool accumulate, GemmStage stage) {
  const int64_t m = C.rows, n = C.cols, k = ta ? A.rows : A.cols;
  if (m == 0 || n == 0) return;
#ifdef FUSEDLOSS_DNNL
  if (gemm_bf16(A, ta, B, tb, C, accumulate)) return;
#endif
  const bool sa = staged(A), sb = staged(B), sc = staged(C);
  const Tiling t = tiling(m, n, k, sa, sb, sc, stage.floats);
  float* const a_stage = stage.data;
  float* const b_stage = a_stage + (sa ? t.m * t.k : 0);
  float* const c_stage = b_stage + (sb ? t.k * t.n : 0);
  match_openmp_threads();
  for (int64_t i0 = 0; i0 < m; i0 += t.m)
    for (int64_t j0 = 0; j0 < n; j0 += t.n) {
      const int64_t mi = std::min(t.m, m - i0), nj = std::min(t.n, n - j0);
      const Tile c = tile_of(C, i0, j0, mi, nj, c_stage, accumulate);
      if (k == 0 && !accumulate)  // no terms: C = 0 (BLAS is not called with k = 0)
        for (int64_t r = 0; r < mi; ++r) std::fill_n(c.data + r * c.ld, nj, 0.0f);
      for (int64_t q0 = 0; q0 < k; q0 += t.k) {
        const int64_t qk = std::min(t.k, k - q0);
        // op(X)'s tile is the stored tile with rows and columns swapped when X is transposed
        const Tile a = ta ? tile_of(A, q0, i0, qk, mi, a_stage, true)
                          : tile_of(A, i0, q0, mi, qk, a_stage, true);
        const Tile b = tb ? tile_of(B, j0, q0, nj, qk, b_stage, true)
                          : tile_of(B, q0, j0, qk, nj, b_stage, true);
        const float beta = accumulate || q0 > 0 ? 1.0f : 0.0f;
        cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                    int(mi), int(nj), int(qk), 1.0f, a.data, int(a.ld), b.data, int(b.ld), beta,
                    c.data, int(c.ld));
      }
      if (sc) store_tile(C, i0, j0, mi, nj, c.data);
    }
}

}  // namespace fusedloss::cpu
