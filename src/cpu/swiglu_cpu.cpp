#include "cpu/swiglu_cpu.h"

#include "core/dispatch.h"
#include "cpu/parallel.h"
#include "core/swiglu_math.h"

namespace fusedloss::cpu {
namespace {

using core::StorageKind;

using core::Elem;

// Bias column c in fp32, stored as fp32 or as V.
template <StorageKind V>
float bias_at(const core::SwigluParams& p, int64_t c) {
  if (p.bias_f32) return static_cast<const float*>(p.bias)[c];
  return core::Storage<V>::load(static_cast<const Elem<V>*>(p.bias)[c]);
}

// Gate and up of row r, column j, with the bias added (in fp32).
template <StorageKind Y, StorageKind V>
core::GateUp load_gate_up(const Elem<Y>* yr, int64_t j, const core::SwigluParams& p) {
  float g = core::Storage<Y>::load(yr[j]), u = core::Storage<Y>::load(yr[p.n + j]);
  if (p.bias) {
    g += bias_at<V>(p, j);
    u += bias_at<V>(p, p.n + j);
  }
  return core::gate_up(g, u, p.clamp);
}

template <StorageKind V>
void forward_impl(const MatrixView& y, const core::SwigluParams& p, const MatrixView& out,
                  const MatrixView& y_fp8) {
  auto* in = static_cast<const Elem<V>*>(y.data);
  auto* o = static_cast<Elem<V>*>(out.data);
  auto* f8 = static_cast<uint8_t*>(y_fp8.data);
#pragma omp parallel for schedule(static) if (worth_threads(p.rows * p.n))
  for (int64_t r = 0; r < p.rows; ++r) {
    const Elem<V>* yr = in + r * y.row_stride;
    const float w = p.weights ? p.weights[r] : 1.0f;
    for (int64_t j = 0; j < p.n; ++j)
      o[r * out.row_stride + j] =
          core::Storage<V>::store(core::swiglu_value(load_gate_up<V, V>(yr, j, p)) * w);
    if (f8)
      for (int64_t j = 0; j < 2 * p.n; ++j)
        f8[r * y_fp8.row_stride + j] =
            core::float_to_e4m3(core::Storage<V>::load(yr[j]), p.fp8_saturate);
  }
}

template <StorageKind Y, StorageKind V>
void backward_impl(const MatrixView& grad_out, const MatrixView& y, const core::SwigluParams& p,
                   const MatrixView& grad_y, float* grad_weights) {
  auto* go = static_cast<const Elem<V>*>(grad_out.data);
  auto* in = static_cast<const Elem<Y>*>(y.data);
  auto* gy = static_cast<Elem<V>*>(grad_y.data);
#pragma omp parallel for schedule(static) if (worth_threads(p.rows * p.n))
  for (int64_t r = 0; r < p.rows; ++r) {
    const Elem<Y>* yr = in + r * y.row_stride;
    Elem<V>* gr = gy + r * grad_y.row_stride;
    const float w = p.weights ? p.weights[r] : 1.0f;
    double dw = 0.0;
    for (int64_t j = 0; j < p.n; ++j) {
      core::GateUp v = load_gate_up<Y, V>(yr, j, p);
      float g = core::Storage<V>::load(go[r * grad_out.row_stride + j]);
      float da, db;
      float value = core::swiglu_grad(v, g * w, da, db);
      if (grad_weights) dw += double(value) * g;
      gr[j] = core::Storage<V>::store(da);  // in place: y[j] and y[n+j] were read above
      gr[p.n + j] = core::Storage<V>::store(db);
    }
    if (grad_weights) grad_weights[r] = float(dw);
  }
}

// Column sums of the stored gradient, row order fixed: deterministic.
template <StorageKind V>
void bias_grad_impl(const MatrixView& grad_y, const core::SwigluParams& p, float* grad_bias) {
  auto* gy = static_cast<const Elem<V>*>(grad_y.data);
#pragma omp parallel for schedule(static) if (worth_threads(p.rows * p.n))
  for (int64_t c = 0; c < 2 * p.n; ++c) {
    double s = 0.0;
    for (int64_t r = 0; r < p.rows; ++r) s += core::Storage<V>::load(gy[r * grad_y.row_stride + c]);
    grad_bias[c] = float(s);
  }
}

}  // namespace

void swiglu_forward(const MatrixView& y, const core::SwigluParams& p, const MatrixView& out,
                    const MatrixView& y_fp8) {
  core::dispatch_dtype(y.dtype, [&](auto k) { forward_impl<decltype(k)::value>(y, p, out, y_fp8); });
}

void swiglu_backward(const MatrixView& grad_out, const MatrixView& y, const core::SwigluParams& p,
                     const MatrixView& grad_y, float* grad_weights, float* grad_bias) {
  core::dispatch_dtype(grad_y.dtype, [&](auto k) {
    constexpr StorageKind V = decltype(k)::value;
    if (y.dtype == DType::FP8_E4M3)
      backward_impl<StorageKind::E4M3, V>(grad_out, y, p, grad_y, grad_weights);
    else
      backward_impl<V, V>(grad_out, y, p, grad_y, grad_weights);
    if (grad_bias) bias_grad_impl<V>(grad_y, p, grad_bias);
  });
}

}  // namespace fusedloss::cpu
