// Public SwiGLU entry points: validate, resolve, dispatch to a backend.
#include "fusedloss/swiglu.h"

#include <cmath>
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

core::SwigluParams resolve_params(const MatrixView& y, const VectorView& bias,
                                  const VectorView& weights, const SwigluOptions& o,
                                  DType value_dtype) {
  validate_swiglu_options(o);
  require(y.cols % 2 == 0, "y.cols: got ", y.cols,
          ", expected an even number (gate columns [0, n) and up columns [n, 2n))");
  core::SwigluParams p;
  p.rows = y.rows;
  p.n = y.cols / 2;
  p.clamp = core::SwigluClamp{o.clamp, o.clamp_value, o.clamp_gate_grad_at_bound,
                              o.clamp_up_grad_at_bound};
  p.fp8_saturate = o.fp8_saturate;
  if (bias.data) {
    require(bias.size == y.cols, "bias.size: got ", bias.size, ", expected 2n = ", y.cols);
    require(bias.dtype == value_dtype || bias.dtype == DType::F32, "bias.dtype: got ",
            to_string(bias.dtype), ", expected ",
            value_dtype == DType::F32 ? "fp32" : std::string(to_string(value_dtype)) + " or fp32");
    require(bias.device == y.device, "bias.device: got ", to_string(bias.device), ", expected ",
            to_string(y.device));
    detail::require_element_aligned(bias, "bias");
    p.bias = bias.data;
    p.bias_f32 = bias.dtype == DType::F32;
  }
  if (weights.data) {
    require(weights.size == y.rows, "weights.size: got ", weights.size, ", expected T = ", y.rows,
            " (one per-token scale per row, [T, 1])");
    require(weights.dtype == DType::F32, "weights.dtype: got ", to_string(weights.dtype),
            ", expected fp32");
    require(weights.device == y.device, "weights.device: got ", to_string(weights.device),
            ", expected ", to_string(y.device));
    detail::require_element_aligned(weights, "weights");
    p.weights = static_cast<const float*>(weights.data);
  }
  return p;
}

}  // namespace

void validate_swiglu_options(const SwigluOptions& o) {
  require(!o.clamp || (std::isfinite(o.clamp_value) && o.clamp_value > 0.0f),
          "options.clamp_value: got ", o.clamp_value, ", expected a finite value > 0");
}

void swiglu_forward(const MatrixView& y, const VectorView& bias, const VectorView& weights,
                    const SwigluOptions& options, const MatrixView& out, const MatrixView& y_fp8,
                    [[maybe_unused]] Stream stream) {
  detail::check_matrix(y, "y");
  core::SwigluParams p = resolve_params(y, bias, weights, options, y.dtype);
  check_same_place(out, "out", y, p.n, y.dtype);
  if (y_fp8.data) check_same_place(y_fp8, "y_fp8", y, y.cols, DType::FP8_E4M3);
  detail::require_outputs_apart(
      {detail::span_of(out, "out"), detail::span_of(y_fp8, "y_fp8")},
      {detail::span_of(y, "y"), detail::span_of(bias, "bias"), detail::span_of(weights, "weights")});
  FL_DISPATCH(y.device, "swiglu_forward", cpu::swiglu_forward(y, p, out, y_fp8),
              cuda::swiglu_forward(y, p, out, y_fp8, stream));
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
  core::SwigluParams p = resolve_params(y, bias, weights, options, vt);
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
  require((grad_weights != nullptr) == (p.weights != nullptr), "grad_weights: got ",
          grad_weights ? "a buffer" : "null", ", expected ",
          p.weights ? "a [T] fp32 buffer (weights were given)" : "null (no weights)");
  require((grad_bias != nullptr) == (p.bias != nullptr), "grad_bias: got ",
          grad_bias ? "a buffer" : "null", ", expected ",
          p.bias ? "a [2n] fp32 buffer (bias was given)" : "null (no bias)");
  FL_DISPATCH(y.device, "swiglu_backward",
              cpu::swiglu_backward(grad_out, y, p, grad_y, grad_weights, grad_bias),
              cuda::swiglu_backward(grad_out, y, p, grad_y, grad_weights, grad_bias, stream));
}

}  // namespace fusedloss
