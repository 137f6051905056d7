"""fusedloss.linear_distillation_loss: knowledge distillation between a student's and a
teacher's next-token distributions from each model's last hidden states and LM-head weight,
without the [tokens, V] logits of either (include/fusedloss/linear_distillation.h).

Each token chunk runs two GEMMs (the student's and the teacher's logits of the same rows). A
mean or a sum whose gradient follows ("in_forward") runs the student's gradient GEMMs in the
same pass (4 GEMMs in all) and keeps the gradients until the backward scales them; otherwise
the forward keeps 32 B a token and the backward recomputes both logits (6 GEMMs). The teacher
is a constant: no gradient flows to it.

tp_group of size > 1 (vocab-parallel): both weights are this rank's vocabulary shard; each rank
computes its shard's statistics (32 B a token), one all-gather merges them (jsd: a second pass
over the logits and an all-reduce of 8 B a token), and every rank gets the same losses. The
backward is local; dhidden_reduction "all_reduce" (default) sums dhidden over the group,
"partial" leaves this rank's part to the caller.
"""
import functools
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _C
from ._args import check_distillation_shapes
from ._distributed import (deferred_rejection, fingerprint, group_name, group_size,
                           rank_checks, resolve_group)
from ._head import as_workspace_bytes, group_place, set_shard_and_chunking, validate_head_operands
from ._op import FusedOp
from ._sequence_parallel import gather_token_slices, own_rows_buffer, sum_into_own_rows
from ._views import (_INDEX, agreement_flag, as_bool, as_choice, as_float, as_int,
                     autocast_operands, choice_name, device_of, index, matrix, require_same_device,
                     require_tensor, rows_of, stream_of, validated, values_in)
from .cross_entropy import check_targets_on_host

_OP = "fusedloss.linear_distillation_loss"
_DIVERGENCE = {"forward_kl": _C.Divergence.ForwardKL, "reverse_kl": _C.Divergence.ReverseKL,
               "jsd": _C.Divergence.JSD}
_REDUCTIONS = {"mean": 0, "sum": 1, "none": 2}


_MODES = {"auto": 0, "in_forward": 1, "recompute": 2}
_DHIDDEN = {"partial": 0, "all_reduce": 1, "reduce_scatter": 2}


@functools.lru_cache(maxsize=256)
def _options(divergence, beta, temperature, hard, ignore_index, workspace_bytes, tf32, rank,
             v_local, world, rows, has_target):
    o = _C.LinearDistillationOptions()
    o.divergence = _DIVERGENCE[divergence]
    o.beta = beta
    o.temperature = temperature
    o.hard_label_weight = hard
    o.ignore_index = ignore_index
    set_shard_and_chunking(o, workspace_bytes, tf32, rank, v_local, world)
    validated(_C.validate_linear_distillation_options, o, rows, v_local, has_target)
    return o


def _call_options(sh, sw, target, divergence, beta, temperature, hard, ignore_index,
                  workspace_bytes, tf32, group):
    """(the C++ options of a call on these rows, its group or None)."""
    g, rank, world = group_place(group)
    return _options(divergence, beta, temperature, hard, ignore_index, workspace_bytes, tf32, rank,
                    sw.size(0), world, sh.size(0), target is not None), g


def _target_view(target: Optional[Tensor], hidden: Tensor):
    """(the targets to keep alive, their view): an absent view (every row counts) for None."""
    if target is None:
        return None, _C.IndexView(0, hidden.size(0), _INDEX[torch.int64], device_of(hidden))
    return index(target.reshape(-1), "target")


def _four(student_hidden, student_weight, teacher_hidden, teacher_weight):
    return tuple(rows_of(t) for t in (student_hidden, student_weight, teacher_hidden,
                                      teacher_weight))


