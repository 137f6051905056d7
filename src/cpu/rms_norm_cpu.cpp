#include "cpu/rms_norm_cpu.h"

#include <algorithm>
#include <vector>
#include "core/dispatch.h"
#include "cpu/parallel.h"

namespace fusedloss::cpu {
namespace {

using core::StorageKind;
using core::Elem;
using core::St;

// gamma of every column in fp32 (the weight in any allowed dtype).
std::vector<float> gammas(const core::RmsNormParams& p) {
  std::vector<float> g(p.hidden);
  core::dispatch_dtype(p.weight_dtype, [&](auto k) {
    constexpr StorageKind W = decltype(k)::value;
    const auto* w = static_cast<const Elem<W>*>(p.weight);
    for (int64_t c = 0; c < p.hidden; ++c) g[c] = core::rms_gamma(St<W>::load(w[c]), p.zero_centered_gamma);
  });
  return g;
}

template <StorageKind X>
void forward_impl(const MatrixView& x, const core::RmsNormParams& p, const MatrixView& y,
                  float* rstd, const MatrixView& residual, const MatrixView& residual_out) {
  const std::vector<float> g = gammas(p);
  const int64_t H = p.hidden;
#pragma omp parallel for schedule(static) if (worth_threads(p.rows * H))
  for (int64_t r = 0; r < p.rows; ++r) {
    const auto* xr = static_cast<const Elem<X>*>(x.data) + r * x.row_stride;
    auto* yr = static_cast<Elem<X>*>(y.data) + r * y.row_stride;
    std::vector<float> s(H);
    for (int64_t c = 0; c < H; ++c) s[c] = St<X>::load(xr[c]);
    if (residual.data) {
      const auto* rr = static_cast<const Elem<X>*>(residual.data) + r * residual.row_stride;
      auto* so = static_cast<Elem<X>*>(residual_out.data) + r * residual_out.row_stride;
      // s is stored in x's dtype and the backward reads it from there: normalise the stored value
      for (int64_t c = 0; c < H; ++c) {
        so[c] = St<X>::store(s[c] + St<X>::load(rr[c]));
        s[c] = St<X>::load(so[c]);
      }
    }
    double ss = 0.0;
    for (int64_t c = 0; c < H; ++c) ss += double(s[c]) * s[c];
    const float rs = core::rms_rstd(float(ss), H, p.eps);
    rstd[r] = rs;
    for (int64_t c = 0; c < H; ++c) yr[c] = St<X>::store(core::rms_y(s[c], rs, g[c]));
  }
}

// Rows are split into a fixed number of chunks (whatever the thread count), each with its own
// weight-gradient partial; the partials are added in chunk order: deterministic.
constexpr int64_t kChunks = 64;

template <StorageKind X>
void backward_impl(const MatrixView& grad_y, const MatrixView& xs, const core::RmsNormParams& p,
                   const float* rstd, const MatrixView& grad_x, void* grad_weight,
                   DType gw_dtype, const MatrixView& gres) {
  const std::vector<float> g = gammas(p);
  const int64_t H = p.hidden, chunks = std::min<int64_t>(kChunks, std::max<int64_t>(p.rows, 1));
  std::vector<double> partial(chunks * H, 0.0);
#pragma omp parallel for schedule(static) if (worth_threads(p.rows * H))
  for (int64_t k = 0; k < chunks; ++k) {
    const int64_t r0 = p.rows * k / chunks, r1 = p.rows * (k + 1) / chunks;
    double* dg = &partial[k * H];
    std::vector<float> xhat(H), dy(H);
    for (int64_t r = r0; r < r1; ++r) {
      const auto* xr = static_cast<const Elem<X>*>(xs.data) + r * xs.row_stride;
      const auto* gr = static_cast<const Elem<X>*>(grad_y.data) + r * grad_y.row_stride;
      auto* dr = static_cast<Elem<X>*>(grad_x.data) + r * grad_x.row_stride;
      const float rs = rstd[r];
      double dot = 0.0;
      for (int64_t c = 0; c < H; ++c) {
        xhat[c] = St<X>::load(xr[c]) * rs;
        dy[c] = St<X>::load(gr[c]);
        dot += double(dy[c]) * g[c] * xhat[c];
        dg[c] += double(dy[c]) * xhat[c];
      }
      const float mean = core::rms_dot_mean(float(dot), H);
      for (int64_t c = 0; c < H; ++c) {
        float v = core::rms_grad_s(xhat[c], dy[c], g[c], rs, mean);
        if (gres.rows)
          v += St<X>::load(static_cast<const Elem<X>*>(gres.data)[r * gres.row_stride + c]);
        dr[c] = St<X>::store(v);  // in place: xr[c], gr[c] and the residual's were read above
      }
    }
  }
  core::dispatch_dtype(gw_dtype, [&](auto kw) {
    constexpr StorageKind W = decltype(kw)::value;
    for (int64_t c = 0; c < H; ++c) {
      double s = 0.0;
      for (int64_t k = 0; k < chunks; ++k) s += partial[k * H + c];
      static_cast<Elem<W>*>(grad_weight)[c] = St<W>::store(float(s));  // fp32, rounded once
    }
  });
}

}  // namespace

void rms_norm_forward(const MatrixView& x, const core::RmsNormParams& p, const MatrixView& y,
                      float* rstd, const MatrixView& residual, const MatrixView& residual_out) {
  core::dispatch_dtype(x.dtype, [&](auto k) {
    forward_impl<decltype(k)::value>(x, p, y, rstd, residual, residual_out);
  });
}

void rms_norm_backward(const MatrixView& grad_y, const MatrixView& x_or_s,
                       const core::RmsNormParams& p, const float* rstd, const MatrixView& grad_x,
                       void* grad_weight, DType grad_weight_dtype,
                       const MatrixView& grad_residual_out) {
  core::dispatch_dtype(x_or_s.dtype, [&](auto k) {
    backward_impl<decltype(k)::value>(grad_y, x_or_s, p, rstd, grad_x, grad_weight,
                                      grad_weight_dtype, grad_residual_out);
  });
}

}  // namespace fusedloss::cpu
