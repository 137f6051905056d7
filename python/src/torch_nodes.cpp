// fusedloss's autograd nodes in C++ for eager PyTorch calls (libfusedloss_torch.so, loaded by
// fusedloss/_native.py with torch.ops.load_library).
//
// Why: every eager op pays the autograd engine's round trip, and a node written in Python adds
// to it (bench/autograd_node_probe.py on an H200 host: an empty node costs 94 us forward +
// backward in Python, 78 us in C++; F.rms_norm's whole op 103 us). These nodes run the same
// steps as the Python scaffold's eager path (python/fusedloss/_op.py and the op's module): the
// same views, copies, allocations, kernels and double-backward guard. The Python layer still
// checks the arguments first (its messages name them); torch.compile keeps the Python custom ops.
//
// Built only against the torch it was compiled with (the version is checked before loading).
#include <ATen/ATen.h>
#include <ATen/TensorUtils.h>
#include <c10/core/Allocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <atomic>
#include <mutex>
#include <string>
#include <unordered_map>

#include "core_table.h"
#include "fusedloss/fusedloss.h"

namespace {

using fusedloss::python::CoreTable;

// The core, as fusedloss._C exports it (core_table.h): set by fusedloss_torch_attach.
std::atomic<const CoreTable*> g_core{nullptr};

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- tensors -> views (python/fusedloss/_views.py has the same rules) ----

fusedloss::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return fusedloss::DType::F32;
    case at::kHalf: return fusedloss::DType::F16;
    case at::kBFloat16: return fusedloss::DType::BF16;
    default: TORCH_CHECK_VALUE(false, "fusedloss internal: dtype ", t.scalar_type(), " has no kernel");
  }
}

fusedloss::Device backend_of(const at::Tensor& t) {
  return t.is_cuda() ? fusedloss::Device::CUDA : fusedloss::Device::CPU;
}

fusedloss::Stream stream_of(const at::Tensor& t) {
  if (!t.is_cuda()) return nullptr;
  // through c10's device-generic interface: no link to libc10_cuda, the same current stream
  return c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(t.device()).native_handle();
}

// t as [rows, cols] over its own memory when the kernels can read it as is, else undefined
// (expanded, transposed or overlapping rows): _views._rows_view.
at::Tensor rows_view(const at::Tensor& t) {
  const int64_t cols = t.size(-1);
  if (cols < 1 || (t.stride(-1) != 1 && cols > 1)) return {};
  const int64_t rows = t.numel() / cols;
  at::Tensor r;
  if (t.dim() == 2) {
    r = t;
  } else if (const int64_t shape[2] = {rows, cols};
             at::detail::computeStride(t.sizes(), t.strides(), at::IntArrayRef(shape, 2))) {
    r = t.view({rows, cols});  // (no copy: the leading dims flatten)
  } else {
    return {};
  }
  return rows > 1 && r.stride(0) < cols ? at::Tensor() : r;
}

// t as [rows, cols] rows the kernels read: a view where one exists, else a copy.
at::Tensor rows_of(const at::Tensor& t) {
  at::Tensor r = rows_view(t);
  return r.defined() ? r : t.contiguous().view({-1, t.size(-1)});
}

fusedloss::MatrixView matrix(const at::Tensor& rows) {
  const int64_t n = rows.size(0), cols = rows.size(1);
  return {rows.data_ptr(), n, cols, n > 1 ? rows.stride(0) : cols, dtype_of(rows), backend_of(rows)};
}

fusedloss::VectorView vector(const at::Tensor& t) {
  return {t.data_ptr(), t.numel(), dtype_of(t), backend_of(t)};
}

at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

// One core call through the table's `entry`; a core Error becomes a ValueError with the core's
// message (the Python bindings raise fusedloss._C.Error, a ValueError subclass: catch
// ValueError to handle both), anything else a RuntimeError.
template <class Entry, class... Args>
void core_call(Entry CoreTable::*entry, Args&&... args) {
  const CoreTable* core = g_core.load(std::memory_order_acquire);
  TORCH_CHECK(core, "fusedloss: the C++ nodes were called without fusedloss._C's core attached "
              "(import fusedloss first; fusedloss._native.status says why they are not in use)");
  if (const auto* failure = (core->*entry)(std::forward<Args>(args)...)) {
    const std::string what = failure->message;
    TORCH_CHECK_WITH(OutOfMemoryError, !failure->out_of_memory, what);
    TORCH_CHECK(failure->argument_error, what);
    // the Python argument's name: "options.label_smoothing: ..." -> "label_smoothing: ..."
    const std::string prefix = "options.";
    TORCH_CHECK_VALUE(false, what.compare(0, prefix.size(), prefix) == 0 ? what.substr(prefix.size()) : what);
  }
}

