"""GPTModel's output layer and loss as one fusedloss.linear_cross_entropy (the patch's
linear_cross_entropy=True), and the cross-entropy routes of LanguageModule.compute_language_model_loss
that are not Megatron's autograd Functions ('te', 'liger').

The head is replaced inside GPTModel._postprocess, after everything Megatron does before the
output layer: with labels on the last pipeline stage (training or evaluation), the hidden states
go through the vocab-parallel linear cross-entropy and the [s, b, V/tp] logits never exist;
without labels, in inference, or before the last stage, Megatron's own _postprocess runs.
"""
from types import SimpleNamespace

import torch

import fusedloss
from fusedloss._distributed import fingerprint, rank_checks
from fusedloss._views import require_tensor
from fusedloss.cross_entropy import check_targets_on_host
from fusedloss.linear_cross_entropy import validate_inputs as validate_linear_ce_inputs
from fusedloss.linear_cross_entropy import (chunk_rows, runs_in_forward, validate_loss_mask,
                                            wants_grad)

from . import state

_OP = "GPTModel's linear cross-entropy"


class _IntoMainGrad(torch.autograd.Function):
    """Identity on the output weight whose backward does what Megatron's linear does under
    gradient-accumulation fusion: the weight gradient is added to `weight.main_grad` and autograd
    gets a placeholder (zeros when Megatron asks for them through `zero_out_wgrad`, as for a
    weight shared with the embedding) with `grad_added_to_main_grad` set, so Megatron's DDP hook
    does not add it again. When the op has already added it (an fp32 main_grad is its
    weight_grad_accumulator, looked up at the backward: Megatron-FSDP binds it late), the
    gradient arriving here is its zeros."""

    @staticmethod
    def forward(ctx, weight, added):
        ctx.weight, ctx.added = weight, added  # added: [bool], set by the op's backward
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        weight = ctx.weight
        if not ctx.added[0]:
            weight.main_grad.add_(grad)
        if not hasattr(weight, "grad_added_to_main_grad"):
            return None, None
        weight.grad_added_to_main_grad = True
        placeholder = (torch.zeros_like(grad) if getattr(weight, "zero_out_wgrad", False)
                       else torch.empty_like(grad))
        return placeholder, None


def _main_grad_if_fp32(param):
    """(accumulator, added): the op's weight_grad_accumulator, a callable that returns the
    parameter's main_grad at the backward when it is fp32 (the gradient then never rounds to the
    weight's dtype, as in Megatron's fused wgrad GEMM) and records that it did; None otherwise
    (a bf16 main_grad, grad_reduce_in_fp32=False: the gradient comes through autograd)."""
    added = [False]

    def accumulator():
        main_grad = getattr(param, "main_grad", None)
        added[0] = main_grad is not None and main_grad.dtype == torch.float32
        return main_grad if added[0] else None

    return accumulator, added


def _tp_group(module):
    group = getattr(getattr(module, "pg_collection", None), "tp", None)
    return group if group is not None else state.tp_group_from_parallel_state()


def _refuse_unsupported(model):
    """A clear error for what the fused head cannot honour (instead of a wrong gradient)."""
    cfg, layer = model.config, model.output_layer
    why = None
    if getattr(model, "mtp_process", False) or getattr(cfg, "mtp_num_layers", None):
        why = (f"multi-token prediction heads (config.mtp_num_layers="
               f"{getattr(cfg, 'mtp_num_layers', None)}) are not supported")
    elif getattr(model, "use_fused_lce", False):
        why = "the model already uses Megatron's own fused linear cross-entropy"
    elif getattr(layer, "bias", None) is not None:
        why = "the output layer has a bias, which the fused head does not add"
    elif getattr(cfg, "defer_embedding_wgrad_compute", False):
        why = ("config.defer_embedding_wgrad_compute=True defers the output weight's gradient to "
               "Megatron's pipeline flush, which the fused head computes at once")
    elif getattr(cfg, "use_mup", False):
        why = "config.use_mup=True scales the logits (MuP), which the fused head does not"
    if why:
        raise RuntimeError(f"fusedloss.megatron: linear_cross_entropy=True: {why}; patch with "
                           "linear_cross_entropy=False for this model")


def _run_forward_pre_hooks(module, args):
    """The module's own forward pre-hooks, which calling its forward would have run: Megatron's
    DDP waits there for the module's parameter all-gather (overlap_param_gather), so the weight
    read below is the gathered one. Their return values (replaced arguments) do not apply: the
    fused head reads the weight, not the module's output."""
    with_kwargs = getattr(module, "_forward_pre_hooks_with_kwargs", {})
    for key, hook in list(module._forward_pre_hooks.items()):
        if key in with_kwargs:
            hook(module, args, {})
        else:
            hook(module, args)


