// The C++ autograd node of fusedloss.linear_cross_entropy (python/fusedloss/linear_cross_entropy.py),
// without a tp_group or a weight_grad_accumulator; row_weight: the loss_mask as fp32 [N]
// (contiguous), or undefined; nodes.h says why C++, and what the nodes share.
#include "nodes.h"

#include <torch/library.h>

namespace fusedloss::torch_nodes {
namespace {

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
    keep_ce_options(ctx, ignore_index, label_smoothing, formula, scope, z_loss, reduction, softcap);
    keep(ctx, {{"workspace_bytes", workspace_bytes}, {"mode", mode}, {"tf32", tf32}, {"acc32", acc32},
               // scaled where they are only when they are already in the inputs' dtypes (owned
               // here alone)
               {"inplace", inplace && mode == kInForward && dh.scalar_type() == hidden.scalar_type() &&
                               dw.scalar_type() == weight.scalar_type()}});
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
    auto o = kept_ce_options(ctx);
    o.logit_softcap = 0.0f;  // the cap travels in the linear options (lo), as in the forward
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
}  // namespace fusedloss::torch_nodes

TORCH_LIBRARY_FRAGMENT(fusedloss, m) {
  m.def("linear_cross_entropy_eager(Tensor hidden, Tensor weight, Tensor target, Tensor? row_weight, "
        "int ignore_index, float label_smoothing, int smoothing_formula, int smoothing_scope, "
        "float z_loss, int reduction, float logit_softcap, int workspace_bytes, int backward_mode, "
        "bool tf32, bool fp32_dweight, bool inplace) -> Tensor");
}

TORCH_LIBRARY_IMPL(fusedloss, CompositeImplicitAutograd, m) {
  m.impl("linear_cross_entropy_eager", &fusedloss::torch_nodes::linear_cross_entropy);
}