// Whether a gradient may overwrite t's memory: an autograd intermediate (not a leaf or a view
// of one) whose rows the kernels address as they are (_views.storage_is_ours).
bool storage_is_ours(const at::Tensor& t) {
  const bool base_is_leaf = t.is_view() ? t._base().is_leaf() : t.is_leaf();
  return !t.is_leaf() && !base_is_leaf && rows_view(t).defined();
}

// A node whose backward wrote the gradient into its input refuses a second backward
// (_op.py: FusedOp._backward).
void refuse_if_consumed(AutogradContext* ctx, const char* op, const char* flag,
                        const char* consumed = "overwrote the input with its gradient") {
  TORCH_CHECK(!ctx->saved_data.count("consumed"), op, ": second backward through a result computed "
              "with ", flag, "=True; the first backward ", consumed, ", so it cannot be "
              "differentiated again. Use ", flag, "=False to backward twice (retain_graph=True).");
}

void mark_consumed(AutogradContext* ctx, const at::Tensor& input) {
  ctx->saved_data["consumed"] = true;
  input.unsafeGetTensorImpl()->bump_version();  // it holds its gradient: later readers trip
}

// ---- the double-backward guard (python/fusedloss/_op.py: _NoSecondOrder) ----

// Joins a gradient to the op's differentiable inputs ("anchors") and refuses to be
// differentiated: the backward kernels are not differentiable ops, so a second-order gradient
// through them would be silently wrong.
struct NoSecondOrder : torch::autograd::Function<NoSecondOrder> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& grad, const std::string& op,
                            at::TensorList anchors) {
    (void)anchors;
    ctx->saved_data["op"] = op;
    return grad.view_as(grad);
  }
  static variable_list backward(AutogradContext* ctx, variable_list) {
    TORCH_CHECK(false, ctx->saved_data["op"].toStringRef(),
                ": differentiating its gradient (a double backward, e.g. through "
                "create_graph=True) is not supported; its backward is a fused kernel, not a "
                "differentiable op");
  }
};

// Under create_graph=True (grad mode on when the backward began): every gradient guarded (the
// values stay usable).
void guard_second_order(bool create_graph, variable_list& grads, const variable_list& saved,
                        const char* op) {
  if (!create_graph) return;
  std::vector<at::Tensor> anchors;
  for (const auto& t : saved)
    if (t.defined() && t.requires_grad()) anchors.push_back(t);
  for (auto& g : grads) {
    if (!g.defined()) continue;
    if (anchors.empty() && !g.requires_grad()) g = g.detach().requires_grad_();
    g = NoSecondOrder::apply(g, std::string(op), at::TensorList(anchors));
  }
}

// ---- rms_norm (python/fusedloss/rms_norm.py) ----

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

// ---- swiglu (python/fusedloss/swiglu.py), without the fp8 input store ----

// Whether the byte ranges of a's and b's elements meet (_views.shares_memory).
bool shares_memory(const at::Tensor& a, const at::Tensor& b) {
  if (!a.numel() || !b.numel() || a.device() != b.device()) return false;
  auto range = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d)
      if (t.size(d) > 0) last += (t.size(d) - 1) * t.stride(d);
    const auto first = reinterpret_cast<uintptr_t>(t.data_ptr());
    return std::make_pair(first, first + uintptr_t((last + 1) * int64_t(t.element_size())) - 1);
  };
  const auto [a0, a1] = range(a);
  const auto [b0, b1] = range(b);
  return a0 <= b1 && b0 <= a1;
}

// t, or a copy when it shares memory with `written` (_views.apart_from).
at::Tensor apart_from(const at::Tensor& t, const at::Tensor& written) {
  return t.defined() && shares_memory(t, written) ? t.clone() : t;
}

// The bias as the kernels read it: y's dtype as is, any other float dtype in fp32.
at::Tensor bias_for(const at::Tensor& bias, at::ScalarType y_dtype) {
  if (!bias.defined()) return {};
  return as_dtype(bias, bias.scalar_type() == y_dtype ? y_dtype : at::kFloat).contiguous();
}

at::Tensor scale_for(const at::Tensor& weights) {
  return weights.defined() ? as_dtype(weights.reshape(-1), at::kFloat).contiguous() : at::Tensor();
}

at::Tensor or_undefined(const std::optional<at::Tensor>& t) { return t ? *t : at::Tensor(); }

fusedloss::VectorView vector_or_absent(const at::Tensor& t) {
  return t.defined() ? vector(t) : fusedloss::VectorView{};
}

