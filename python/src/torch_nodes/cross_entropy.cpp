// The C++ autograd node of fusedloss.cross_entropy (python/fusedloss/cross_entropy.py), without a tp_group; nodes.h says why C++, and what the nodes share.
#include "nodes.h"

#include <torch/library.h>

namespace fusedloss::torch_nodes {
namespace {

struct CrossEntropy : torch::autograd::Function<CrossEntropy> {
  // options: ignore_index, label_smoothing, smoothing formula and scope, z_loss, reduction and
  // the logit soft cap
  // as the Python schema carries them (validated there); inplace: the backward writes the
  // gradient into the logits; in_forward: the forward does (sum/mean; the caller decided both,
  // _views.inplace_refused / storage_is_ours, and they are re-checked here: the op is public)
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& target,
                            int64_t ignore_index, double label_smoothing, int64_t formula,
                            int64_t scope, double z_loss, int64_t reduction, double softcap,
                            bool inplace, bool in_forward) {
    c10::OptionalDeviceGuard device(logits.device());
    // (the Python caller checked these; the op is public as torch.ops.fusedloss.cross_entropy_eager)
    require_index_dtype(target);
    TORCH_CHECK_VALUE(target.device() == logits.device(), "target.device: got ", target.device(),
                      ", expected the logits' device ", logits.device());
    const bool ours = (inplace || in_forward) && storage_is_ours(logits);
    in_forward = in_forward && ours;
    const at::Tensor x = rows_of(logits);
    const at::Tensor t = index_of(in_forward ? apart_from(target, logits) : target);
    const auto o = ce_options(ignore_index, label_smoothing, formula, scope, z_loss, reduction, softcap);
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
    keep_ce_options(ctx, ignore_index, label_smoothing, formula, scope, z_loss, reduction, softcap);
    keep(ctx, {{"mode", int64_t(in_forward ? 2 : (inplace && ours) ? 1 : 0)}});
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
      const auto o = kept_ce_options(ctx);
      grad = into_logits ? logits : at::empty(logits.sizes(), logits.options());
      const at::Tensor out_rows = into_logits ? x : rows_of(grad);
      const at::Tensor tt = index_of(into_logits ? apart_from(saved[1], logits) : saved[1]);
      core_call(&CoreTable::cross_entropy_backward, matrix(x), index_view(tt), lse.data_ptr<float>(),
                gl.data_ptr<float>(), count.data_ptr<float>(), o, matrix(out_rows), stream_of(x));
    }
    if (into_logits) mark_consumed(ctx, logits);
    variable_list out(11);
    out[0] = grad;
    at::AutoGradMode restored(create_graph);
    guard_second_order(create_graph, out, saved, "fusedloss.cross_entropy");
    return out;
  }
};

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
                         double label_smoothing, int64_t formula, int64_t scope, double z_loss,
                         int64_t reduction, double softcap, bool inplace, bool in_forward) {
  // the gradient in the forward only where a node will take it (grad mode is off inside the
  // node's forward), and not in fp16 (a unit-upstream gradient rounded to fp16 loses the small
  // entries that loss scaling keeps): cross_entropy() decides the same
  in_forward = in_forward && at::GradMode::is_enabled() && logits.requires_grad() &&
               logits.scalar_type() != at::kHalf;
  return CrossEntropy::apply(logits, target, ignore_index, label_smoothing, formula, scope, z_loss,
                             reduction, softcap, inplace, in_forward);
}

}  // namespace
}  // namespace fusedloss::torch_nodes

TORCH_LIBRARY_FRAGMENT(fusedloss, m) {
  m.def("cross_entropy_eager(Tensor logits, Tensor target, int ignore_index, float label_smoothing, "
        "int smoothing_formula, int smoothing_scope, float z_loss, int reduction, "
        "float logit_softcap, bool inplace, bool grad_in_forward) -> Tensor");
}

TORCH_LIBRARY_IMPL(fusedloss, CompositeImplicitAutograd, m) {
  m.impl("cross_entropy_eager", &fusedloss::torch_nodes::cross_entropy);
}