def _forward(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor,
             teacher_weight: Tensor, target: Optional[Tensor], divergence: str, beta: float,
             temperature: float, hard: float, ignore_index: int, workspace_bytes: int,
             tf32: bool, group: str, check: bool, grad: bool,
             dhidden_reduction: int) -> Tuple[Tensor, Tensor]:
    """-> (per-token losses [N] fp32, the rows' stats for the backward [N * 32] bytes). At
    TP > 1 with check, the shard agreement (rows, V_local, the targets, the options, whether a
    gradient follows) runs first, after everything this rank allocates."""
    g = resolve_group(group) if group else None
    options = (fingerprint(divergence=divergence, beta=beta, temperature=temperature, hard=hard,
                           ignore_index=ignore_index, student=str(student_hidden.dtype),
                           teacher=str(teacher_hidden.dtype), H_s=student_hidden.size(-1),
                           H_t=teacher_hidden.size(-1), target=target is not None,
                           dhidden_reduction=choice_name(_DHIDDEN, dhidden_reduction),
                           gradient=grad)
               if g is not None and check else 0)
    with rank_checks(g, check, _OP, options=options) as checks:
        sh, sw, th, tw = _four(student_hidden, student_weight, teacher_hidden, teacher_weight)
        o, _ = _call_options(sh, sw, target, divergence, beta, temperature, hard, ignore_index,
                             workspace_bytes, tf32, group)
        world = 1 if g is None else dist.get_world_size(g)
        _, tv = _target_view(target, sh)
        n, dev = sh.size(0), sh.device
        checks.rows, checks.v_local, checks.target = n, sw.size(0), target
        loss = torch.empty(n, dtype=torch.float32, device=dev)
        stats = torch.empty(n * _C.DISTILL_ROW_STATS_BYTES, dtype=torch.uint8, device=dev)
        if world > 1:
            nbytes = n * _C.DISTILL_PARTIAL_BYTES
            mine = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            partials = torch.empty(world * nbytes, dtype=torch.uint8, device=dev)
            sums = torch.empty(2 * n if divergence == "jsd" else 0, dtype=torch.float32, device=dev)
    stream = stream_of(sh)
    if world == 1:
        _C.linear_distillation_forward(matrix(sh), matrix(sw), matrix(th), matrix(tw), tv, o,
                                       loss.data_ptr(), stats.data_ptr(), stream)
        return loss, stats
    _C.linear_distillation_local_partials(matrix(sh), matrix(sw), matrix(th), matrix(tw), tv, o,
                                          mine.data_ptr(), stream)
    dist.all_gather_into_tensor(partials, mine, group=g)
    _C.distill_merge(partials.data_ptr(), world, n, tv, o, stats.data_ptr(), loss.data_ptr(),
                     device_of(sh), stream)
    if divergence == "jsd":  # the soft term needs the merged lse: a second pass, 8 B a row
        _C.linear_distillation_jsd_sums(matrix(sh), matrix(sw), matrix(th), matrix(tw), o,
                                        stats.data_ptr(), sums.data_ptr(), stream)
        dist.all_reduce(sums, group=g)
        _C.distill_add_jsd(sums.data_ptr(), n, tv, o, stats.data_ptr(), loss.data_ptr(),
                           device_of(sh), stream)
    return loss, stats


def _forward_fake(student_hidden, student_weight, teacher_hidden, teacher_weight, *rest):
    n = student_hidden.size(0)
    return (student_hidden.new_empty(n, dtype=torch.float32),
            student_hidden.new_empty(n * _C.DISTILL_ROW_STATS_BYTES, dtype=torch.uint8))


