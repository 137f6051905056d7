"""fusedloss.linear_distillation_loss: knowledge distillation between a student's and a
teacher's next-token distributions from each model's last hidden states and LM-head weight,
without the [tokens, V] logits of either (include/fusedloss/linear_distillation.h).

The forward runs two GEMMs a token chunk (the student's and the teacher's logits of the same
rows) and keeps 20 B a token; the backward recomputes both and runs the student's gradient
GEMMs. The op gives per-token losses; the reduction is a torch op over them, so autograd hands
the backward per-token upstream gradients. The teacher is a constant: no gradient flows to it.
"""
import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _C
from ._args import check_distillation_shapes
from ._distributed import group_name, group_size
from ._head import as_workspace_bytes, validate_head_operands
from ._op import FusedOp
from ._views import (_INDEX, as_choice, as_float, as_int, autocast_operands, device_of, index,
                     matrix, require_same_device, require_tensor, rows_of, stream_of, validated,
                     values_in)

_OP = "fusedloss.linear_distillation_loss"
_DIVERGENCE = {"forward_kl": _C.Divergence.ForwardKL, "reverse_kl": _C.Divergence.ReverseKL,
               "jsd": _C.Divergence.JSD}
_REDUCTIONS = {"mean": 0, "sum": 1, "none": 2}


@functools.lru_cache(maxsize=256)
def _options(divergence, beta, temperature, hard, ignore_index, workspace_bytes, tf32, rows, vocab,
             has_target):
    o = _C.LinearDistillationOptions()
    o.divergence = _DIVERGENCE[divergence]
    o.beta = beta
    o.temperature = temperature
    o.hard_label_weight = hard
    o.ignore_index = ignore_index
    if workspace_bytes:
        o.workspace_bytes = workspace_bytes
    o.allow_tf32 = tf32
    validated(_C.validate_linear_distillation_options, o, rows, vocab, has_target)
    return o


def _target_view(target: Optional[Tensor], hidden: Tensor):
    """(the targets to keep alive, their view): an absent view (every row counts) for None."""
    if target is None:
        return None, _C.IndexView(0, hidden.size(0), _INDEX[torch.int64], device_of(hidden))
    return index(target.reshape(-1), "target")


def _forward(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor,
             teacher_weight: Tensor, target: Optional[Tensor], divergence: str, beta: float,
             temperature: float, hard: float, ignore_index: int, workspace_bytes: int,
             tf32: bool) -> Tuple[Tensor, Tensor]:
    """-> (per-token losses [N] fp32, the rows' stats for the backward [N * 20] bytes)."""
    sh, sw, th, tw = (rows_of(t) for t in (student_hidden, student_weight, teacher_hidden,
                                           teacher_weight))
    n = sh.size(0)
    o = _options(divergence, beta, temperature, hard, ignore_index, workspace_bytes, tf32, n,
                 sw.size(0), target is not None)
    _, tv = _target_view(target, sh)
    loss = torch.empty(n, dtype=torch.float32, device=sh.device)
    stats = torch.empty(n * _C.DISTILL_ROW_STATS_BYTES, dtype=torch.uint8, device=sh.device)
    _C.linear_distillation_forward(matrix(sh), matrix(sw), matrix(th), matrix(tw), tv, o,
                                   loss.data_ptr(), stats.data_ptr(), stream_of(sh))
    return loss, stats


def _forward_fake(student_hidden, student_weight, teacher_hidden, teacher_weight, *rest):
    n = student_hidden.size(0)
    return (student_hidden.new_empty(n, dtype=torch.float32),
            student_hidden.new_empty(n * _C.DISTILL_ROW_STATS_BYTES, dtype=torch.uint8))


