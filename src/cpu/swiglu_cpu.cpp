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

// Gate and up of row r, column j (gr, ur: the row's gate and up), with the bias added and the
// gate multiplier applied (in fp32).
template <StorageKind Y, StorageKind V>
core::GateUp load_gate_up(const Elem<Y>* gr, const Elem<Y>* ur, int64_t j,
                          const core::SwigluParams& p) {
  float g = core::Storage<Y>::load(gr[j]), u = core::Storage<Y>::load(ur[j]);
  if (p.bias) {
    g += bias_at<V>(p, j);
    u += bias_at<V>(p, p.n + j);
  }
  return core::gate_up(g, u, p.clamp, p.gate_multiplier);
}

template <StorageKind V>
const Elem<V>* row(const MatrixView& m, int64_t r) {
  return static_cast<const Elem<V>*>(m.data) + r * m.row_stride;
}

template <StorageKind V>
Elem<V>* row_out(const MatrixView& m, int64_t r) {
  return static_cast<Elem<V>*>(m.data) + r * m.row_stride;
}

template <StorageKind V>
void forward_impl(const core::GateUpViews& in, const core::SwigluParams& p, const MatrixView& out,
                  const core::GateUpViews& f8) {
#pragma omp parallel for schedule(static) if (worth_threads(p.rows * p.n))
  for (int64_t r = 0; r < p.rows; ++r) {
    const Elem<V>* gr = row<V>(in.gate, r);
    const Elem<V>* ur = row<V>(in.up, r);
    Elem<V>* o = row_out<V>(out, r);
    const float scale = (p.weights ? p.weights[r] : 1.0f) * p.down_multiplier;
    for (int64_t j = 0; j < p.n; ++j)
      o[j] = core::Storage<V>::store(core::swiglu_value(load_gate_up<V, V>(gr, ur, j, p)) * scale);
    if (f8.gate.data) {
      auto* fg = static_cast<uint8_t*>(f8.gate.data) + r * f8.gate.row_stride;
      auto* fu = static_cast<uint8_t*>(f8.up.data) + r * f8.up.row_stride;
      for (int64_t j = 0; j < p.n; ++j) {
        fg[j] = core::float_to_e4m3(core::Storage<V>::load(gr[j]), p.fp8_saturate);
        fu[j] = core::float_to_e4m3(core::Storage<V>::load(ur[j]), p.fp8_saturate);
      }
    }
  }
}

template <StorageKind Y, StorageKind V>
void backward_impl(const MatrixView& grad_out, const core::GateUpViews& in,
                   const core::SwigluParams& p, const core::GateUpViews& grad,
                   float* grad_weights) {
#pragma omp parallel for schedule(static) if (worth_threads(p.rows * p.n))
  for (int64_t r = 0; r < p.rows; ++r) {
    const Elem<Y>* gr = row<Y>(in.gate, r);
    const Elem<Y>* ur = row<Y>(in.up, r);
    const Elem<V>* go = row<V>(grad_out, r);
    Elem<V>* dgate = row_out<V>(grad.gate, r);
    Elem<V>* dup = row_out<V>(grad.up, r);
    const float w = p.weights ? p.weights[r] : 1.0f;
    const float scale = w * p.down_multiplier;
    double dw = 0.0;
    for (int64_t j = 0; j < p.n; ++j) {
      core::GateUp v = load_gate_up<Y, V>(gr, ur, j, p);
      float g = core::Storage<V>::load(go[j]);
      float da, db;
      float value = core::swiglu_grad(v, g * scale, da, db, p.gate_multiplier);
      if (grad_weights) dw += double(value) * g;
      dgate[j] = core::Storage<V>::store(da);  // in place: gate[j] and up[j] were read above
      dup[j] = core::Storage<V>::store(db);
    }
    if (grad_weights) grad_weights[r] = float(dw * p.down_multiplier);
  }
}

// Column sums of the stored gradient (the gate's columns, then the up's), row order fixed:
// deterministic.
template <StorageKind V>
void bias_grad_impl(const core::GateUpViews& grad, const core::SwigluParams& p, float* grad_bias) {
#pragma omp parallel for schedule(static) if (worth_threads(p.rows * p.n))
  for (int64_t c = 0; c < 2 * p.n; ++c) {
    const MatrixView& m = c < p.n ? grad.gate : grad.up;
    const int64_t col = c < p.n ? c : c - p.n;
    double s = 0.0;
    for (int64_t r = 0; r < p.rows; ++r) s += core::Storage<V>::load(row<V>(m, r)[col]);
    grad_bias[c] = float(s);
  }
}

}  // namespace

void swiglu_forward(const core::GateUpViews& in, const core::SwigluParams& p, const MatrixView& out,
                    const core::GateUpViews& in_fp8) {
  core::dispatch_dtype(in.gate.dtype,
                       [&](auto k) { forward_impl<decltype(k)::value>(in, p, out, in_fp8); });
}

void swiglu_backward(const MatrixView& grad_out, const core::GateUpViews& in,
                     const core::SwigluParams& p, const core::GateUpViews& grad, float* grad_weights,
                     float* grad_bias) {
  core::dispatch_dtype(grad.gate.dtype, [&](auto k) {
    constexpr StorageKind V = decltype(k)::value;
    if (in.gate.dtype == DType::FP8_E4M3)
      backward_impl<StorageKind::E4M3, V>(grad_out, in, p, grad, grad_weights);
    else
      backward_impl<V, V>(grad_out, in, p, grad, grad_weights);
    if (grad_bias) bias_grad_impl<V>(grad, p, grad_bias);
  });
}

}  // namespace fusedloss::cpu