fusedloss::SwigluOptions swiglu_options(bool clamp, double clamp_value, bool gate_at_bound,
                                        bool up_at_bound) {
  fusedloss::SwigluOptions o;
  o.clamp = clamp;
  o.clamp_value = float(clamp_value);
  o.clamp_gate_grad_at_bound = gate_at_bound;
  o.clamp_up_grad_at_bound = up_at_bound;
  return o;
}

struct Swiglu : torch::autograd::Function<Swiglu> {
  // options: clamp, clamp_value, the gate's and the up's gradient at the bound (_options in
  // swiglu.py); inplace: the backward writes y's gradient into y (the caller checked that y's
  // memory is an autograd intermediate's, _views.inplace_refused)
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& y,
                            const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& weights, bool clamp, double clamp_value,
                            bool gate_at_bound, bool up_at_bound, bool inplace) {
    c10::OptionalDeviceGuard device(y.device());
    const at::Tensor x = rows_of(y);
    const auto o = swiglu_options(clamp, clamp_value, gate_at_bound, up_at_bound);
    auto out_shape = y.sizes().vec();
    out_shape.back() /= 2;
    at::Tensor out = at::empty(out_shape, x.options());
    const at::Tensor b = bias_for(or_undefined(bias), x.scalar_type());
    const at::Tensor w = scale_for(or_undefined(weights));
    core_call(&CoreTable::swiglu_forward, matrix(x), vector_or_absent(b), vector_or_absent(w), o,
              matrix(rows_of(out)), fusedloss::MatrixView{}, stream_of(x));
    ctx->save_for_backward({y, or_undefined(bias), or_undefined(weights)});
    ctx->saved_data["clamp"] = clamp;
    ctx->saved_data["clamp_value"] = clamp_value;
    ctx->saved_data["gate_at_bound"] = gate_at_bound;
    ctx->saved_data["up_at_bound"] = up_at_bound;
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
    auto& d = ctx->saved_data;
    const auto o = swiglu_options(d["clamp"].toBool(), d["clamp_value"].toDouble(),
                                  d["gate_at_bound"].toBool(), d["up_at_bound"].toBool());
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
    variable_list out{dy, grad_of(bias, gb), grad_of(weights, gw), at::Tensor(), at::Tensor(),
                      at::Tensor(), at::Tensor(), at::Tensor()};
    at::AutoGradMode restored(create_graph);
    guard_second_order(create_graph, out, saved, "fusedloss.swiglu");
    return out;
  }
};

at::Tensor swiglu(const at::Tensor& y, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& weights, bool clamp, double clamp_value,
                  bool gate_at_bound, bool up_at_bound, bool inplace) {
  return Swiglu::apply(y, bias, weights, clamp, clamp_value, gate_at_bound, up_at_bound, inplace);
}

// ---- cross_entropy (python/fusedloss/cross_entropy.py), without a tp_group ----

// What a direct caller of a public op passes as class indices (_views.require_index_dtype):
// signed integers, or uint8/uint16/uint32 (uint64's may not fit int64).
void require_index_dtype(const at::Tensor& target) {
  const auto d = target.scalar_type();
  TORCH_CHECK_VALUE(d == at::kByte || d == at::kChar || d == at::kShort || d == at::kInt ||
                        d == at::kLong || d == at::kUInt16 || d == at::kUInt32,
                    "target.dtype: got ", d, ", expected an integer dtype (class indices; signed, "
                    "or uint8/uint16/uint32)");
}

// Class indices as the kernels read them (_views.index): int32/int64 as they are, any other
// integer dtype (checked by the caller) widened to int64; contiguous.
at::Tensor index_of(const at::Tensor& target) {
  at::Tensor t = target;
  if (t.scalar_type() != at::kInt && t.scalar_type() != at::kLong) t = t.to(at::kLong);
  return t.is_contiguous() ? t : t.reshape(-1).contiguous();
}

fusedloss::IndexView index_view(const at::Tensor& t) {
  return {t.data_ptr(), t.numel(),
          t.scalar_type() == at::kInt ? fusedloss::IndexType::I32 : fusedloss::IndexType::I64,
          backend_of(t)};
}

// The options as the Python schema carries them (enums as their integer values).
fusedloss::CrossEntropyOptions ce_options(int64_t ignore_index, double label_smoothing,
                                          int64_t formula, int64_t scope, double z_loss,
                                          int64_t reduction) {
  fusedloss::CrossEntropyOptions o;
  o.ignore_index = ignore_index;
  o.label_smoothing = float(label_smoothing);
  o.smoothing_formula = fusedloss::SmoothingFormula(formula);
  o.smoothing_scope = fusedloss::SmoothingScope(scope);
  o.z_loss = float(z_loss);
  o.reduction = fusedloss::Reduction(reduction);
  return o;
}

