#include "cpu/cross_entropy_cpu.h"

#include <algorithm>
#include <cmath>
#include <vector>
#include "core/dispatch.h"
#include "cpu/matrix_cpu.h"
#include "cpu/vector_rows.h"

namespace fusedloss::cpu {
namespace {

// The row passes' span: a row's floats in L1 at a time, and its partial sums' length.
constexpr int64_t kSpan = 1024;

using core::StorageKind;
using core::TargetKind;

TargetKind classify(const IndexView& t, int64_t r, const core::CeParams& p) {
  return core::classify_target(index_at(t, r), p.ignore_index, p.vocab_start, p.vocab_local,
                               p.vocab_global);
}

template <StorageKind K>
void local_stats_impl(const MatrixView& x, const IndexView& target, const core::CeParams& p,
                      RowStats* stats) {
  using S = core::Storage<K>;
  const auto* base = static_cast<const typename S::type*>(x.data);
#pragma omp parallel for schedule(static) if (worth_threads(x.rows * x.cols))
  for (int64_t r = 0; r < x.rows; ++r) {
    const auto* row = base + r * x.row_stride;
    float m = -INFINITY, s = 0.0f, sx = 0.0f;
    // Partial sums over spans of a row merged at the end, as the kernels' threads' are: one
    // fp32 sum along a row of 10^5 and more terms would drift past fp32's ~1e-5 (the kernels'
    // sums have a few hundred terms each). Each span in two vectorised loops over its floats
    // (in L1): its max, then its sum-exp and sum; the spans' pairs merge online.
    float v[kSpan];
    for (int64_t start = 0; start < x.cols; start += kSpan) {
      const int64_t len = std::min(x.cols - start, kSpan);
      for (int64_t i = 0; i < len; ++i) v[i] = core::cap_logit(S::load(row[start + i]), p.softcap);
      float ms, ss, sxs;
      span_stats(v, len, &ms, &ss, &sxs);
      core::online_merge(m, s, ms, ss);
      sx += sxs;
    }
    int64_t t = index_at(target, r);
    bool local = classify(target, r, p) == TargetKind::Local;
    stats[r] = RowStats{m, s, local ? core::cap_logit(S::load(row[t - p.vocab_start]), p.softcap) : -INFINITY,
                        p.need_sum_logits ? sx : 0.0f};
  }
}

template <StorageKind K>
void backward_impl(const MatrixView& x, const IndexView& target, const float* lse,
                   const float* grad_loss, const float* valid_count, const core::CeParams& p,
                   const MatrixView& grad) {
  using S = core::Storage<K>;
  const auto* in = static_cast<const typename S::type*>(x.data);
  auto* out = static_cast<typename S::type*>(grad.data);
#pragma omp parallel for schedule(static) if (worth_threads(x.rows * x.cols))
  for (int64_t r = 0; r < x.rows; ++r) {
    const auto* xr = in + r * x.row_stride;
    auto* gr = out + r * grad.row_stride;
    TargetKind kind = classify(target, r, p);
    if (kind == TargetKind::Ignored || kind == TargetKind::OutOfRange) {
      for (int64_t j = 0; j < x.cols; ++j) gr[j] = S::store(0.0f);
      continue;
    }
    const float dl = core::row_grad_scale(p, grad_loss, valid_count, r);
    core::GradRow g = core::make_grad_row(lse[r], dl, p.smoothing, p.z_loss);
    int64_t local_target = kind == TargetKind::Local ? index_at(target, r) - p.vocab_start : -1;
    if (p.softcap > 0.0f) {
      for (int64_t j = 0; j < x.cols; ++j)
        gr[j] = S::store(core::capped_grad_element(g, S::load(xr[j]), j == local_target, p.softcap));
      continue;
    }
    // Every column as a non-target one (grad_element's form) in the vectorised span loop, then
    // the target's again (an in-place gradient has overwritten its logit: read it first).
    const float xt = local_target >= 0 ? S::load(xr[local_target]) : 0.0f;
    if constexpr (K == StorageKind::F32) {
      softmax_grad_span(xr, gr, x.cols, g.lse, g.p_scale, g.smooth);
    } else {
      float v[kSpan];
      for (int64_t start = 0; start < x.cols; start += kSpan) {
        const int64_t len = std::min(x.cols - start, kSpan);
        for (int64_t i = 0; i < len; ++i) v[i] = S::load(xr[start + i]);
        softmax_grad_span(v, v, len, g.lse, g.p_scale, g.smooth);
        for (int64_t i = 0; i < len; ++i) gr[start + i] = S::store(v[i]);
      }
    }
    if (local_target >= 0) gr[local_target] = S::store(core::grad_element(g, xt, true));
  }
}

}  // namespace

int64_t first_bad_target(const IndexView& target, const core::CeParams& p, int64_t* value) {
  for (int64_t r = 0; r < target.size; ++r) {
    if (classify(target, r, p) == TargetKind::OutOfRange) {
      *value = index_at(target, r);
      return r;
    }
  }
  return -1;
}

void ce_local_stats(const MatrixView& logits, const IndexView& target, const core::CeParams& p,
                    RowStats* stats) {
  core::dispatch_dtype(logits.dtype, [&](auto k) {
    local_stats_impl<decltype(k)::value>(logits, target, p, stats);
  });
}

void ce_prepare_sum(const RowStats* local, const float* global_max, const IndexView& target,
                    const core::CeParams& p, int rank, RowStats* summable) {
  for (int64_t r = 0; r < p.rows; ++r) {
    bool owner = classify(target, r, p) == TargetKind::Local;
    summable[r] = core::summable_row(local[r], global_max[r], owner, rank);
  }
}

void ce_merge(const RowStats* combined, int parts, const RowStats* local, const IndexView& target,
              const core::CeParams& p, const CrossEntropyOutputs& out, float* row_scratch) {
  const int64_t rows = p.rows;
  // Per-row losses go to out.loss directly for Reduction::None, else to scratch.
  const bool reduce = p.reduction != Reduction::None;
  std::vector<float> scratch(reduce && !row_scratch ? rows : 0);
  float* row_losses = !reduce ? out.loss : row_scratch ? row_scratch : scratch.data();
  for (int64_t r = 0; r < rows; ++r) {
    core::finish_row(core::merge_row(combined, parts, rows, r), core::own_sum_logits(local, r, p),
                     classify(target, r, p), p, out.lse[r], row_losses[r]);
  }
  ce_reduce(row_losses, target, p, out);
}

void ce_reduce(const float* row_losses, const IndexView& target, const core::CeParams& p,
               const CrossEntropyOutputs& out) {
  // Deterministic reductions: a fixed-order sum in double.
  double total = 0.0;
  int64_t valid = 0;
  for (int64_t r = 0; r < p.rows; ++r) {
    if (classify(target, r, p) == TargetKind::Ignored) continue;
    ++valid;
    total += row_losses ? row_losses[r] : 0.0f;
  }
  if (out.valid_count) out.valid_count[0] = float(valid);
  if (p.reduction == Reduction::Sum) out.loss[0] = float(total);
  if (p.reduction == Reduction::Mean) out.loss[0] = valid ? float(total / double(valid)) : 0.0f;
}

void ce_backward(const MatrixView& logits, const IndexView& target, const float* lse,
                 const float* grad_loss, const float* valid_count, const core::CeParams& p,
                 const MatrixView& grad) {
  core::dispatch_dtype(logits.dtype, [&](auto k) {
    backward_impl<decltype(k)::value>(logits, target, lse, grad_loss, valid_count, p, grad);
  });
}

void ce_scale_grad(const MatrixView& grad, const float* grad_loss) {
  const float scale = grad_loss[0];
  if (scale == 1.0f) return;  // the common case: the gradient the forward wrote is final
  core::dispatch_dtype(grad.dtype, [&](auto k) {
    using S = core::Storage<decltype(k)::value>;
    auto* g = static_cast<typename S::type*>(grad.data);
#pragma omp parallel for schedule(static) if (worth_threads(grad.rows * grad.cols))
    for (int64_t r = 0; r < grad.rows; ++r)
      for (int64_t j = 0; j < grad.cols; ++j) {
        auto& e = g[r * grad.row_stride + j];
        e = S::store(S::load(e) * scale);
      }
  });
}

}  // namespace fusedloss::cpu
