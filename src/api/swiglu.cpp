// Public SwiGLU entry points: validate, resolve, dispatch to a backend.
#include "fusedloss/swiglu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include "api/check.h"
#include "cpu/swiglu_cpu.h"
#ifdef FUSEDLOSS_WITH_CUDA
#include "cuda/swiglu_cuda.h"
#endif

namespace fusedloss {
namespace {

using detail::require;

void check_same_place(const MatrixView& m, const char* name, const MatrixView& y, int64_t cols,
                      DType dtype) {
  detail::check_matrix(m, name, dtype == DType::FP8_E4M3);
  require(m.rows == y.rows && m.cols == cols, name, ": got shape [", m.rows, ", ", m.cols,
          "], expected [", y.rows, ", ", cols, "]");
  require(m.dtype == dtype, name, ".dtype: got ", to_string(m.dtype), ", expected ",
          to_string(dtype));
  require(m.device == y.device, name, ".device: got ", to_string(m.device), ", expected ",
          to_string(y.device));
}

// The validated options and the auxiliary vectors against rows x n (the fused y, or gate and
// up), on `device`: the parameters the backends receive.
core::SwigluParams resolve_params(int64_t rows, int64_t n, Device device, const VectorView& bias,
                                  const VectorView& weights, const SwigluOptions& o,
                                  DType value_dtype, const char* bias_layout) {
  core::SwigluParams p;
  p.rows = rows;
  p.n = n;
  p.clamp = core::SwigluClamp{o.clamp, o.clamp_value, o.clamp_gate_grad_at_bound,
                              o.clamp_up_grad_at_bound};
  p.fp8_saturate = o.fp8_saturate;
  p.gate_multiplier = o.gate_multiplier;
  p.down_multiplier = o.down_multiplier;
  if (bias.data) {
    require(bias.size == 2 * n, "bias.size: got ", bias.size, ", expected 2n = ", 2 * n,
            bias_layout);
    require(bias.dtype == value_dtype || bias.dtype == DType::F32, "bias.dtype: got ",
            to_string(bias.dtype), ", expected ",
            value_dtype == DType::F32 ? "fp32" : std::string(to_string(value_dtype)) + " or fp32");
    require(bias.device == device, "bias.device: got ", to_string(bias.device), ", expected ",
            to_string(device));
    detail::require_element_aligned(bias, "bias");
    p.bias = bias.data;
    p.bias_f32 = bias.dtype == DType::F32;
  }
  if (weights.data) {
    require(weights.size == rows, "weights.size: got ", weights.size, ", expected T = ", rows,
            " (one per-token scale per row, [T, 1])");
    require(weights.dtype == DType::F32, "weights.dtype: got ", to_string(weights.dtype),
            ", expected fp32");
    require(weights.device == device, "weights.device: got ", to_string(weights.device),
            ", expected ", to_string(device));
    detail::require_element_aligned(weights, "weights");
    p.weights = static_cast<const float*>(weights.data);
  }
  return p;
}

constexpr const char* kFusedBias = " (the gate's bias in [0, n), the up's in [n, 2n))";

core::SwigluParams resolve_fused(const MatrixView& y, const VectorView& bias,
                                 const VectorView& weights, const SwigluOptions& o,
                                 DType value_dtype) {
  validate_swiglu_options(o);
  require(y.cols % 2 == 0, "y.cols: got ", y.cols,
          ", expected an even number (gate columns [0, n) and up columns [n, 2n))");
  return resolve_params(y.rows, y.cols / 2, y.device, bias, weights, o, value_dtype, "");
}

// Whether two views of one dtype can share an element: their byte ranges meet and, for views
// with one row stride, a row of one meets a row of the other (the halves of one [T, 2n] buffer
// interleave without sharing any element).
bool share_elements(const MatrixView& a, const MatrixView& b) {
  if (!detail::overlaps(a, b)) return false;
  if (a.dtype != b.dtype || a.row_stride != b.row_stride || a.rows <= 1 || b.rows <= 1) return true;
  const int64_t es = detail::element_size(a.dtype);
  const auto pa = reinterpret_cast<uintptr_t>(a.data), pb = reinterpret_cast<uintptr_t>(b.data);
  const auto lo = std::min(pa, pb), hi = std::max(pa, pb);
  const MatrixView& first = pa <= pb ? a : b;
  const MatrixView& second = pa <= pb ? b : a;
  if ((hi - lo) % uint64_t(es)) return true;  // not on one element grid: be conservative
  const int64_t s = a.row_stride, shift = int64_t(((hi - lo) / uint64_t(es)) % uint64_t(s));
  // within each period of s elements, first holds [0, cols) and second [shift, shift + cols)
  return !(shift >= first.cols && shift + second.cols <= s);
}

// gate and up: one shape, dtype and device (value_or_fp8: the backward's may be e4m3 both).
void check_gate_up(const MatrixView& gate, const MatrixView& up, bool allow_fp8) {
  detail::check_matrix(gate, "gate", allow_fp8);
  detail::check_matrix(up, "up", allow_fp8);
  require(up.rows == gate.rows && up.cols == gate.cols, "up: got shape [", up.rows, ", ", up.cols,
          "], expected gate's [", gate.rows, ", ", gate.cols,
          "] (one up value per gate value: swiglu(gate, up) takes the two projections of one "
          "input)");
  require(up.dtype == gate.dtype, "up.dtype: got ", to_string(up.dtype), ", expected gate's ",
          to_string(gate.dtype));
  require(up.device == gate.device, "up.device: got ", to_string(up.device), ", expected gate's ",
          to_string(gate.device));
}

// The auxiliary gradients a backward writes: one for each auxiliary input given, none else.
void require_aux_grads(const core::SwigluParams& p, const float* grad_weights,
                       const float* grad_bias) {
  require((grad_weights != nullptr) == (p.weights != nullptr), "grad_weights: got ",
          grad_weights ? "a buffer" : "null", ", expected ",
          p.weights ? "a [T] fp32 buffer (weights were given)" : "null (no weights)");
  require((grad_bias != nullptr) == (p.bias != nullptr), "grad_bias: got ",
          grad_bias ? "a buffer" : "null", ", expected ",
          p.bias ? "a [2n] fp32 buffer (bias was given)" : "null (no bias)");
}

}  // namespace

void validate_swiglu_options(const SwigluOptions& o) {
  require(!o.clamp || (std::isfinite(o.clamp_value) && o.clamp_value > 0.0f),
          "options.clamp_value: got ", o.clamp_value, ", expected a finite value > 0");
  require(std::isfinite(o.gate_multiplier), "options.gate_multiplier: got ", o.gate_multiplier,
          ", expected a finite value (1: plain SwiGLU)");
  require(std::isfinite(o.down_multiplier), "options.down_multiplier: got ", o.down_multiplier,
          ", expected a finite value (1: plain SwiGLU)");
}

void swiglu_forward(const MatrixView& y, const VectorView& bias, const VectorView& weights,
                    const SwigluOptions& options, const MatrixView& out, const MatrixView& y_fp8,
                    [[maybe_unused]] Stream stream) {
  detail::check_matrix(y, "y");
  core::SwigluParams p = resolve_fused(y, bias, weights, options, y.dtype);
  check_same_place(out, "out", y, p.n, y.dtype);
  if (y_fp8.data) check_same_place(y_fp8, "y_fp8", y, y.cols, DType::FP8_E4M3);
  detail::require_outputs_apart(
      {detail::span_of(out, "out"), detail::span_of(y_fp8, "y_fp8")},
      {detail::span_of(y, "y"), detail::span_of(bias, "bias"), detail::span_of(weights, "weights")});
  const core::GateUpViews in = core::halves(y), f8 = core::halves(y_fp8);
  FL_DISPATCH(y.device, "swiglu_forward", cpu::swiglu_forward(in, p, out, f8),
              cuda::swiglu_forward(in, p, out, f8, stream));
}

void swiglu_backward(const MatrixView& grad_out, const MatrixView& y, const VectorView& bias,
                     const VectorView& weights, const SwigluOptions& options,
                     const MatrixView& grad_y, float* grad_weights, float* grad_bias,
                     [[maybe_unused]] Stream stream) {
  detail::check_matrix(grad_out, "grad_out");
  detail::check_matrix(y, "y", true);
  const DType vt = grad_out.dtype;
  require(y.dtype == vt || y.dtype == DType::FP8_E4M3, "y.dtype: got ", to_string(y.dtype),
          ", expected ", to_string(vt), " (grad_out's) or fp8_e4m3 (fp8 input store)");
  core::SwigluParams p = resolve_fused(y, bias, weights, options, vt);
  check_same_place(grad_out, "grad_out", y, p.n, vt);
  check_same_place(grad_y, "grad_y", y, y.cols, vt);
  const bool in_place = grad_y.data == y.data && grad_y.row_stride == y.row_stride &&
                        grad_y.dtype == y.dtype;
  require(in_place || !detail::overlaps(grad_y, y),
          "grad_y: overlaps y without being the same view; expected y itself or a disjoint buffer");
  const detail::Span b = detail::span_of(bias, "bias"), w = detail::span_of(weights, "weights"),
                     gy = detail::span_of(grad_y, "grad_y"), go = detail::span_of(grad_out, "grad_out");
  detail::require_read_apart(gy, {go, b, w});
  // the per-row and per-column gradients: apart from everything the kernel reads or writes
  // (grad_y may be y itself: in place)
  detail::require_outputs_apart({{grad_weights, y.rows * 4, "grad_weights"},
                                 {grad_bias, y.cols * 4, "grad_bias"}},
                                {gy, go, detail::span_of(y, "y"), b, w});
  require_aux_grads(p, grad_weights, grad_bias);
  const core::GateUpViews in = core::halves(y), grad = core::halves(grad_y);
  FL_DISPATCH(y.device, "swiglu_backward",
              cpu::swiglu_backward(grad_out, in, p, grad, grad_weights, grad_bias),
              cuda::swiglu_backward(grad_out, in, p, grad, grad_weights, grad_bias, stream));
}

void swiglu_gate_up_forward(const MatrixView& gate, const MatrixView& up, const VectorView& bias,
                            const VectorView& weights, const SwigluOptions& options,
                            const MatrixView& out, const MatrixView& input_fp8,
                            [[maybe_unused]] Stream stream) {
  check_gate_up(gate, up, false);
  validate_swiglu_options(options);
  core::SwigluParams p = resolve_params(gate.rows, gate.cols, gate.device, bias, weights, options,
                                        gate.dtype, kFusedBias);
  check_same_place(out, "out", gate, p.n, gate.dtype);
  if (input_fp8.data) check_same_place(input_fp8, "input_fp8", gate, 2 * p.n, DType::FP8_E4M3);
  detail::require_outputs_apart(
      {detail::span_of(out, "out"), detail::span_of(input_fp8, "input_fp8")},
      {detail::span_of(gate, "gate"), detail::span_of(up, "up"), detail::span_of(bias, "bias"),
       detail::span_of(weights, "weights")});
  const core::GateUpViews in{gate, up}, f8 = core::halves(input_fp8);
  FL_DISPATCH(gate.device, "swiglu_gate_up_forward", cpu::swiglu_forward(in, p, out, f8),
              cuda::swiglu_forward(in, p, out, f8, stream));
}

void swiglu_gate_up_backward(const MatrixView& grad_out, const MatrixView& gate,
                             const MatrixView& up, const VectorView& bias,
                             const VectorView& weights, const SwigluOptions& options,
                             const MatrixView& grad_gate, const MatrixView& grad_up,
                             float* grad_weights, float* grad_bias,
                             [[maybe_unused]] Stream stream) {
  detail::check_matrix(grad_out, "grad_out");
  check_gate_up(gate, up, true);
  const DType vt = grad_out.dtype;
  require(gate.dtype == vt || gate.dtype == DType::FP8_E4M3, "gate.dtype: got ",
          to_string(gate.dtype), ", expected ", to_string(vt),
          " (grad_out's) or fp8_e4m3 (fp8 input store)");
  validate_swiglu_options(options);
  core::SwigluParams p = resolve_params(gate.rows, gate.cols, gate.device, bias, weights, options,
                                        vt, kFusedBias);
  check_same_place(grad_out, "grad_out", gate, p.n, vt);
  check_same_place(grad_gate, "grad_gate", gate, p.n, vt);
  check_same_place(grad_up, "grad_up", gate, p.n, vt);
  // each gradient over its own input (in place: the thread that writes an element read it and
  // its partner first), or apart from both inputs; never over the other gradient
  auto same = [](const MatrixView& a, const MatrixView& b) {
    return a.data == b.data && (a.row_stride == b.row_stride || a.rows <= 1) && a.dtype == b.dtype;
  };
  const bool gate_in_place = same(grad_gate, gate), up_in_place = same(grad_up, up);
  require(gate_in_place || !share_elements(grad_gate, gate),
          "grad_gate: overlaps gate without being the same view; expected gate itself (in place) "
          "or a separate buffer");
  require(up_in_place || !share_elements(grad_up, up),
          "grad_up: overlaps up without being the same view; expected up itself (in place) or a "
          "separate buffer");
  require(!share_elements(grad_gate, up),
          "grad_gate: overlaps up, expected a buffer apart from up (up is read while grad_gate is "
          "written; gate and up as one tensor cannot take their gradients in place)");
  require(!share_elements(grad_up, gate),
          "grad_up: overlaps gate, expected a buffer apart from gate (gate is read while grad_up is "
          "written; gate and up as one tensor cannot take their gradients in place)");
  require(!share_elements(grad_gate, grad_up),
          "grad_gate: overlaps grad_up, expected separate buffers");
  const detail::Span b = detail::span_of(bias, "bias"), w = detail::span_of(weights, "weights"),
                     go = detail::span_of(grad_out, "grad_out");
  detail::require_read_apart(detail::span_of(grad_gate, "grad_gate"), {go, b, w});
  detail::require_read_apart(detail::span_of(grad_up, "grad_up"), {go, b, w});
  detail::require_outputs_apart({{grad_weights, gate.rows * 4, "grad_weights"},
                                 {grad_bias, 2 * p.n * 4, "grad_bias"}},
                                {detail::span_of(grad_gate, "grad_gate"),
                                 detail::span_of(grad_up, "grad_up"), go,
                                 detail::span_of(gate, "gate"), detail::span_of(up, "up"), b, w});
  require_aux_grads(p, grad_weights, grad_bias);
  const core::GateUpViews in{gate, up}, grad{grad_gate, grad_up};
  FL_DISPATCH(gate.device, "swiglu_gate_up_backward",
              cpu::swiglu_backward(grad_out, in, p, grad, grad_weights, grad_bias),
              cuda::swiglu_backward(grad_out, in, p, grad, grad_weights, grad_bias, stream));
}

}  // namespace fusedloss