struct CrossEntropy : torch::autograd::Function<CrossEntropy> {
  // options: ignore_index, label_smoothing, smoothing formula and scope, z_loss and reduction
  // as the Python schema carries them (validated there); inplace: the backward writes the
  // gradient into the logits; in_forward: the forward does (sum/mean; the caller decided both,
  // _views.inplace_refused / storage_is_ours, and they are re-checked here: the op is public)
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& target,
                            int64_t ignore_index, double label_smoothing, int64_t formula,
                            int64_t scope, double z_loss, int64_t reduction, bool inplace,
                            bool in_forward) {
    c10::OptionalDeviceGuard device(logits.device());
    // (the Python caller checked these; the op is public as torch.ops.fusedloss.cross_entropy_eager)
    require_index_dtype(target);
    TORCH_CHECK_VALUE(target.device() == logits.device(), "target.device: got ", target.device(),
                      ", expected the logits' device ", logits.device());
    const bool ours = (inplace || in_forward) && storage_is_ours(logits);
    in_forward = in_forward && ours;
    const at::Tensor x = rows_of(logits);
    const at::Tensor t = index_of(in_forward ? apart_from(target, logits) : target);
    const auto o = ce_options(ignore_index, label_smoothing, formula, scope, z_loss, reduction);
    const auto f32 = logits.options().dtype(at::kFloat);
    const int64_t rows = x.size(0);
    at::Tensor loss = o.reduction == fusedloss::Reduction::None ? at::empty({rows}, f32) : at::empty({}, f32);
    at::Tensor lse = at::empty({rows}, f32), count = at::empty({}, f32);
    const fusedloss::CrossEntropyOutputs out{loss.data_ptr<float>(), lse.data_ptr<float>(),
                                             count.data_ptr<float>()};
    if (in_forward) {
      const auto xv = matrix(x);
      core_call(&CoreTable::cross_entropy_forward_with_grad, xv, index_view(t), o, out, xv, nullptr,
                stream_of(x));
    } else {
      core_call(&CoreTable::cross_entropy_forward, matrix(x), index_view(t), o, out, nullptr, stream_of(x));
    }
    // the logits now hold their gradient: an earlier autograd reader fails its version check
    if (in_forward) logits.unsafeGetTensorImpl()->bump_version();
    ctx->save_for_backward({logits, target, lse, count});  // the caller's target: its version checked
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->saved_data["formula"] = formula;
    ctx->saved_data["scope"] = scope;
    ctx->saved_data["z_loss"] = z_loss;
    ctx->saved_data["reduction"] = reduction;
    ctx->saved_data["mode"] = int64_t(in_forward ? 2 : (inplace && ours) ? 1 : 0);
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuse_if_consumed(ctx, "fusedloss.cross_entropy", "inplace_backward or grad_in_forward");
    const bool create_graph = at::GradMode::is_enabled();
    at::AutoGradMode no_grad(false);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &logits = saved[0], &lse = saved[2], &count = saved[3];
    c10::OptionalDeviceGuard device(logits.device());
    const int64_t mode = ctx->saved_data["mode"].toInt();
    // in place only while the logits' rows are still their own memory (else a new buffer)
    const at::Tensor own_rows = rows_view(logits);
    const bool into_logits = mode > 0 && own_rows.defined();
    TORCH_CHECK(mode < 2 || into_logits, "fusedloss.cross_entropy: the logits holding the "
                "gradient written in the forward changed layout before the backward");
    const at::Tensor x = own_rows.defined() ? own_rows : rows_of(logits);
    // may arrive expanded; the kernels read its data
    const at::Tensor gl = as_dtype(into_logits ? apart_from(grads[0], logits) : grads[0], at::kFloat).contiguous();
    at::Tensor grad;
    if (mode == 2) {
      core_call(&CoreTable::cross_entropy_scale_grad, matrix(x), gl.data_ptr<float>(), stream_of(x));
      grad = logits;
    } else {
      auto& d = ctx->saved_data;
      const auto o = ce_options(d["ignore_index"].toInt(), d["label_smoothing"].toDouble(),
                                d["formula"].toInt(), d["scope"].toInt(), d["z_loss"].toDouble(),
                                d["reduction"].toInt());
      grad = into_logits ? logits : at::empty(logits.sizes(), logits.options());
      const at::Tensor out_rows = into_logits ? x : rows_of(grad);
      const at::Tensor tt = index_of(into_logits ? apart_from(saved[1], logits) : saved[1]);
      core_call(&CoreTable::cross_entropy_backward, matrix(x), index_view(tt), lse.data_ptr<float>(),
                gl.data_ptr<float>(), count.data_ptr<float>(), o, matrix(out_rows), stream_of(x));
    }
    if (into_logits) mark_consumed(ctx, logits);
    variable_list out(10);
    out[0] = grad;
    at::AutoGradMode restored(create_graph);
    guard_second_order(create_graph, out, saved, "fusedloss.cross_entropy");
    return out;
  }
};

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
                         double label_smoothing, int64_t formula, int64_t scope, double z_loss,
                         int64_t reduction, bool inplace, bool in_forward) {
  // the gradient in the forward only where a node will take it (grad mode is off inside the
  // node's forward), and not in fp16 (a unit-upstream gradient rounded to fp16 loses the small
  // entries that loss scaling keeps): cross_entropy() decides the same
  in_forward = in_forward && at::GradMode::is_enabled() && logits.requires_grad() &&
               logits.scalar_type() != at::kHalf;
  return CrossEntropy::apply(logits, target, ignore_index, label_smoothing, formula, scope, z_loss,
                             reduction, inplace, in_forward);
}

