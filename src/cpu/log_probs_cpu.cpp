#include "cpu/log_probs_cpu.h"

#include <algorithm>
#include <cmath>
#include "core/dispatch.h"
#include "core/log_probs_math.h"
#include "cpu/matrix_cpu.h"

namespace fusedloss::cpu {
void lp_local_stats(const MatrixView& x, const IndexView& tokens, float inv_t, int64_t vocab_start,
                    LogProbStats* stats) {
  core::dispatch_dtype(x.dtype, [&](auto kind) {
    constexpr core::StorageKind K = decltype(kind)::value;
    const auto* data = static_cast<const core::Elem<K>*>(x.data);
#pragma omp parallel for schedule(static) if (worth_threads(x.rows * x.cols))
    for (int64_t r = 0; r < x.rows; ++r) {
      const auto* row = data + r * x.row_stride;
      LogProbStats s = core::lp_empty();
      for (int64_t j0 = 0; j0 < x.cols; j0 += kSumBlock) {
        LogProbStats block = core::lp_empty();
        for (int64_t j = j0; j < std::min(j0 + kSumBlock, x.cols); ++j)
          core::lp_add(block, core::Storage<K>::load(row[j]) * inv_t, vocab_start + j);
        s = core::lp_combine(s, block);
      }
      const int64_t local = index_at(tokens, r) - vocab_start;
      if (local >= 0 && local < x.cols) s.target = core::Storage<K>::load(row[local]) * inv_t;
      stats[r] = s;
    }
  });
}

void lp_merge(const LogProbStats* stats, int world, int64_t rows, const IndexView& tokens,
              const LinearLogProbsOptions& o, const LinearLogProbsOutputs& out) {
  const int64_t vocab_global = o.vocab_global;
#pragma omp parallel for schedule(static) if (worth_threads(rows * world * 8))
  for (int64_t r = 0; r < rows; ++r) {
    LogProbStats s = stats[r];
    for (int k = 1; k < world; ++k) s = core::lp_combine(s, stats[int64_t(k) * rows + r]);
    const int64_t t = index_at(tokens, r);
    const bool ignored = t == o.ignore_index, valid = t >= 0 && t < vocab_global;
    const float lse = core::lp_lse(s);
    if (out.lse) out.lse[r] = lse;
    if (out.log_probs) out.log_probs[r] = ignored ? 0.0f : valid ? s.target - lse : NAN;
    if (out.entropy) out.entropy[r] = ignored ? 0.0f : valid ? core::lp_entropy(s) : NAN;
    if (out.argmax) out.argmax[r] = s.argmax;
  }
}

void lp_gradient(const MatrixView& x, const IndexView& tokens, const float* lse,
                 const float* entropy, const float* g, const float* e, float inv_t,
                 int64_t vocab_start, int64_t ignore_index) {
  core::dispatch_dtype(x.dtype, [&](auto kind) {
    constexpr core::StorageKind K = decltype(kind)::value;
    auto* data = static_cast<core::Elem<K>*>(x.data);
#pragma omp parallel for schedule(static) if (worth_threads(x.rows * x.cols))
    for (int64_t r = 0; r < x.rows; ++r) {
      auto* row = data + r * x.row_stride;
      const int64_t t = index_at(tokens, r);
      const float gr = g && t != ignore_index ? g[r] : 0.0f;
      const float er = e && t != ignore_index ? e[r] : 0.0f;
      const float h = entropy ? entropy[r] : 0.0f;
      for (int64_t j = 0; j < x.cols; ++j) {
        const float y = core::Storage<K>::load(row[j]) * inv_t;
        row[j] = core::Storage<K>::store(
            core::lp_grad(y, lse[r], h, vocab_start + j == t, gr, er, inv_t));
      }
    }
  });
}

}  // namespace fusedloss::cpu
