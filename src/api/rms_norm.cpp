// Public RMSNorm entry points: validate, resolve, dispatch to a backend.
#include "fusedloss/rms_norm.h"

#include <cmath>
#include <cstdint>
#include <string>
#include "api/check.h"
#include "core/rms_norm_math.h"
#include "cpu/rms_norm_cpu.h"
#ifdef FUSEDLOSS_WITH_CUDA
#include "cuda/rms_norm_cuda.h"
#endif

namespace fusedloss {
namespace {

using detail::require;

void check_like(const MatrixView& m, const char* name, const MatrixView& ref, const char* ref_name) {
  detail::check_matrix(m, name);
  require(m.rows == ref.rows && m.cols == ref.cols, name, ": got shape [", m.rows, ", ", m.cols,
          "], expected [", ref.rows, ", ", ref.cols, "] (", ref_name, "'s)");
  require(m.dtype == ref.dtype, name, ".dtype: got ", to_string(m.dtype), ", expected ",
          to_string(ref.dtype), " (", ref_name, "'s)");
  require(m.device == ref.device, name, ".device: got ", to_string(m.device), ", expected ",
          to_string(ref.device), " (", ref_name, "'s)");
}

bool same_view(const MatrixView& a, const MatrixView& b) {
  return a.data == b.data && (a.row_stride == b.row_stride || a.rows <= 1) && a.dtype == b.dtype;
}

core::RmsNormParams resolve_params(const MatrixView& x, const VectorView& weight,
                                   const RmsNormOptions& o) {
  validate_rms_norm_options(o);
  require(weight.data != nullptr, "weight.data: got null, expected a [", x.cols, "] vector");
  require(weight.size == x.cols, "weight.size: got ", weight.size, ", expected H = ", x.cols,
          " (one weight per column of x)");
  require(rms_norm_reads_weight_as_is(x.dtype, weight.dtype), "weight.dtype: got ",
          to_string(weight.dtype), ", expected ",
          x.dtype == DType::F32 ? std::string("fp32, bf16 or fp16")
                                : std::string(to_string(x.dtype)) + " (x's) or fp32");
  require(weight.device == x.device, "weight.device: got ", to_string(weight.device),
          ", expected ", to_string(x.device), " (x's)");
  detail::require_element_aligned(weight, "weight");
  core::RmsNormParams p;
  p.rows = x.rows;
  p.hidden = x.cols;
  p.eps = o.eps;
  p.zero_centered_gamma = o.zero_centered_gamma;
  p.weight = weight.data;
  p.weight_dtype = weight.dtype;
  return p;
}

}  // namespace

void validate_rms_norm_options(const RmsNormOptions& o) {
  require(std::isfinite(o.eps) && o.eps > 0.0f, "options.eps: got ", o.eps,
          ", expected a finite value > 0");
}

void rms_norm_forward(const MatrixView& x, const VectorView& weight, const RmsNormOptions& options,
                      const MatrixView& y, float* rstd, const MatrixView& residual,
                      const MatrixView& residual_out, [[maybe_unused]] Stream stream) {
  detail::check_matrix(x, "x");
  core::RmsNormParams p = resolve_params(x, weight, options);
  check_like(y, "y", x, "x");
  require(rstd != nullptr || x.rows == 0, "rstd: got null, expected a [", x.rows, "] fp32 buffer");
  if (residual.data) {
    check_like(residual, "residual", x, "x");
    require(residual_out.data != nullptr, "residual_out: got null, expected a [", x.rows, ", ",
            x.cols, "] buffer (residual was given; it receives x + residual for the backward)");
    check_like(residual_out, "residual_out", x, "x");
  } else {
    require(residual_out.data == nullptr || residual_out.rows == 0,
            "residual_out: got a buffer, expected null (no residual was given)");
  }
  using detail::span_of;
  detail::require_outputs_apart(
      {{rstd, x.rows * 4, "rstd"},
       span_of(residual.data ? residual_out : MatrixView{}, "residual_out"), span_of(y, "y")},
      {span_of(x, "x"), span_of(weight, "weight"), span_of(residual, "residual")});
  FL_DISPATCH(x.device, "rms_norm_forward",
              cpu::rms_norm_forward(x, p, y, rstd, residual, residual_out),
              cuda::rms_norm_forward(x, p, y, rstd, residual, residual_out, stream));
}

size_t rms_norm_backward_workspace_bytes(int64_t rows, int64_t hidden, Device device) {
  require(rows >= 0, "rows: got ", rows, ", expected >= 0");
  require(hidden >= 1, "hidden: got ", hidden, ", expected >= 1");
  if (device == Device::CPU) return 0;
  require(device == Device::CUDA, "device: got ", int(device), ", expected cpu or cuda");
  size_t bytes = 0;
  FL_DISPATCH(device, "rms_norm_backward_workspace_bytes", (void)0,
              bytes = cuda::rms_norm_workspace_bytes(rows, hidden));
  return bytes;
}

void rms_norm_backward(const MatrixView& grad_y, const MatrixView& x_or_s, const VectorView& weight,
                       const float* rstd, const RmsNormOptions& options, const MatrixView& grad_x,
                       void* grad_weight, DType grad_weight_dtype, void* workspace,
                       const MatrixView& grad_residual_out, [[maybe_unused]] Stream stream) {
  detail::check_matrix(x_or_s, "x_or_s");
  core::RmsNormParams p = resolve_params(x_or_s, weight, options);
  check_like(grad_y, "grad_y", x_or_s, "x_or_s");
  check_like(grad_x, "grad_x", x_or_s, "x_or_s");
  require(rstd != nullptr || x_or_s.rows == 0, "rstd: got null, expected the forward's [",
          x_or_s.rows, "] fp32 buffer");
  const bool known = grad_weight_dtype == DType::F32 || grad_weight_dtype == DType::BF16 ||
                     grad_weight_dtype == DType::F16 || grad_weight_dtype == DType::FP8_E4M3;
  require(known && grad_weight_dtype != DType::FP8_E4M3, "grad_weight_dtype: got ",
          known ? std::string(to_string(grad_weight_dtype)) : std::to_string(int(grad_weight_dtype)),
          ", expected fp32, bf16 or fp16");
  const int64_t gw_size = detail::element_size(grad_weight_dtype);
  require(grad_weight != nullptr, "grad_weight: got null, expected a [", x_or_s.cols, "] ",
          to_string(grad_weight_dtype), " buffer");
  detail::require_element_aligned(grad_weight, grad_weight_dtype, "grad_weight", "");
  // given (data) means checked: a [0, H] view for T > 0 rows is refused, not ignored
  const bool gres = grad_residual_out.data != nullptr;
  if (gres) check_like(grad_residual_out, "grad_residual_out", x_or_s, "x_or_s");
  // grad_x: in place over grad_y, x_or_s or grad_residual_out (each element is read by the
  // thread that writes it, before it writes it), or disjoint from every input.
  for (auto [m, name] : {std::pair{&grad_y, "grad_y"}, {&x_or_s, "x_or_s"},
                         {&grad_residual_out, "grad_residual_out"}})
    require(same_view(grad_x, *m) || !detail::overlaps(grad_x, *m), "grad_x: overlaps ", name,
            " without being the same view; expected ", name, " itself or a separate buffer");
  require(workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % 16 == 0,
          "workspace: got an address that is not 16-byte aligned, expected an aligned buffer of "
          "rms_norm_backward_workspace_bytes() bytes");
  // The workspace is written too (the row kernel's partial rows, while other blocks still read
  // the inputs): an output like grad_weight, over the bytes the backward may write.
  using detail::span_of;
  const detail::Span gw{grad_weight, x_or_s.cols * gw_size, "grad_weight"};
  const detail::Span ws{workspace,
                        workspace ? int64_t(rms_norm_backward_workspace_bytes(
                                        x_or_s.rows, x_or_s.cols, x_or_s.device))
                                  : 0,
                        "workspace"};
  detail::require_outputs_apart({ws, span_of(grad_x, "grad_x"), gw},
                                {span_of(weight, "weight"), {rstd, x_or_s.rows * 4, "rstd"}});
  detail::require_outputs_apart({ws, gw}, {span_of(grad_y, "grad_y"), span_of(x_or_s, "x_or_s"),
                                           span_of(gres ? grad_residual_out : MatrixView{},
                                                   "grad_residual_out")});
  const MatrixView none{};
  FL_DISPATCH(x_or_s.device, "rms_norm_backward",
              cpu::rms_norm_backward(grad_y, x_or_s, p, rstd, grad_x, grad_weight,
                                     grad_weight_dtype, gres ? grad_residual_out : none),
              cuda::rms_norm_backward(grad_y, x_or_s, p, rstd, grad_x, grad_weight,
                                      grad_weight_dtype, workspace,
                                      gres ? grad_residual_out : none, stream));
}

void rms_norm_backward(const MatrixView& grad_y, const MatrixView& x_or_s, const VectorView& weight,
                       const float* rstd, const RmsNormOptions& options, const MatrixView& grad_x,
                       float* grad_weight, void* workspace, const MatrixView& grad_residual_out,
                       Stream stream) {
  rms_norm_backward(grad_y, x_or_s, weight, rstd, options, grad_x, grad_weight, DType::F32,
                    workspace, grad_residual_out, stream);
}

}  // namespace fusedloss