// ---- linear_cross_entropy (python/fusedloss/linear_cross_entropy.py), without a tp_group
// or a weight_grad_accumulator; row_weight: the loss_mask as fp32 [N] (contiguous), or
// undefined ----

// The backward modes as the Python schema carries them: LinearCeBackward's values, and the
// forward alone (no gradient follows), which runs as the recompute form's forward.
constexpr int64_t kInForward = int64_t(fusedloss::LinearCeBackward::InForward);
constexpr int64_t kForwardOnly = -2;

// The C++ mode that runs a schema mode (_cpp_mode in linear_cross_entropy.py).
fusedloss::LinearCeBackward core_mode(int64_t mode) {
  return mode == kForwardOnly ? fusedloss::LinearCeBackward::Recompute
                              : fusedloss::LinearCeBackward(mode);
}

fusedloss::LinearCrossEntropyOptions lce_options(double softcap, int64_t workspace_bytes,
                                                 int64_t mode, bool tf32, int64_t vocab_block) {
  fusedloss::LinearCrossEntropyOptions o;
  o.logit_softcap = float(softcap);
  if (workspace_bytes > 0) o.workspace_bytes = size_t(workspace_bytes);
  o.allow_tf32 = tf32;
  o.backward_mode = core_mode(mode);
  o.vocab_block = vocab_block;
  return o;
}

fusedloss::MatrixView absent_matrix(const at::Tensor& like) {
  return {nullptr, 0, 1, 1, fusedloss::DType::F32, backend_of(like)};
}

