// The C++ autograd nodes of fusedloss.swiglu, fused and two-tensor (python/fusedloss/swiglu.py), without the fp8 input store; nodes.h says why C++, and what the nodes share.
#include "nodes.h"

#include <torch/library.h>

namespace fusedloss::torch_nodes {
namespace {

// The bias as the kernels read it: y's dtype as is, any other float dtype in fp32.
at::Tensor bias_for(const at::Tensor& bias, at::ScalarType y_dtype) {
  if (!bias.defined()) return {};
  return as_dtype(bias, bias.scalar_type() == y_dtype ? y_dtype : at::kFloat).contiguous();
}

at::Tensor scale_for(const at::Tensor& weights) {
  return weights.defined() ? as_dtype(weights.reshape(-1), at::kFloat).contiguous() : at::Tensor();
}

fusedloss::VectorView vector_or_absent(const at::Tensor& t) {
  return t.defined() ? vector(t) : fusedloss::VectorView{};
}

fusedloss::SwigluOptions swiglu_options(bool clamp, double clamp_value, bool gate_at_bound,
                                        bool up_at_bound, double gate_multiplier,
                                        double down_multiplier) {
  fusedloss::SwigluOptions o;
  o.gate_multiplier = float(gate_multiplier);
  o.down_multiplier = float(down_multiplier);
  o.clamp = clamp;
  o.clamp_value = float(clamp_value);
  o.clamp_gate_grad_at_bound = gate_at_bound;
  o.clamp_up_grad_at_bound = up_at_bound;
  return o;
}

// swiglu_options' arguments, as both nodes keep them for the backward, and the options they make.
void keep_swiglu_options(AutogradContext* ctx, bool clamp, double clamp_value, bool gate_at_bound,
                         bool up_at_bound, double gate_multiplier, double down_multiplier) {
  keep(ctx, {{"clamp", clamp}, {"clamp_value", clamp_value}, {"gate_at_bound", gate_at_bound},
             {"up_at_bound", up_at_bound}, {"gate_multiplier", gate_multiplier},
             {"down_multiplier", down_multiplier}});
}

fusedloss::SwigluOptions kept_swiglu_options(AutogradContext* ctx) {
  auto& d = ctx->saved_data;
  return swiglu_options(d["clamp"].toBool(), d["clamp_value"].toDouble(), d["gate_at_bound"].toBool(),
                        d["up_at_bound"].toBool(), d["gate_multiplier"].toDouble(),
                        d["down_multiplier"].toDouble());
}

struct Swiglu : torch::autograd::Function<Swiglu> {
  // options: clamp, clamp_value, the gate's and the up's gradient at the bound, the gate and
  // down multipliers (_options in swiglu.py); inplace: the backward writes y's gradient into y (the caller checked that y's
  // memory is an autograd intermediate's, _views.inplace_refused)
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& y,
                            const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& weights, bool clamp, double clamp_value,
                            bool gate_at_bound, bool up_at_bound, double gate_multiplier,
                            double down_multiplier, bool inplace) {
    c10::OptionalDeviceGuard device(y.device());
    const at::Tensor x = rows_of(y);
    const auto o = swiglu_options(clamp, clamp_value, gate_at_bound, up_at_bound, gate_multiplier,
                                  down_multiplier);
    auto out_shape = y.sizes().vec();
    out_shape.back() /= 2;
    at::Tensor out = at::empty(out_shape, x.options());
    const at::Tensor b = bias_for(or_undefined(bias), x.scalar_type());
    const at::Tensor w = scale_for(or_undefined(weights));
    core_call(&CoreTable::swiglu_forward, matrix(x), vector_or_absent(b), vector_or_absent(w), o,
              matrix(rows_of(out)), fusedloss::MatrixView{}, stream_of(x));
    ctx->save_for_backward({y, or_undefined(bias), or_undefined(weights)});
    keep_swiglu_options(ctx, clamp, clamp_value, gate_at_bound, up_at_bound, gate_multiplier,
                        down_multiplier);
    // (the Python caller has decided and warned, _views.inplace_refused; the op itself is
    // reachable as torch.ops.fusedloss.swiglu_eager, so a leaf's memory is never taken here)
    ctx->saved_data["inplace"] = inplace && storage_is_ours(y);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuse_if_consumed(ctx, "fusedloss.swiglu", "inplace_backward");
    const bool inplace = ctx->saved_data["inplace"].toBool();
    const bool create_graph = at::GradMode::is_enabled();
    at::AutoGradMode no_grad(false);  // the kernels' inputs and outputs need no graph (_op.py)
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& y = saved[0];
    const at::Tensor &bias = saved[1], &weights = saved[2];
    c10::OptionalDeviceGuard device(y.device());
    const auto o = kept_swiglu_options(ctx);
    at::Tensor grad = grads[0];
    // In place only into y's own rows: were they a copy now (y's layout changed since the
    // forward, e.g. through .data), the gradient goes to a new buffer instead.
    const bool into_y = inplace && rows_view(y).defined();
    at::Tensor dy = into_y ? y : at::empty(y.sizes(), y.options().dtype(grad.scalar_type()));
    const at::Tensor grad_rows = rows_of(dy);
    const at::Tensor g =
        rows_of(as_dtype(into_y ? apart_from(grad, y) : grad, grad_rows.scalar_type()).contiguous());
    const at::Tensor x = into_y ? grad_rows : rows_of(y);
    const at::Tensor b = bias_for(into_y ? apart_from(bias, y) : bias, grad_rows.scalar_type());
    const at::Tensor w = scale_for(into_y ? apart_from(weights, y) : weights);
    at::Tensor gw = at::empty({w.defined() ? g.size(0) : 0}, g.options().dtype(at::kFloat));
    at::Tensor gb = at::empty({b.defined() ? grad_rows.size(1) : 0}, g.options().dtype(at::kFloat));
    core_call(&CoreTable::swiglu_backward, matrix(g), matrix(x), vector_or_absent(b), vector_or_absent(w),
              o, matrix(grad_rows), w.defined() ? gw.data_ptr<float>() : nullptr,
              b.defined() ? gb.data_ptr<float>() : nullptr, stream_of(g));
    if (into_y) mark_consumed(ctx, y);
    auto grad_of = [](const at::Tensor& input, const at::Tensor& g32) {
      return input.defined() ? as_dtype(g32.view(input.sizes()), input.scalar_type()) : at::Tensor();
    };
    variable_list out{dy,          grad_of(bias, gb), grad_of(weights, gw), at::Tensor(),
                      at::Tensor(), at::Tensor(),       at::Tensor(),         at::Tensor(),
                      at::Tensor(), at::Tensor()};
    at::AutoGradMode restored(create_graph);
    guard_second_order(create_graph, out, saved, "fusedloss.swiglu");
    return out;
  }
};

at::Tensor swiglu(const at::Tensor& y, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& weights, bool clamp, double clamp_value,
                  bool gate_at_bound, bool up_at_bound, double gate_multiplier,
                  double down_multiplier, bool inplace) {
  return Swiglu::apply(y, bias, weights, clamp, clamp_value, gate_at_bound, up_at_bound,
                       gate_multiplier, down_multiplier, inplace);
}

// The two-tensor form swiglu(gate, up): the same kernels through the core's gate/up entry points
// (each operand read through its own rows: no copy into a [T, 2n] buffer).
struct SwigluGateUp : torch::autograd::Function<SwigluGateUp> {
  // inplace: the backward writes gate's and up's gradients into gate and up (the caller checked
  // that both are autograd intermediates' memory sharing no element, swiglu.py: _gu_inplace)
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up,
                            const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& weights, bool clamp, double clamp_value,
                            bool gate_at_bound, bool up_at_bound, double gate_multiplier,
                            double down_multiplier, bool inplace) {
    c10::OptionalDeviceGuard device(gate.device());
    const at::Tensor g = rows_of(gate), u = rows_of(up);
    const auto o = swiglu_options(clamp, clamp_value, gate_at_bound, up_at_bound, gate_multiplier,
                                  down_multiplier);
    at::Tensor out = at::empty(gate.sizes(), g.options());
    const at::Tensor b = bias_for(or_undefined(bias), g.scalar_type());
    const at::Tensor w = scale_for(or_undefined(weights));
    core_call(&CoreTable::swiglu_gate_up_forward, matrix(g), matrix(u), vector_or_absent(b),
              vector_or_absent(w), o, matrix(rows_of(out)), fusedloss::MatrixView{}, stream_of(g));
    ctx->save_for_backward({gate, up, or_undefined(bias), or_undefined(weights)});
    keep_swiglu_options(ctx, clamp, clamp_value, gate_at_bound, up_at_bound, gate_multiplier,
                        down_multiplier);
    // (reachable as torch.ops.fusedloss.swiglu_gate_up_eager: a leaf's memory is never taken
    // here, and the core refuses gradients over shared elements)
    keep(ctx, {{"inplace", inplace && storage_is_ours(gate) && storage_is_ours(up)}});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuse_if_consumed(ctx, "fusedloss.swiglu", "inplace_backward",
                       "overwrote gate and up with their gradients");
    const bool inplace = ctx->saved_data["inplace"].toBool();
    const bool create_graph = at::GradMode::is_enabled();
    at::AutoGradMode no_grad(false);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &gate = saved[0], &up = saved[1], &bias = saved[2], &weights = saved[3];
    c10::OptionalDeviceGuard device(gate.device());
    const auto o = kept_swiglu_options(ctx);
    const at::Tensor& grad = grads[0];
    // in place only into gate's and up's own rows (a copy now: new buffers instead)
    const bool into = inplace && rows_view(gate).defined() && rows_view(up).defined();
    auto apart = [&](const at::Tensor& t) { return into ? apart_from(apart_from(t, gate), up) : t; };
    const auto grad_options = gate.options().dtype(grad.scalar_type());
    at::Tensor dgate = into ? gate : at::empty(gate.sizes(), grad_options);
    at::Tensor dup = into ? up : at::empty(up.sizes(), grad_options);
    const at::Tensor dgate_rows = rows_of(dgate), dup_rows = rows_of(dup);
    const at::Tensor g = rows_of(as_dtype(apart(grad), dgate_rows.scalar_type()).contiguous());
    const at::Tensor src_gate = into ? dgate_rows : rows_of(gate);
    const at::Tensor src_up = into ? dup_rows : rows_of(up);
    const at::Tensor b = bias_for(apart(bias), dgate_rows.scalar_type());
    const at::Tensor w = scale_for(apart(weights));
    at::Tensor gw = at::empty({w.defined() ? g.size(0) : 0}, g.options().dtype(at::kFloat));
    at::Tensor gb = at::empty({b.defined() ? 2 * dgate_rows.size(1) : 0}, g.options().dtype(at::kFloat));
    core_call(&CoreTable::swiglu_gate_up_backward, matrix(g), matrix(src_gate), matrix(src_up),
              vector_or_absent(b), vector_or_absent(w), o, matrix(dgate_rows), matrix(dup_rows),
              w.defined() ? gw.data_ptr<float>() : nullptr,
              b.defined() ? gb.data_ptr<float>() : nullptr, stream_of(g));
    if (into) {
      mark_consumed(ctx, gate);
      mark_consumed(ctx, up);
    }
    auto grad_of = [](const at::Tensor& input, const at::Tensor& g32) {
      return input.defined() ? as_dtype(g32.view(input.sizes()), input.scalar_type()) : at::Tensor();
    };
    variable_list out{dgate,        dup,          grad_of(bias, gb), grad_of(weights, gw),
                      at::Tensor(), at::Tensor(), at::Tensor(),      at::Tensor(),
                      at::Tensor(), at::Tensor(), at::Tensor()};
    at::AutoGradMode restored(create_graph);
    guard_second_order(create_graph, out, saved, "fusedloss.swiglu");
    return out;
  }
};

