// The C++ autograd node of fusedloss.rms_norm (python/fusedloss/rms_norm.py); nodes.h says why C++, and what the nodes share.
#include "nodes.h"

#include <torch/library.h>

namespace fusedloss::torch_nodes {
namespace {

// The weight as the kernels read it: its own dtype where they take it with x's, else fp32.
at::Tensor weight_for(const at::Tensor& weight, const at::Tensor& x) {
  const auto w = weight.scalar_type();
  const bool as_is = (w == at::kFloat || w == at::kHalf || w == at::kBFloat16) &&
                     fusedloss::rms_norm_reads_weight_as_is(dtype_of(x), dtype_of(weight));
  return as_dtype(weight, as_is ? w : at::kFloat).contiguous();
}

fusedloss::RmsNormOptions rms_options(double eps, bool zero_centered_gamma) {
  fusedloss::RmsNormOptions o;
  o.eps = float(eps);
  o.zero_centered_gamma = zero_centered_gamma;
  return o;
}

struct RmsNorm : torch::autograd::Function<RmsNorm> {
  // -> {y} or, with a residual, {y, s = x + residual}
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& residual, double eps,
                               bool zero_centered_gamma) {
    c10::OptionalDeviceGuard device(x.device());
    const at::Tensor xr = rows_of(x);
    const auto opts = rms_options(eps, zero_centered_gamma);
    // outputs in x's shape, contiguous, returned as they are (not views made here)
    at::Tensor y = at::empty(x.sizes(), x.options());
    at::Tensor rstd = at::empty({xr.size(0)}, x.options().dtype(at::kFloat));
    at::Tensor s, w = weight_for(weight, x);
    fusedloss::MatrixView r_view, s_view;
    at::Tensor rr;
    if (residual) {
      rr = rows_of(*residual);
      s = at::empty(x.sizes(), x.options());
      r_view = matrix(rr);
      s_view = matrix(rows_of(s));
    }
    core_call(&CoreTable::rms_norm_forward, matrix(xr), vector(w), opts, matrix(rows_of(y)),
              rstd.data_ptr<float>(), r_view, s_view, stream_of(x));
    ctx->save_for_backward({residual ? s : x, w, rstd});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["zc"] = zero_centered_gamma;
    ctx->saved_data["w_dtype"] = int64_t(weight.scalar_type());
    if (!residual) return {y};
    return {y, s};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool create_graph = at::GradMode::is_enabled();
    at::AutoGradMode no_grad(false);  // the kernels' inputs and outputs need no graph (_op.py)
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& src = saved[0];
    const at::Tensor& w = saved[1];
    const at::Tensor& rstd = saved[2];
    const bool has_residual = grads.size() > 1;
    c10::OptionalDeviceGuard device(src.device());
    const auto opts = rms_options(ctx->saved_data["eps"].toDouble(), ctx->saved_data["zc"].toBool());
    at::Tensor g = grads[0].defined() ? grads[0] : at::zeros_like(src);  // only s was used
    // the gradient may arrive expanded (of a sum) or strided; kept alive until the kernel ran
    const at::Tensor gr = rows_of(as_dtype(g, src.scalar_type()));
    at::Tensor gsr;
    fusedloss::MatrixView gs_view;
    if (has_residual && grads[1].defined()) {
      gsr = rows_of(as_dtype(grads[1], src.scalar_type()));
      gs_view = matrix(gsr);
    }
    const at::Tensor xr = rows_of(src);
    at::Tensor dx = at::empty(src.sizes(), src.options());
    // in the dtype the weight was read in: summed in fp32, rounded once there
    at::Tensor dw = at::empty({w.numel()}, w.options());
    size_t ws_bytes = 0;
    core_call(&CoreTable::rms_norm_backward_workspace_bytes, xr.size(0), xr.size(1), backend_of(src),
              &ws_bytes);
    at::Tensor ws;
    if (ws_bytes) ws = at::empty({int64_t((ws_bytes + 3) / 4)}, src.options().dtype(at::kFloat));
    core_call(&CoreTable::rms_norm_backward, matrix(gr), matrix(xr), vector(w), rstd.data_ptr<float>(),
              opts, matrix(rows_of(dx)), dw.data_ptr(), dtype_of(dw),
              ws_bytes ? ws.data_ptr() : nullptr, gs_view, stream_of(src));
    const auto w_dtype = at::ScalarType(ctx->saved_data["w_dtype"].toInt());
    variable_list out{dx, as_dtype(dw, w_dtype), has_residual ? dx : at::Tensor(), at::Tensor(),
                      at::Tensor()};
    at::AutoGradMode restored(create_graph);
    guard_second_order(create_graph, out, saved,
                       has_residual ? "fusedloss.rms_norm_residual" : "fusedloss.rms_norm");
    return out;
  }
};

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    bool zero_centered_gamma) {
  return RmsNorm::apply(x, weight, std::optional<at::Tensor>(), eps, zero_centered_gamma)[0];
}

std::tuple<at::Tensor, at::Tensor> rms_norm_residual(const at::Tensor& x, const at::Tensor& weight,
                                                     const at::Tensor& residual, double eps,
                                                     bool zero_centered_gamma) {
  auto out = RmsNorm::apply(x, weight, std::optional<at::Tensor>(residual), eps, zero_centered_gamma);
  return {out[0], out[1]};
}

}  // namespace
}  // namespace fusedloss::torch_nodes

TORCH_LIBRARY_FRAGMENT(fusedloss, m) {
  m.def("rms_norm_eager(Tensor x, Tensor weight, float eps, bool zero_centered_gamma) -> Tensor");
  m.def("rms_norm_residual_eager(Tensor x, Tensor weight, Tensor residual, float eps, "
        "bool zero_centered_gamma) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fusedloss, CompositeImplicitAutograd, m) {
  m.impl("rms_norm_eager", &fusedloss::torch_nodes::rms_norm);
  m.impl("rms_norm_residual_eager", &fusedloss::torch_nodes::rms_norm_residual);
}