struct LinearCrossEntropy : torch::autograd::Function<LinearCrossEntropy> {
  // options as the Python schema carries them (validated there): the cross-entropy's, the
  // soft-cap, the workspace (0: the default), the resolved backward mode, TF32, fp32
  // accumulation of the weight's gradient, and inplace (scale the saved gradients in place)
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& target,
                            const std::optional<at::Tensor>& row_weight_or_none,
                            int64_t ignore_index, double label_smoothing,
                            int64_t formula, int64_t scope, double z_loss, int64_t reduction,
                            double softcap, int64_t workspace_bytes, int64_t mode, bool tf32,
                            bool acc32, bool inplace) {
    c10::OptionalDeviceGuard device(hidden.device());
    const at::Tensor row_weight = or_undefined(row_weight_or_none);
    // (the Python caller checked these; the op is public as torch.ops.fusedloss.linear_cross_entropy_eager)
    require_index_dtype(target);
    TORCH_CHECK_VALUE(hidden.dim() == 2 || hidden.dim() == 3, "hidden: got ", hidden.dim(),
                      " dimensions, expected a 2-D [N, H] or 3-D [s, b, H] tensor");
    TORCH_CHECK_VALUE(weight.dim() == 2, "weight: got ", weight.dim(), " dimensions, expected [V_local, H]");
    TORCH_CHECK_VALUE(workspace_bytes >= 0, "workspace_bytes: got ", workspace_bytes,
                      ", expected >= 0 (0: the default)");
    for (const at::Tensor* t : {&weight, &target})
      TORCH_CHECK_VALUE(t->device() == hidden.device(), t == &weight ? "weight" : "target",
                        ".device: got ", t->device(), ", expected hidden's device ", hidden.device());
    if (row_weight.defined())
      TORCH_CHECK_VALUE(row_weight.scalar_type() == at::kFloat && row_weight.dim() == 1 &&
                            row_weight.is_contiguous() && row_weight.numel() == target.numel() &&
                            row_weight.device() == hidden.device(),
                        "row_weight: got ", row_weight.scalar_type(), " ", row_weight.sizes(),
                        " on ", row_weight.device(), ", expected a contiguous float32 [",
                        target.numel(), "] on hidden's device (the loss_mask, converted)");
    TORCH_CHECK_VALUE(!row_weight.defined() || !row_weight.requires_grad(),
                      "row_weight: got a tensor that requires grad, expected a constant (no "
                      "gradient flows to it)");
    const at::Tensor h = rows_of(hidden), w = rows_of(weight), t = index_of(target);
    const int64_t rows = h.size(0), H = h.size(1);
    const auto o = ce_options(ignore_index, label_smoothing, formula, scope, z_loss, reduction);
    const auto f32 = h.options().dtype(at::kFloat);
    at::Tensor loss = at::empty(reduction == int64_t(fusedloss::Reduction::None)
                                    ? at::IntArrayRef{rows} : at::IntArrayRef{}, f32);
    at::Tensor lse = at::empty({rows}, f32), count = at::empty({}, f32);
    fusedloss::LinearCrossEntropyOutputs out;
    out.loss = loss.data_ptr<float>();
    out.lse = lse.data_ptr<float>();
    out.valid_count = count.data_ptr<float>();
    if (mode == kInForward && row_weight.defined()) out.row_weight = row_weight.data_ptr<float>();
    at::Tensor dh, dw;  // in_forward: the gradients for a unit upstream gradient
    if (mode == kInForward) {
      dh = at::empty({rows, H}, h.options());
      dw = at::empty({w.size(0), H}, acc32 ? f32 : w.options());
      out.dhidden = matrix(dh);
      out.dweight = matrix(dw);
    } else {
      dh = at::empty({0}, f32), dw = at::empty({0}, f32);
      out.dhidden = out.dweight = absent_matrix(h);
    }
    core_call(&CoreTable::linear_cross_entropy_forward, matrix(h), matrix(w), index_view(t), o,
              lce_options(softcap, workspace_bytes, mode, tf32, 0), out, nullptr, stream_of(h));
    // the row weights only where the backward reads them (in_forward): a mask changed in place
    // after a recompute forward is no error
    ctx->save_for_backward({hidden, weight, target, lse, count, dh, dw,
                            mode == kInForward ? row_weight : at::Tensor()});
    auto& d = ctx->saved_data;
    d["ignore_index"] = ignore_index;
    d["label_smoothing"] = label_smoothing;
    d["formula"] = formula;
    d["scope"] = scope;
    d["z_loss"] = z_loss;
    d["reduction"] = reduction;
    d["softcap"] = softcap;
    d["workspace_bytes"] = workspace_bytes;
    d["mode"] = mode;
    d["tf32"] = tf32;
    d["acc32"] = acc32;
    // scaled where they are only when they are already in the inputs' dtypes (owned here alone)
    d["inplace"] = inplace && mode == kInForward && dh.scalar_type() == hidden.scalar_type() &&
                   dw.scalar_type() == weight.scalar_type();
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuse_if_consumed(ctx, "fusedloss.linear_cross_entropy", "inplace_backward",
                       "scaled the gradients its forward saved in place (the inputs are untouched)");
    const bool create_graph = at::GradMode::is_enabled();
    at::AutoGradMode no_grad(false);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &hidden = saved[0], &weight = saved[1], &lse = saved[3], &count = saved[4];
    const at::Tensor &saved_dh = saved[5], &saved_dw = saved[6], &row_weight = saved[7];
    c10::OptionalDeviceGuard device(hidden.device());
    auto& d = ctx->saved_data;
    const int64_t mode = d["mode"].toInt();
    const bool inplace = d["inplace"].toBool();
    const at::Tensor h = rows_of(hidden), w = rows_of(weight), t = index_of(saved[2]);
    // recompute into a 16-bit weight gradient, exactly: vocabulary blocks outside, each summing
    // over all tokens in fp32 (linear_cross_entropy.py: _run_backward)
    const int64_t block = fusedloss::linear_cross_entropy_backward_vocab_block(
        core_mode(mode), d["acc32"].toBool(), dtype_of(weight), h.size(1));
    const auto o = ce_options(d["ignore_index"].toInt(), d["label_smoothing"].toDouble(),
                              d["formula"].toInt(), d["scope"].toInt(), d["z_loss"].toDouble(),
                              d["reduction"].toInt());
    const auto lo = lce_options(d["softcap"].toDouble(), d["workspace_bytes"].toInt(), mode,
                                d["tf32"].toBool(), block);
    // may arrive expanded; the kernels read its data
    const at::Tensor gl = as_dtype(grads[0], at::kFloat).contiguous();
    fusedloss::LinearCrossEntropyOutputs kept;
    kept.dhidden = mode == kInForward ? matrix(saved_dh) : absent_matrix(h);
    kept.dweight = mode == kInForward ? matrix(saved_dw) : absent_matrix(h);
    if (mode == kInForward && row_weight.defined()) kept.row_weight = row_weight.data_ptr<float>();
    const at::Tensor dh = inplace ? saved_dh : at::empty({h.size(0), h.size(1)}, h.options());
    const at::Tensor dw = inplace ? saved_dw : at::empty(weight.sizes(), weight.options());
    fusedloss::LinearCrossEntropyGrads out;
    out.dhidden = matrix(dh);
    out.dweight = matrix(rows_of(dw));
    core_call(&CoreTable::linear_cross_entropy_backward, matrix(h), matrix(w), index_view(t),
              lse.data_ptr<float>(), gl.data_ptr<float>(), count.data_ptr<float>(), o, lo, kept,
              out, stream_of(h));
    if (inplace) mark_consumed(ctx, saved_dh);
    variable_list result(16);
    result[0] = dh.view(hidden.sizes());
    result[1] = inplace ? dw.view(weight.sizes()) : dw;  // (a new dw has weight's shape: no view)
    at::AutoGradMode restored(create_graph);
    guard_second_order(create_graph, result, saved, "fusedloss.linear_cross_entropy");
    return result;
  }
};