def _backward(grad_loss: Tensor, student_hidden: Tensor, student_weight: Tensor,
              teacher_hidden: Tensor, teacher_weight: Tensor, target: Optional[Tensor],
              stats: Tensor, divergence: str, beta: float, temperature: float, hard: float,
              ignore_index: int, workspace_bytes: int, tf32: bool, group: str, check: bool,
              grad: bool, dhidden_reduction: int) -> Tuple[Tensor, Tensor]:
    """The student's gradients for the per-token upstream grad_loss: new dhidden (summed over
    the group with dhidden_reduction "all_reduce"), dweight (this rank's shard)."""
    sh, sw, th, tw = _four(student_hidden, student_weight, teacher_hidden, teacher_weight)
    o, g = _call_options(sh, sw, target, divergence, beta, temperature, hard, ignore_index,
                         workspace_bytes, tf32, group)
    _, tv = _target_view(target, sh)
    reduced = None if g is None else {1: "all-reduce", 2: "reduce-scatter"}.get(dhidden_reduction)
    gl = values_in(grad_loss, torch.float32)
    dh = torch.empty(sh.shape, dtype=student_hidden.dtype, device=sh.device)
    dw = torch.empty(student_weight.shape, dtype=student_weight.dtype, device=sh.device)
    own_rows = own_rows_buffer(dh, g) if reduced == "reduce-scatter" else None
    _C.linear_distillation_backward(matrix(sh), matrix(sw), matrix(th), matrix(tw), tv,
                                    stats.data_ptr(), gl.data_ptr(), o, matrix(dh), matrix(dw),
                                    False, stream_of(sh))
    if reduced == "all-reduce":
        dist.all_reduce(dh, group=g)
    elif reduced == "reduce-scatter":  # the gathered slices' gradient: this rank's rows summed
        sum_into_own_rows(dh, g, own_rows)
    return dh, dw


def _backward_fake(grad_loss, student_hidden, student_weight, *rest):
    return student_hidden.new_empty(student_hidden.shape), student_weight.new_empty(student_weight.shape)


def _setup(ctx, inputs, output):
    sh, sw, th, tw, target, *options = inputs
    ctx.options = options
    ctx.save_for_backward(sh, sw, th, tw, target, output[1])


def _grads(ctx, grads, kernels):
    grad_loss = grads[0] if isinstance(grads, tuple) else grads
    sh, sw, th, tw, target, stats = ctx.saved_tensors
    dh, dw = kernels.bwd(grad_loss, sh, sw, th, tw, target, stats, *ctx.options)
    return (dh, dw) + (None,) * (3 + len(ctx.options)), None


_linear_distillation = FusedOp(
    "linear_distillation", forward=_forward, forward_fake=_forward_fake, setup=_setup,
    backward=_grads, inplace_flag="inplace_backward", n_outputs=1,
    kernels={"bwd": (_backward, _backward_fake, ())})


# ---- in_forward: a mean or a sum at one rank, its gradients computed by the forward ----