def _fingerprint(options, hidden, weight, labels, loss_mask, gradient) -> int:
    """The same int on every rank for what the op's own agreement compared besides rows and
    V_local: its options and torch's
    TF32 setting, the dtypes and device types, H (with rows and V_local these set the op's
    chunking), and the batch and sequence sizes apart (equal products of unequal ones would mix
    shards in the gather), whether a loss_mask came and whether a gradient follows (they set
    the op's mode, and with it the collectives: the forward alone gathers every row's
    statistics at once, the in-forward mode a chunk at a time), and torch.autocast's state (the
    op casts hidden and weight to its dtype, which sets the chunking too)."""
    device = hidden.device.type
    autocast = torch.is_autocast_enabled(device) and str(torch.get_autocast_dtype(device))
    return fingerprint(**options, allow_tf32=bool(torch.backends.cuda.matmul.allow_tf32),
                       autocast=autocast or None,
                       hidden_dtype=str(hidden.dtype), weight_dtype=str(weight.dtype),
                       hidden_device=hidden.device.type, weight_device=weight.device.type,
                       H=weight.shape[-1], labels_shape=tuple(labels.shape),
                       loss_mask=loss_mask is not None, gradient=gradient)


def _check_inputs(hidden, weight, labels, loss_mask, sequence_parallel, tp_size):
    """What the gather or copy before the op needs equal on every rank (a rank whose hidden
    states do not fit would hang or mix shards in Megatron's collective), and the op's own
    per-tensor checks, which the op, called with check_shard_agreement=False, would otherwise
    raise on this rank alone: a rank that fails any of them fails inside the head's agreement."""
    require_tensor(hidden, "hidden_states")
    require_tensor(weight, "weight")
    require_tensor(labels, "labels")
    if hidden.dim() != 3 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden_states: got shape {tuple(hidden.shape)} for an output weight of "
                         f"shape {tuple(weight.shape)}, expected [s, b, H] and [V_local, H]")
    s = hidden.shape[0] * (tp_size if sequence_parallel else 1)
    if labels.dim() != 2 or tuple(labels.shape) != (hidden.shape[1], s):
        raise ValueError(f"labels: got shape {tuple(labels.shape)}, expected [b, s] = "
                         f"[{hidden.shape[1]}, {s}] from hidden_states {tuple(hidden.shape)}"
                         + (f" gathered over {tp_size} sequence-parallel ranks" if sequence_parallel else ""))
    # the op's checks (dtypes, devices, integer labels), on this rank's rows of the labels
    validate_linear_ce_inputs(hidden, weight, labels.transpose(0, 1)[:hidden.shape[0]])
    if loss_mask is not None:
        validate_loss_mask(loss_mask, labels, hidden, True, "none")


def fused_head_loss(model, hidden, labels, loss_mask=None):
    """hidden [s(/tp under sequence parallel), b, H], labels [b, s] -> per-token loss [b, s]
    fp32, as output_layer + compute_language_model_loss return it. With the loss_mask [b, s]
    that Megatron's forward received (and linear_cross_entropy_backward="auto": opt-in), the op computes
    the gradients of sum(loss_mask * loss) in the forward (3 GEMMs, not 4): Megatron's loss_func
    reduces exactly that, times one scalar. The input gradient leaves as
    Megatron's ColumnParallelLinear leaves it: reduce-scattered along tokens under sequence
    parallel (the gather's backward), all-reduced otherwise at TP > 1 (the copy's backward);
    the op hands back this rank's partial sum for them to reduce."""
    from megatron.core.tensor_parallel import mappings
    layer = model.output_layer
    tp = getattr(layer, "tp_group", None)
    tp = tp if tp is not None else _tp_group(model)
    group = state.guard(tp, _OP)
    if group is None:
        _refuse_unsupported(model)  # (at TP > 1 inside the agreement: never one rank alone)
    weight = (model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights
              else layer.weight)
    _run_forward_pre_hooks(layer, (hidden,))
    options = state.lce_options()
    if options["backward_mode"] == "recompute":
        loss_mask = None  # any reduction of the per-token loss: the mask is not needed
    if group is not None:
        # One agreement for the head and the op (one host sync a call): what the op's own
        # would compare (rows, V_local, options, dtypes, and CPU targets) is agreed here, before
        # Megatron's gather or copy, which would hang or mix shards on ranks that disagree.
        check = options["check_shard_agreement"]
        with rank_checks(group, check, _OP) as checks:
            _refuse_unsupported(model)
            size = state.group_size(group)
            _check_inputs(hidden, weight, labels, loss_mask, layer.sequence_parallel, size)
            if check:
                check_targets_on_host(labels, SimpleNamespace(
                    vocab_global=weight.shape[0] * size, ignore_index=options["ignore_index"]),
                    "labels")
            # last: a rank that failed above sends no shapes (rows = -1), so its own error is
            # the one every rank raises
            checks.rows, checks.v_local = labels.numel(), weight.shape[0]
            # the op's rules, on the tensors it will get (the gather keeps requires_grad)
            checks.options = _fingerprint(options, hidden, weight, labels, loss_mask,
                                          wants_grad(hidden, weight))
            # the labels, and the mask the in-forward gradients are weighted by, as the op's own
            # agreement compares them (a checksum): every rank computes the loss of the same tokens
            in_forward = runs_in_forward(options["backward_mode"], hidden, weight, labels.numel(),
                                         loss_mask is not None)
            checks.target = (labels, loss_mask.to(torch.float32)) if in_forward else labels
            if in_forward:  # one collective per token chunk
                checks.chunk_rows = chunk_rows(hidden.dtype, labels.numel(), weight.shape[0],
                                               options["workspace_bytes"])
        options = dict(options, check_shard_agreement=False)  # agreed above
        if layer.sequence_parallel:
            hidden = mappings.gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=True, group=group)
        else:
            hidden = mappings.copy_to_tensor_model_parallel_region(hidden, group=group)
    accumulator = None
    if getattr(layer, "gradient_accumulation_fusion", False) and hasattr(weight, "main_grad"):
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            accumulator, added = _main_grad_if_fp32(weight)
        else:
            added = [False]
        weight = _IntoMainGrad.apply(weight, added)
    if loss_mask is not None:
        _check_loss_function_once(hidden)
    loss = fusedloss.linear_cross_entropy(
        hidden, weight, labels.transpose(0, 1), **options, tp_group=group,
        weight_grad_accumulator=accumulator,
        loss_mask=None if loss_mask is None else loss_mask.transpose(0, 1))
    return loss.transpose(0, 1).contiguous()