at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                const at::Tensor& target,
                                const std::optional<at::Tensor>& row_weight, int64_t ignore_index,
                                double label_smoothing, int64_t formula, int64_t scope,
                                double z_loss, int64_t reduction, double softcap,
                                int64_t workspace_bytes, int64_t mode, bool tf32, bool acc32,
                                bool inplace) {
  // Auto (a direct call may pass it): what the core resolves it to; the forward alone where no
  // node will take gradients (linear_cross_entropy.py: _resolve_mode)
  if (mode == int64_t(fusedloss::LinearCeBackward::Auto)) {
    fusedloss::LinearCeBackward resolved{};
    core_call(&CoreTable::resolve_linear_ce_backward, fusedloss::LinearCeBackward::Auto,
              fusedloss::Reduction(reduction), dtype_of(hidden),
              row_weight.has_value() && row_weight->defined() && row_weight->numel() > 0,
              &resolved);  // (no rows: nothing to weight, and an empty tensor has no address)
    mode = int64_t(resolved);
  }
  if (!at::GradMode::is_enabled() || !(hidden.requires_grad() || weight.requires_grad()))
    mode = kForwardOnly;
  return LinearCrossEntropy::apply(hidden, weight, target, row_weight,
                                   ignore_index, label_smoothing, formula,
                                   scope, z_loss, reduction, softcap, workspace_bytes, mode, tf32,
                                   acc32, inplace);
}

}  // namespace

// Called by fusedloss/_native.py right after loading this library, with fusedloss._C's table
// and its size: 0 when attached, 1 when the table's layout is not this library's (a _C from
// another build), which leaves the nodes unusable and the Python nodes serving.
extern "C" __attribute__((visibility("default"))) int fusedloss_torch_attach(const CoreTable* table,
                                                                            uint32_t size) {
  if (!table || size != sizeof(CoreTable) || table->size != sizeof(CoreTable) ||
      table->version != fusedloss::python::kCoreTableVersion)
    return 1;
  const CoreTable& t = *table;
  for (const void* entry : {(const void*)t.rms_norm_forward, (const void*)t.rms_norm_backward_workspace_bytes,
                            (const void*)t.rms_norm_backward, (const void*)t.swiglu_forward,
                            (const void*)t.swiglu_backward, (const void*)t.cross_entropy_forward,
                            (const void*)t.cross_entropy_forward_with_grad, (const void*)t.cross_entropy_backward,
                            (const void*)t.cross_entropy_scale_grad, (const void*)t.linear_cross_entropy_forward,
                            (const void*)t.linear_cross_entropy_backward, (const void*)t.set_scratch_allocator,
                            (const void*)t.resolve_linear_ce_backward})
    if (!entry) return 1;
  g_core.store(table, std::memory_order_release);
  return 0;
}

