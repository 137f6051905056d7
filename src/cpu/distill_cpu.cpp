#include "cpu/distill_cpu.h"

#include <algorithm>
#include <cmath>
#include <vector>
#include "core/dispatch.h"
#include "cpu/matrix_cpu.h"

namespace fusedloss::cpu {
namespace {

// -1: the row counts and has no target (none given); -2: ignored; else its target.
int64_t row_target(const IndexView& t, int64_t r, int64_t ignore_index) {
  if (t.data == nullptr) return -1;
  const int64_t v = index_at(t, r);
  return v == ignore_index ? -2 : v;
}

// Both dtypes' loops, each row's loads through its storage kind: f(SS, ST, s_data, t_data).
template <class F>
void for_pair(const MatrixView& xs, const MatrixView& xt, F&& f) {
  core::dispatch_dtype(xs.dtype, [&](auto ks) {
    core::dispatch_dtype(xt.dtype, [&](auto kt) {
      using SS = core::Storage<decltype(ks)::value>;
      using ST = core::Storage<decltype(kt)::value>;
      f(SS{}, ST{}, static_cast<typename SS::type*>(xs.data),
        static_cast<const typename ST::type*>(xt.data));
    });
  });
}

}  // namespace

void distill_partials(const MatrixView& xs, const MatrixView& xt, const IndexView& target,
                      int64_t vocab_start, const core::DistillParams& p,
                      core::DistillPartial* partials) {
  for_pair(xs, xt, [&](auto ss, auto st, const auto* s_data, const auto* t_data) {
    using SS = decltype(ss);
    using ST = decltype(st);
#pragma omp parallel for schedule(static) if (worth_threads(xs.rows * xs.cols))
    for (int64_t r = 0; r < xs.rows; ++r) {
      const auto* sr = s_data + r * xs.row_stride;
      const auto* tr = t_data + r * xt.row_stride;
      // summed in blocks (kSumBlock), the blocks merged: a sequential fp32 sum over the whole
      // vocabulary would lose digits
      core::DistillPartial row = core::distill_empty();
      for (int64_t j0 = 0; j0 < xs.cols; j0 += kSumBlock) {
        core::DistillPartial block = core::distill_empty();
        for (int64_t j = j0; j < std::min(j0 + kSumBlock, xs.cols); ++j) {
          core::distill_add(p, block, SS::load(sr[j]), ST::load(tr[j]));
        }
        row = core::distill_combine(p, row, block);
      }
      const int64_t local = (target.data ? index_at(target, r) : -1) - vocab_start;
      if (local >= 0 && local < xs.cols) row.target = SS::load(sr[local]);
      partials[r] = row;
    }
  });
}

void distill_merge(const core::DistillPartial* partials, int world, int64_t rows,
                   const IndexView& target, int64_t ignore_index, const core::DistillParams& p,
                   DistillRowStats* stats, float* loss) {
#pragma omp parallel for schedule(static) if (worth_threads(rows * world * 64))
  for (int64_t r = 0; r < rows; ++r) {
    if (row_target(target, r, ignore_index) == -2) {
      stats[r] = DistillRowStats{};
      loss[r] = 0.0f;
      continue;
    }
    core::distill_merge_row(p, partials, world, rows, r, target.data != nullptr, stats[r], loss[r]);
  }
}

void distill_jsd_sums(const MatrixView& xs, const MatrixView& xt, const core::DistillParams& p,
                      const DistillRowStats* stats, float* sums) {
  for_pair(xs, xt, [&](auto ss, auto st, const auto* s_data, const auto* t_data) {
    using SS = decltype(ss);
    using ST = decltype(st);
#pragma omp parallel for schedule(static) if (worth_threads(xs.rows * xs.cols))
    for (int64_t r = 0; r < xs.rows; ++r) {
      const auto* sr = s_data + r * xs.row_stride;
      const auto* tr = t_data + r * xt.row_stride;
      double soft = 0.0, soft_student = 0.0;  // the host sums in double: the reference
      for (int64_t j = 0; j < xs.cols; ++j) {
        float a = 0.0f, b = 0.0f;
        core::distill_jsd_terms(p, stats[r], SS::load(sr[j]), ST::load(tr[j]), a, b);
        soft += a;
        soft_student += b;
      }
      sums[2 * r] = float(soft);
      sums[2 * r + 1] = float(soft_student);
    }
  });
}

void distill_add_jsd(const float* sums, int64_t rows, const IndexView& target,
                     int64_t ignore_index, const core::DistillParams& p, DistillRowStats* stats,
                     float* loss) {
  for (int64_t r = 0; r < rows; ++r) {
    if (row_target(target, r, ignore_index) == -2) continue;
    stats[r].soft = sums[2 * r];
    stats[r].soft_student = sums[2 * r + 1];
    loss[r] += (1.0f - p.hard_weight) * stats[r].soft;
  }
}

void distill_rows(const MatrixView& xs, const MatrixView& xt, const IndexView& target,
                  int64_t ignore_index, const core::DistillParams& p, float* loss,
                  DistillRowStats* stats) {
  std::vector<core::DistillPartial> partials(size_t(xs.rows));
  distill_partials(xs, xt, target, 0, p, partials.data());
  distill_merge(partials.data(), 1, xs.rows, target, ignore_index, p, stats, loss);
  if (p.divergence != Divergence::JSD) return;
  std::vector<float> sums(size_t(2 * xs.rows));
  distill_jsd_sums(xs, xt, p, stats, sums.data());
  distill_add_jsd(sums.data(), xs.rows, target, ignore_index, p, stats, loss);
}

void distill_gradient(const MatrixView& xs, const MatrixView& xt, const IndexView& target,
                      int64_t vocab_start, int64_t ignore_index, const core::DistillParams& p,
                      const DistillRowStats* stats, const float* grad_loss) {
  for_pair(xs, xt, [&](auto ss, auto st, auto* s_data, const auto* t_data) {
    using SS = decltype(ss);
    using ST = decltype(st);
#pragma omp parallel for schedule(static) if (worth_threads(xs.rows * xs.cols))
    for (int64_t r = 0; r < xs.rows; ++r) {
      auto* sr = s_data + r * xs.row_stride;
      const auto* tr = t_data + r * xt.row_stride;
      const int64_t tgt = row_target(target, r, ignore_index);
      const float g = tgt == -2 ? 0.0f : grad_loss ? grad_loss[r] : 1.0f;
      for (int64_t j = 0; j < xs.cols; ++j)
        sr[j] = SS::store(tgt == -2 ? 0.0f
                                    : core::distill_grad(p, stats[r], SS::load(sr[j]),
                                                         ST::load(tr[j]), vocab_start + j == tgt,
                                                         g));
    }
  });
}

}  // namespace fusedloss::cpu