at::Tensor swiglu_gate_up(const at::Tensor& gate, const at::Tensor& up,
                          const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& weights, bool clamp, double clamp_value,
                          bool gate_at_bound, bool up_at_bound, double gate_multiplier,
                          double down_multiplier, bool inplace) {
  return SwigluGateUp::apply(gate, up, bias, weights, clamp, clamp_value, gate_at_bound,
                             up_at_bound, gate_multiplier, down_multiplier, inplace);
}

}  // namespace
}  // namespace fusedloss::torch_nodes

TORCH_LIBRARY_FRAGMENT(fusedloss, m) {
  m.def("swiglu_eager(Tensor y, Tensor? bias, Tensor? weights, bool clamp, float clamp_value, "
        "bool clamp_gate_grad_at_bound, bool clamp_up_grad_at_bound, float gate_multiplier, "
        "float down_multiplier, bool inplace) -> Tensor");
  m.def("swiglu_gate_up_eager(Tensor gate, Tensor up, Tensor? bias, Tensor? weights, bool clamp, "
        "float clamp_value, bool clamp_gate_grad_at_bound, bool clamp_up_grad_at_bound, "
        "float gate_multiplier, float down_multiplier, bool inplace) -> Tensor");
}

TORCH_LIBRARY_IMPL(fusedloss, CompositeImplicitAutograd, m) {
  m.impl("swiglu_eager", &fusedloss::torch_nodes::swiglu);
  m.impl("swiglu_gate_up_eager", &fusedloss::torch_nodes::swiglu_gate_up);
}