namespace {

// ---- the core's CUDA scratch from torch's caching allocator (fusedloss.set_scratch_allocator) ----
//
// A block is a uint8 tensor on the current device, allocated on its current stream; releasing
// it drops the tensor, which returns the block to torch's cache for work queued on that stream
// from then on: the same stream-ordered rule as cudaFreeAsync. Scratch for any other stream
// (another device's, or a stream that is not the current one) is not served here: the core
// then takes cudaMallocAsync for it. Out of memory in torch's cache is the call's
// torch.OutOfMemoryError, as a torch allocation of the same size would be.

struct TorchScratch {
  std::mutex mu;
  std::unordered_map<void*, c10::DataPtr> held;
};

TorchScratch& torch_scratch() {
  static auto* scratch = new TorchScratch;  // never destroyed: blocks may come back during exit
  return *scratch;
}

// The block comes straight from the registered CUDA allocator (torch's caching allocator), not
// through at::empty: no dispatcher on the way (a dispatch mode would see an allocation in the
// middle of a core call; deterministic mode would fill every block).
bool torch_scratch_serves(fusedloss::Stream stream, void*) noexcept {
  try {
    const c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
    return cuda.getStream(cuda.getDevice()).native_handle() == stream;
  } catch (...) {  // no CUDA: cudaMallocAsync reports it
    return false;
  }
}

void* torch_scratch_allocate(size_t bytes, fusedloss::Stream, void*) noexcept {
  try {
    c10::DataPtr block = c10::GetAllocator(c10::DeviceType::CUDA)->allocate(bytes);
    void* ptr = block.get();
    if (!ptr) return nullptr;
    TorchScratch& s = torch_scratch();
    std::lock_guard<std::mutex> lock(s.mu);
    s.held.emplace(ptr, std::move(block));
    return ptr;
  } catch (...) {  // out of memory in torch's cache: the core raises OutOfMemory
    return nullptr;
  }
}

void torch_scratch_release(void* ptr, fusedloss::Stream, void*) noexcept {
  c10::DataPtr block;  // freed after the lock, into torch's cache
  TorchScratch& s = torch_scratch();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.held.find(ptr);
    if (it == s.held.end()) return;
    block = std::move(it->second);
    s.held.erase(it);
  }
}

}  // namespace

// Called by fusedloss.set_scratch_allocator: 1 takes the core's CUDA scratch from torch's
// caching allocator, 0 gives it back to cudaMallocAsync. Returns 0, or 1 when the core is not
// attached or refused.
extern "C" __attribute__((visibility("default"))) int fusedloss_torch_scratch(int from_torch) {
  const CoreTable* core = g_core.load(std::memory_order_acquire);
  if (!core) return 1;
  static const fusedloss::ScratchAllocator allocator{&torch_scratch_allocate, &torch_scratch_release,
                                                      nullptr, &torch_scratch_serves};
  return core->set_scratch_allocator(from_torch ? &allocator : nullptr) ? 1 : 0;
}

// Eager entry points only: the traced path uses the Python custom ops of the same names
// without the "_eager" suffix.
TORCH_LIBRARY_FRAGMENT(fusedloss, m) {
  m.def("rms_norm_eager(Tensor x, Tensor weight, float eps, bool zero_centered_gamma) -> Tensor");
  m.def("rms_norm_residual_eager(Tensor x, Tensor weight, Tensor residual, float eps, "
        "bool zero_centered_gamma) -> (Tensor, Tensor)");
  m.def("swiglu_eager(Tensor y, Tensor? bias, Tensor? weights, bool clamp, float clamp_value, "
        "bool clamp_gate_grad_at_bound, bool clamp_up_grad_at_bound, bool inplace) -> Tensor");
  m.def("cross_entropy_eager(Tensor logits, Tensor target, int ignore_index, float label_smoothing, "
        "int smoothing_formula, int smoothing_scope, float z_loss, int reduction, bool inplace, "
        "bool grad_in_forward) -> Tensor");
  m.def("linear_cross_entropy_eager(Tensor hidden, Tensor weight, Tensor target, Tensor? row_weight, "
        "int ignore_index, "
        "float label_smoothing, int smoothing_formula, int smoothing_scope, float z_loss, "
        "int reduction, float logit_softcap, int workspace_bytes, int backward_mode, bool tf32, "
        "bool fp32_dweight, bool inplace) -> Tensor");
}

TORCH_LIBRARY_IMPL(fusedloss, CompositeImplicitAutograd, m) {
  m.impl("rms_norm_eager", &rms_norm);
  m.impl("rms_norm_residual_eager", &rms_norm_residual);
  m.impl("swiglu_eager", &swiglu);
  m.impl("cross_entropy_eager", &cross_entropy);
  m.impl("linear_cross_entropy_eager", &linear_cross_entropy);
}
