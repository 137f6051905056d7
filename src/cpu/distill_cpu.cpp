#include "cpu/distill_cpu.h"

#include <algorithm>
#include <cmath>
#include "core/cross_entropy_math.h"
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

float lse_of(float m, float s) { return m == -INFINITY ? -INFINITY : m + std::log(s); }

// Both dtypes' loops, each row's loads through its storage kind.
template <class F>
void dispatch_pair(DType a, DType b, F&& f) {
  core::dispatch_dtype(a, [&](auto ka) {
    core::dispatch_dtype(b, [&](auto kb) { f(ka, kb); });
  });
}

}  // namespace

void distill_forward(const MatrixView& xs, const MatrixView& xt, const IndexView& target,
                     int64_t ignore_index, const core::DistillParams& p, float* loss,
                     DistillRowStats* stats) {
  dispatch_pair(xs.dtype, xt.dtype, [&](auto ks, auto kt) {
    using SS = core::Storage<decltype(ks)::value>;
    using ST = core::Storage<decltype(kt)::value>;
    const auto* s_data = static_cast<const typename SS::type*>(xs.data);
    const auto* t_data = static_cast<const typename ST::type*>(xt.data);
#pragma omp parallel for schedule(static) if (worth_threads(xs.rows * xs.cols))
    for (int64_t r = 0; r < xs.rows; ++r) {
      const int64_t tgt = row_target(target, r, ignore_index);
      if (tgt == -2) {
        loss[r] = 0.0f;
        stats[r] = DistillRowStats{0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        continue;
      }
      const auto* sr = s_data + r * xs.row_stride;
      const auto* tr = t_data + r * xt.row_stride;
      // the three (max, sum-exp) pairs, each summed in blocks (kSumBlock)
      float ms = -INFINITY, ss = 0.0f, mt = -INFINITY, st = 0.0f, mz = -INFINITY, sz = 0.0f;
      for (int64_t j0 = 0; j0 < xs.cols; j0 += kSumBlock) {
        float bms = -INFINITY, bss = 0.0f, bmt = -INFINITY, bst = 0.0f, bmz = -INFINITY, bsz = 0.0f;
        for (int64_t j = j0; j < std::min(j0 + kSumBlock, xs.cols); ++j) {
          const float x = SS::load(sr[j]);
          core::online_add(bms, bss, x * p.inv_t);
          core::online_add(bmt, bst, ST::load(tr[j]) * p.inv_t);
          if (p.hard_weight > 0.0f) core::online_add(bmz, bsz, x);
        }
        core::online_merge(ms, ss, bms, bss);
        core::online_merge(mt, st, bmt, bst);
        core::online_merge(mz, sz, bmz, bsz);
      }
      DistillRowStats row{lse_of(ms, ss), lse_of(mt, st), lse_of(mz, sz), 0.0f, 0.0f};
      double soft = 0.0, soft_student = 0.0;  // the host sums in double: the reference
      for (int64_t j = 0; j < xs.cols; ++j) {
        float a = 0.0f, b = 0.0f;
        core::distill_soft_terms(p, SS::load(sr[j]) * p.inv_t - row.lse_student,
                                 ST::load(tr[j]) * p.inv_t - row.lse_teacher, a, b);
        soft += a;
        soft_student += b;
      }
      row.soft = float(soft);
      row.soft_student = float(soft_student);
      float l = (1.0f - p.hard_weight) * row.soft;
      if (p.hard_weight > 0.0f) l += p.hard_weight * (row.lse_hard - SS::load(sr[tgt]));
      loss[r] = l;
      stats[r] = row;
    }
  });
}

void distill_gradient(const MatrixView& xs, const MatrixView& xt, const IndexView& target,
                      int64_t ignore_index, const core::DistillParams& p,
                      const DistillRowStats* stats, const float* grad_loss) {
  dispatch_pair(xs.dtype, xt.dtype, [&](auto ks, auto kt) {
    using SS = core::Storage<decltype(ks)::value>;
    using ST = core::Storage<decltype(kt)::value>;
    auto* s_data = static_cast<typename SS::type*>(xs.data);
    const auto* t_data = static_cast<const typename ST::type*>(xt.data);
#pragma omp parallel for schedule(static) if (worth_threads(xs.rows * xs.cols))
    for (int64_t r = 0; r < xs.rows; ++r) {
      auto* sr = s_data + r * xs.row_stride;
      const auto* tr = t_data + r * xt.row_stride;
      const int64_t tgt = row_target(target, r, ignore_index);
      const float g = tgt == -2 ? 0.0f : grad_loss[r];
      for (int64_t j = 0; j < xs.cols; ++j)
        sr[j] = SS::store(tgt == -2 ? 0.0f
                                    : core::distill_grad(p, stats[r], SS::load(sr[j]),
                                                         ST::load(tr[j]) * p.inv_t, j == tgt, g));
    }
  });
}

}  // namespace fusedloss::cpu