def _check_loss_function_once(hidden):
    """linear_cross_entropy_backward="auto" needs a loss function that reduces
    c * sum(loss_mask * loss). On CUDA the op checks that on the device (no host sync): a loss
    function that does not fit gets NaN gradients and the device error word. Read here once, at
    the first backward after the patch (one host sync, when the hidden states' gradient is
    done), so that such a loss raises at its first step rather than training on NaN. A backward
    captured into a CUDA graph cannot sync: the check waits for the next one that is not. (On
    the CPU the backward raises by itself.)"""
    if (state.CONFIG.get("loss_function_checked") or hidden.device.type != "cuda"
            or not hidden.requires_grad or torch.compiler.is_compiling()):
        return
    state.CONFIG["loss_function_checked"] = True

    def check(grad):
        if torch.cuda.is_current_stream_capturing():
            state.CONFIG["loss_function_checked"] = False  # the next forward arms it again
        else:
            fusedloss.check_device_errors(grad.device)
        return grad

    hidden.register_hook(check)


def make_postprocess(original):
    """GPTModel._postprocess with the fused head where labels are given (see the module doc)."""
    names = state.parameter_names(original)[1:]  # without self

    def _postprocess(self, *args, **kwargs):
        if args:  # Megatron's forward passes keywords; anything else is bound by name here
            kwargs.update(zip(names, args))
            args = ()
        labels = kwargs.get("labels")
        if (labels is None or not self.post_process
                or (kwargs.get("inference_context") is not None and not self.training)):
            return original(self, **kwargs)
        return fused_head_loss(self, kwargs["hidden_states"], labels, kwargs.get("loss_mask"))

    _postprocess.__fusedloss_original__ = original
    return _postprocess


def make_lm_loss(original, replaced_routes):
    """LanguageModule.compute_language_model_loss: 'native' and the unfused route run Megatron's
    own method, which reaches the patched autograd Functions; the routes in `replaced_routes`
    are computed here at the method's contract ([b, s] labels, [s, b, V/tp] logits -> [b, s]
    fp32 per-token loss); any other route runs Megatron's own with a warning naming it."""

    def compute_language_model_loss(self, labels, logits, *args, **kwargs):
        cfg = self.config
        route = cfg.cross_entropy_fusion_impl if cfg.cross_entropy_loss_fusion else "unfused"
        if route == "native" or route == "unfused":
            return original(self, labels, logits, *args, **kwargs)
        if route in replaced_routes:
            group = state.guard(_tp_group(self), f"compute_language_model_loss ({route!r} route)")
            loss = state.cross_entropy(logits, labels.transpose(0, 1), group, None)
            return loss.transpose(0, 1).contiguous()
        state.warn_once(("route", route), f"fusedloss.megatron: cross_entropy_fusion_impl={route!r} "
                        "is not replaced by fusedloss in this megatron-core; Megatron's own "
                        "cross-entropy runs there")
        return original(self, labels, logits, *args, **kwargs)

    compute_language_model_loss.__fusedloss_original__ = original
    return compute_language_model_loss