def _forward_reduced(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor,
                     teacher_weight: Tensor, target: Optional[Tensor], divergence: str,
                     beta: float, temperature: float, hard: float, ignore_index: int,
                     workspace_bytes: int, tf32: bool, mean: bool,
                     inplace: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """-> (the mean or sum of the losses, its gradients over the student's hidden states and
    weight for an upstream gradient of 1). The mean's divisor (the counted rows) stays on the
    device: each row's upstream gradient is 1 / count, no host synchronisation."""
    sh, sw, th, tw = _four(student_hidden, student_weight, teacher_hidden, teacher_weight)
    o, _ = _call_options(sh, sw, target, divergence, beta, temperature, hard, ignore_index,
                         workspace_bytes, tf32, "")
    _, tv = _target_view(target, sh)
    n, dev = sh.size(0), sh.device
    loss = torch.empty(n, dtype=torch.float32, device=dev)
    stats = torch.empty(n * _C.DISTILL_ROW_STATS_BYTES, dtype=torch.uint8, device=dev)
    dh = torch.empty(sh.shape, dtype=student_hidden.dtype, device=dev)
    dw = torch.empty(student_weight.shape, dtype=student_weight.dtype, device=dev)
    gl = None
    if mean:
        count = (torch.full((), float(n), device=dev) if target is None
                 else (target.reshape(-1) != ignore_index).sum().to(torch.float32)).clamp_(min=1)
        gl = torch.reciprocal(count).expand(n).contiguous()
    _C.linear_distillation_forward(matrix(sh), matrix(sw), matrix(th), matrix(tw), tv, o,
                                   loss.data_ptr(), stats.data_ptr(), stream_of(sh), matrix(dh),
                                   matrix(dw), 0 if gl is None else gl.data_ptr())
    total = loss.sum() / count if mean else loss.sum()
    return total, dh, dw


def _forward_reduced_fake(student_hidden, student_weight, *rest):
    return (student_hidden.new_empty((), dtype=torch.float32),
            student_hidden.new_empty(student_hidden.shape),
            student_weight.new_empty(student_weight.shape))


def _scale(grad: Tensor, dh: Tensor, dw: Tensor) -> Tuple[Tensor, Tensor]:
    """The saved gradients times the upstream gradient, into new tensors."""
    return dh * grad.to(dh.dtype), dw * grad.to(dw.dtype)


def _scale_fake(grad, dh, dw):
    return dh.new_empty(dh.shape), dw.new_empty(dw.shape)


def _scale_inplace(grad: Tensor, dh: Tensor, dw: Tensor) -> Tuple[Tensor, Tensor]:
    """The saved gradients (owned by this call alone) scaled where they are: no second copy of
    a [V, H] gradient."""
    return dh.mul_(grad.to(dh.dtype)), dw.mul_(grad.to(dw.dtype))


def _setup_reduced(ctx, inputs, output):
    *_, inplace = inputs
    ctx.inplace = inplace and not ctx.traced
    ctx.save_for_backward(output[1], output[2])


def _grads_reduced(ctx, grads, kernels):
    grad = grads[0] if isinstance(grads, tuple) else grads
    dh, dw = ctx.saved_tensors
    if ctx.inplace:
        dh, dw = kernels.scale_(grad, dh, dw)
    else:
        dh, dw = kernels.scale(grad, dh, dw)
    return (dh, dw) + (None,) * 12, (dh if ctx.inplace else None)


_linear_distillation_reduced = FusedOp(
    "linear_distillation_reduced", forward=_forward_reduced, forward_fake=_forward_reduced_fake,
    setup=_setup_reduced, backward=_grads_reduced, inplace_flag="inplace_backward", n_outputs=1,
    consumed="scaled the gradients it kept in place",
    kernels={"scale": (_scale, _scale_fake, ()), "scale_": (_scale_inplace, None, ())})


def _runs_in_forward(mode: int, red: int, grad: bool, both: bool, world: int, dtype) -> bool:
    """backward_mode "auto": in_forward for a mean or a sum that a gradient follows at one rank
    into both of the student's tensors (both: else the forward would compute and keep a
    gradient nobody asked for, a [V, H] one for a frozen head), but for fp16 students (the
    gradients of the mean's upstream gradient 1 / N, kept in fp16 until the real one scales
    them, flush where a loss scale would keep them; refused when asked for, as the linear
    cross-entropy refuses it)."""
    if mode == _MODES["in_forward"]:
        if red == _REDUCTIONS["none"]:
            raise ValueError("backward_mode: got 'in_forward' with reduction='none', expected "
                             "'recompute' or 'auto' (the per-token losses' upstream gradients are "
                             "known only at the backward)")
        if world > 1:
            raise ValueError(f"backward_mode: got 'in_forward' with a tp_group of {world} ranks, "
                             "expected 'recompute' or 'auto' (vocab-parallel runs recompute)")
        if dtype == torch.float16:
            raise ValueError("backward_mode: got 'in_forward' with torch.float16 students, "
                             "expected 'recompute' or 'auto' (the kept fp16 gradients of the "
                             "unit upstream gradient would flush where a loss scale keeps them)")
        return grad
    if mode == _MODES["recompute"]:
        return False
    return (grad and both and red != _REDUCTIONS["none"] and world == 1
            and dtype != torch.float16)


def linear_distillation_loss(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor,
                             teacher_weight: Tensor, target: Optional[Tensor] = None, *,
                             divergence: str = "forward_kl", beta: float = 0.5,
                             temperature: float = 1.0, ignore_index: int = -100,
                             hard_label_weight: float = 0.0, reduction: str = "mean",
                             tp_group: Optional["dist.ProcessGroup"] = None,
                             check_shard_agreement: bool = True,
                             dhidden_reduction: str = "all_reduce", backward_mode: str = "auto",
                             inplace_backward: bool = True,
                             workspace_bytes: Optional[int] = None) -> Tensor:
    """A distillation loss between the student's and the teacher's next-token distributions,
    without the [N, V] logits of either.

    student_hidden [N, H_s] or [s, b, H_s] with student_weight [V, H_s] (one dtype: fp32, fp16
    or bf16, any strides); teacher_hidden with teacher_weight likewise ([..., H_t], [V, H_t], a
    dtype of their own, the same tokens and vocabulary); under torch.autocast the GEMMs run in
    its dtype. With s = student logits / temperature, t = teacher logits / temperature,
    q = softmax(s), p = softmax(t), per token:

      divergence="forward_kl"   KL(p || q)
      divergence="reverse_kl"   KL(q || p)
      divergence="jsd"          beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q

    and with target (class ids in student_hidden's shape without H) and hard_label_weight w,
    (1 - w) times that plus w times the cross-entropy of the student's logits (temperature 1)
    at the target. Tokens whose target is ignore_index count for nothing. reduction: "mean"
    (over the counted tokens), "sum", or "none" (fp32 losses in the target's shape).

    Gradients flow to the student's hidden states and weight, in their dtypes; the teacher's
    tensors must not require grad. backward_mode "auto": "in_forward" for a mean or a sum at one
    rank whose gradient flows into both student tensors (the forward also runs the gradient
    GEMMs, 4 in all, and keeps the gradients, which the backward scales by the upstream
    gradient in their dtype: in place unless inplace_backward=False, which a second backward
    through the loss needs), "recompute" otherwise and for fp16 students (the backward
    recomputes both logits: 6 GEMMs, 32 B a token kept).

    tp_group of more than one rank: vocab-parallel, both weights are this rank's [V_local, H]
    shard of the vocabulary in rank order; the losses are the same on every rank. The shard
    agreement (check_shard_agreement) makes every rank raise one rank's bad argument. dhidden:
    "all_reduce" (summed over the group), "partial" (this rank's part, for the caller's own
    reduction), or "reduce_scatter" (sequence parallel: both hidden states are this rank's slice
    of the tokens along dim 0, the target covers every rank's slices in rank order; the op
    all-gathers the slices, the losses cover every token, and the student's slice gets its
    gradient summed over the group). CPU targets outside [0, V) that are not ignore_index raise; CUDA targets are
    not read on the host (no synchronisation): a hard-label row with such a target has a NaN
    loss and the error is reported by fusedloss.check_device_errors().
    """
    name = group_name(tp_group)
    group = tp_group if name else None  # (not resolved from its name: torch.compile traces this)
    check, bad_flag = agreement_flag(check_shard_agreement)
    # Every argument check inside the agreement's reach: at TP > 1 a rank that fails raises the
    # same error on every rank (deferred to the graph under torch.compile), nothing hangs.
    with rank_checks(group, check, _OP, only_on_error=True, defer_when_compiling=True) as checks:
        if bad_flag is not None:
            raise bad_flag
        as_choice(divergence, "divergence", _DIVERGENCE)  # the op takes the name (a str argument)
        red = as_choice(reduction, "reduction", _REDUCTIONS)
        mode = as_choice(backward_mode, "backward_mode", _MODES)
        dh_red = as_choice(dhidden_reduction, "dhidden_reduction", _DHIDDEN)
        inplace = as_bool(inplace_backward, "inplace_backward")
        beta_v, t_value = as_float(beta, "beta"), as_float(temperature, "temperature")
        hard = as_float(hard_label_weight, "hard_label_weight")
        ignore = as_int(ignore_index, "ignore_index")
        workspace = as_workspace_bytes(workspace_bytes)
        world = group_size(tp_group) if name else 1
        slices = world if name and dh_red == _DHIDDEN["reduce_scatter"] else 1
        student_hidden, student_weight = autocast_operands(student_hidden, student_weight)
        teacher_hidden, teacher_weight = autocast_operands(teacher_hidden, teacher_weight)
        validate_head_operands(student_hidden, student_weight,
                               names=("student_hidden", "student_weight"))
        validate_head_operands(teacher_hidden, teacher_weight,
                               names=("teacher_hidden", "teacher_weight"))
        for t, t_name in ((teacher_hidden, "teacher_hidden"), (teacher_weight, "teacher_weight")):
            if t.requires_grad:
                raise ValueError(f"{t_name}: got a tensor that requires grad, expected a constant "
                                 "(the teacher gets no gradient: detach it, or compute it under "
                                 "torch.no_grad())")
            require_same_device(t, t_name, student_hidden, "student_hidden")
        if target is not None:
            require_tensor(target, "target")
        shape = check_distillation_shapes(student_hidden, student_weight, teacher_hidden,
                                          teacher_weight, target, slices)
        if target is not None:
            require_same_device(target, "target", student_hidden, "student_hidden")
        grad = torch.is_grad_enabled() and (student_hidden.requires_grad
                                            or student_weight.requires_grad)
        both = student_hidden.requires_grad and student_weight.requires_grad
        in_forward = _runs_in_forward(mode, red, grad, both, world, student_hidden.dtype)
        H_s, H_t = student_hidden.size(-1), teacher_hidden.size(-1)
        tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
        rows = student_hidden.reshape(-1, H_s) if student_hidden.dim() != 2 else student_hidden
        teacher_rows = teacher_hidden.reshape(-1, H_t) if teacher_hidden.dim() != 2 else teacher_hidden
        flat_target = None if target is None else target.reshape(-1)
        n_tokens = rows.size(0) * slices
        if not torch.compiler.is_compiling():  # traced calls are checked when the op runs
            # (the options as rank 0's: this rank's shard is the op's to place)
            o = _options(divergence, beta_v, t_value, hard, ignore, workspace, tf32, 0,
                         student_weight.size(0), world, n_tokens, target is not None)
            if name and flat_target is not None:  # inside the agreement's reach
                check_targets_on_host(flat_target, o, "target")
    if checks.deferred is not None:  # traced: raised on every rank when the graph runs
        return deferred_rejection((student_hidden, student_weight), reduction, target, name, _OP,
                                  checks.deferred)
    if slices > 1:  # every rank's slices, in rank order; the student's gradient reduce-scattered
        hidden_grad = grad and student_hidden.requires_grad
        v_local = student_weight.size(0)
        rows = gather_token_slices(rows, name, check, hidden_grad, n_tokens, v_local, _OP)
        teacher_rows = gather_token_slices(teacher_rows, name, check, False, n_tokens, v_local, _OP)
        if not hidden_grad:
            dh_red = _DHIDDEN["partial"]
    if in_forward:
        return _linear_distillation_reduced(rows, student_weight, teacher_rows, teacher_weight,
                                            flat_target, divergence, beta_v, t_value, hard, ignore,
                                            workspace, tf32, red == _REDUCTIONS["mean"], inplace)
    losses = _linear_distillation(rows, student_weight, teacher_rows, teacher_weight, flat_target,
                                  divergence, beta_v, t_value, hard, ignore, workspace, tf32, name,
                                  bool(name) and check, grad, dh_red)
    if red == _REDUCTIONS["none"]:
        return losses.view(shape)
    total = losses.sum()
    if red == _REDUCTIONS["sum"]:
        return total
    counted = (rows.size(0) if flat_target is None else (flat_target != ignore).sum())
    return total / torch.clamp(torch.as_tensor(counted, device=total.device), min=1)