def _backward(grad_loss: Tensor, student_hidden: Tensor, student_weight: Tensor,
              teacher_hidden: Tensor, teacher_weight: Tensor, target: Optional[Tensor],
              stats: Tensor, divergence: str, beta: float, temperature: float, hard: float,
              ignore_index: int, workspace_bytes: int, tf32: bool) -> Tuple[Tensor, Tensor]:
    """The student's gradients for the per-token upstream grad_loss: new dhidden, dweight."""
    sh, sw, th, tw = (rows_of(t) for t in (student_hidden, student_weight, teacher_hidden,
                                           teacher_weight))
    o = _options(divergence, beta, temperature, hard, ignore_index, workspace_bytes, tf32,
                 sh.size(0), sw.size(0), target is not None)
    _, tv = _target_view(target, sh)
    g = values_in(grad_loss, torch.float32)
    dh = torch.empty(sh.shape, dtype=student_hidden.dtype, device=sh.device)
    dw = torch.empty(student_weight.shape, dtype=student_weight.dtype, device=sh.device)
    _C.linear_distillation_backward(matrix(sh), matrix(sw), matrix(th), matrix(tw), tv,
                                    stats.data_ptr(), g.data_ptr(), o, matrix(dh), matrix(dw),
                                    False, stream_of(sh))
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


def linear_distillation_loss(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor,
                             teacher_weight: Tensor, target: Optional[Tensor] = None, *,
                             divergence: str = "forward_kl", beta: float = 0.5,
                             temperature: float = 1.0, ignore_index: int = -100,
                             hard_label_weight: float = 0.0, reduction: str = "mean",
                             tp_group=None, workspace_bytes: Optional[int] = None) -> Tensor:
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
    tensors must not require grad. The CPU backend runs it at one rank in this version: CUDA
    tensors and a tp_group of more than one rank are refused.
    """
    as_choice(divergence, "divergence", _DIVERGENCE)  # the op takes the name (a str argument)
    red = as_choice(reduction, "reduction", _REDUCTIONS)
    beta_v, t_value = as_float(beta, "beta"), as_float(temperature, "temperature")
    hard = as_float(hard_label_weight, "hard_label_weight")
    ignore = as_int(ignore_index, "ignore_index")
    workspace = as_workspace_bytes(workspace_bytes)
    if group_name(tp_group) and group_size(tp_group) > 1:
        raise ValueError(f"tp_group: got a group of {group_size(tp_group)} ranks, expected None or "
                         "one rank (a vocab-parallel distillation loss is not supported yet)")
    student_hidden, student_weight = autocast_operands(student_hidden, student_weight)
    teacher_hidden, teacher_weight = autocast_operands(teacher_hidden, teacher_weight)
    validate_head_operands(student_hidden, student_weight, names=("student_hidden", "student_weight"))
    validate_head_operands(teacher_hidden, teacher_weight, names=("teacher_hidden", "teacher_weight"))
    for t, name in ((teacher_hidden, "teacher_hidden"), (teacher_weight, "teacher_weight")):
        if t.requires_grad:
            raise ValueError(f"{name}: got a tensor that requires grad, expected a constant (the "
                             "teacher gets no gradient: detach it, or compute it under "
                             "torch.no_grad())")
        require_same_device(t, name, student_hidden, "student_hidden")
    if student_hidden.is_cuda:
        raise ValueError(f"student_hidden.device: got {student_hidden.device}, expected cpu (the "
                         "linear distillation loss has a CPU backend only in this version)")
    if target is not None:
        require_tensor(target, "target")
    shape = check_distillation_shapes(student_hidden, student_weight, teacher_hidden,
                                      teacher_weight, target)
    if target is not None:
        require_same_device(target, "target", student_hidden, "student_hidden")
    H_s, H_t = student_hidden.size(-1), teacher_hidden.size(-1)
    tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
    rows = student_hidden.reshape(-1, H_s) if student_hidden.dim() != 2 else student_hidden
    teacher_rows = teacher_hidden.reshape(-1, H_t) if teacher_hidden.dim() != 2 else teacher_hidden
    flat_target = None if target is None else target.reshape(-1)
    losses = _linear_distillation(rows, student_weight, teacher_rows, teacher_weight, flat_target,
                                  divergence, beta_v, t_value, hard, ignore, workspace, tf32)
    if red == _REDUCTIONS["none"]:
        return losses.view(shape)
    total = losses.sum()
    if red == _REDUCTIONS["sum"]:
        return total
    counted = (rows.size(0) if flat_target is None else (flat_target != ignore).sum())
    return total / torch.clamp(torch.as_tensor(counted, device=total.device), min=1)
