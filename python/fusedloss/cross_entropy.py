"""fusedloss.cross_entropy: torch custom ops over the C++ core.

forward  one pass over the logits (online softmax) -> per-row loss and lse (4 B/row saved);
         with a tp_group of size > 1 the logits are this rank's vocab shard and one
         all_gather_into_tensor of 16 B/row merges the shards
backward one pass that reads the logits and writes the gradient, optionally into the logits;
         or, for a sum/mean loss with grad_in_forward=True, the gradient is written over the
         logits in the forward (2 passes in all) and the backward only scales it
"""
import functools
from typing import NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _C, _native
from ._distributed import (deferred_rejection, fingerprint, group_name, group_size, merge_buffers,
                           merge_over_group, rank_and_size, rank_checks, resolve_group,
                           sum_over_group)
from ._args import CeOptions
from ._args import parse_ce_options as _parse_ce_options
from ._op import FusedOp, through_custom_ops
from ._views import (EAGER_CALL, agreement_flag, apart_from, as_bool, as_choice, choice_name, as_float, as_int, index, inplace_refused, matrix,
                     parsed_once, require_same_device, require_targets, require_tensor, require_values, rows_of, storage_is_ours, stream_of, validated,
                     values_in)

# Plain ints (what the op schemas carry, and what torch.compile traces).
_REDUCTIONS = {"none": int(_C.Reduction.NONE), "sum": int(_C.Reduction.SUM), "mean": int(_C.Reduction.MEAN)}
_FORMULAS = {"pytorch": int(_C.SmoothingFormula.PYTORCH), "megatron": int(_C.SmoothingFormula.MEGATRON)}
_SCOPES = {"global": int(_C.SmoothingScope.GLOBAL), "partition": int(_C.SmoothingScope.PARTITION)}


def option_names(ignore_index, label_smoothing, formula, scope, z_loss, reduction):
    """The options as the user names them (the TP agreement's mismatch error shows these)."""
    return dict(ignore_index=ignore_index, label_smoothing=label_smoothing,
                smoothing_formula=choice_name(_FORMULAS, formula),
                smoothing_scope=choice_name(_SCOPES, scope), z_loss=z_loss,
                reduction=choice_name(_REDUCTIONS, reduction))
_NONE = _REDUCTIONS["none"]
_OP = "fusedloss.cross_entropy"
_INPLACE_FLAGS = "inplace_backward or grad_in_forward"  # what the in-place warnings name


def make_options(ignore_index, label_smoothing, formula, scope, z_loss, reduction, rank, world,
                 v_local, softcap=0.0):
    """The C++ CrossEntropyOptions of a call (unchecked), shard fields from the rank's place."""
    o = _C.CrossEntropyOptions()
    o.ignore_index = ignore_index
    o.label_smoothing = label_smoothing
    o.smoothing_formula = _C.SmoothingFormula(formula)
    o.smoothing_scope = _C.SmoothingScope(scope)
    o.z_loss = z_loss
    o.reduction = _C.Reduction(reduction)
    o.logit_softcap = softcap
    if world > 1:
        o.vocab_start = rank * v_local
        o.vocab_global = world * v_local
    return o


@functools.lru_cache(maxsize=256)
def _options(ignore_index, label_smoothing, formula, scope, z_loss, reduction, softcap, rank, world,
             v_local):
    """One validated options object per distinct call (the C++ side only reads it; building
    and checking it field by field costs more host time than the rest of a small call)."""
    o = make_options(ignore_index, label_smoothing, formula, scope, z_loss, reduction, rank, world,
                     v_local, softcap)
    validated(_C.validate_cross_entropy_options, o, 1, v_local)
    return o


def check_targets_on_host(t: Tensor, o, name: str = "target") -> None:
    """Raises for the first target outside [0, V_global) that is not ignore_index (o: the
    options, or anything with vocab_global and ignore_index), for CPU targets, before any
    collective (inside rank_checks, so every rank raises it); CUDA kernels flag bad targets in
    flight."""
    if t.is_cuda:
        return
    v_global = o.vocab_global
    bad = (t != o.ignore_index) & ((t < 0) | (t >= v_global))
    if bool(bad.any()):
        at = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"{name}[{', '.join(map(str, at))}]: got {int(t[at])}, expected in "
                         f"[0, {v_global}) or ignore_index ({o.ignore_index})")


def loss_outputs(rows, reduction, device):
    """A forward's loss ([rows] or a scalar), lse [rows] and valid count, fp32 (the linear
    cross-entropy's too)."""
    f32 = dict(dtype=torch.float32, device=device)
    return (torch.empty(rows if reduction == _NONE else (), **f32), torch.empty(rows, **f32),
            torch.empty((), **f32))


def _forward(logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, formula: int,
             scope: int, z_loss: float, reduction: int, softcap: float, group: str,
             check_agreement: bool, inplace_backward: bool, grad_in_forward: bool,
             argmax: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """grad_in_forward (eager only, a sum/mean loss over logits whose memory is ours): the
    logits are overwritten with the loss's gradient for a unit upstream gradient."""
    g = resolve_group(group)
    dev = logits.device
    if g is None:
        x = rows_of(logits)
        t, tv = index(apart_from(target, logits) if grad_in_forward else target, "target")
        rows, v_local = x.shape
        loss, lse, count = loss_outputs(rows, reduction, dev)
        stream = stream_of(x)
        o = _options(ignore_index, label_smoothing, formula, scope, z_loss, reduction, softcap, 0, 1,
                     v_local)
        if grad_in_forward:
            xv = matrix(x)
            _C.cross_entropy_forward_with_grad(xv, tv, o, loss.data_ptr(), lse.data_ptr(),
                                               count.data_ptr(), xv, stream)
            _consumed(logits)
        else:
            _C.cross_entropy_forward(matrix(x), tv, o, loss.data_ptr(), lse.data_ptr(), count.data_ptr(), stream)
        return loss, lse, count
    rank, world = rank_and_size(g)
    # the target's shape too: [s, b] on one rank and [b, s] on another have equal rows
    options = fingerprint(**option_names(ignore_index, label_smoothing, formula, scope, z_loss,
                                         reduction), logit_softcap=softcap,
                          target_shape=tuple(target.shape),
                          # the arg-max's all-gather follows on the ranks that ask for it
                          return_token_accuracy_or_predicted_tokens=argmax)
    # Everything that may fail on this rank alone (a copy, an allocation) before the agreement.
    with rank_checks(g, check_agreement, _OP, options=options) as checks:
        x = rows_of(logits)
        t, tv = index(apart_from(target, logits) if grad_in_forward else target, "target")
        checks.rows, checks.v_local = rows, v_local = x.shape
        checks.target = t
        o = _options(ignore_index, label_smoothing, formula, scope, z_loss, reduction, softcap, rank,
                     world, v_local)
        if check_agreement:  # without it, the C++ pass raises on this rank
            check_targets_on_host(t.reshape(-1), o)  # (flat positions in its message)
        loss, lse, count = loss_outputs(rows, reduction, dev)
        stats = torch.empty(rows, _C.ROW_STATS_FLOATS, dtype=torch.float32, device=dev)
        buffers = merge_buffers(g, stats)
    stream = stream_of(x)
    xv = matrix(x)
    _C.cross_entropy_local_stats(xv, tv, o, stats.data_ptr(), stream)
    merge_over_group(g, stats, buffers, tv, o, v_local, loss, lse, count, stream)
    if grad_in_forward:  # the merged lse first: then the backward for a unit upstream gradient
        _C.cross_entropy_backward(xv, tv, lse.data_ptr(), 0, count.data_ptr(), o, xv, stream)
        _consumed(logits)
    return loss, lse, count


def _consumed(logits):
    """The logits now hold their gradient: an earlier autograd reader of them fails its
    version check instead of reading the gradient as logits."""
    torch.autograd.graph.increment_version(logits)


def _forward_fake(logits, target, ignore_index, label_smoothing, formula, scope, z_loss, reduction,
                  softcap, group, check_agreement, inplace_backward, grad_in_forward, argmax):
    if grad_in_forward:  # it would write the logits, which the op's schema does not declare
        raise RuntimeError(f"{_OP}: grad_in_forward=True cannot be traced; cross_entropy() "
                           "takes the out-of-place path under torch.compile")
    rows = target.numel()
    f32 = dict(dtype=torch.float32, device=logits.device)
    loss = logits.new_empty(rows if reduction == _NONE else (), **f32)
    return loss, logits.new_empty(rows, **f32), logits.new_empty((), **f32)


def _backward_into(grad_loss, x, target, lse, count, opts, out):
    """The gradient of rows x ([rows, V_local], from rows_of) into rows `out`."""
    *head, group = opts
    rank, world = rank_and_size(resolve_group(group))
    o = _options(*head, rank, world, x.size(1))
    gl = values_in(grad_loss, torch.float32)  # may arrive expanded; the kernel reads its data_ptr
    t, tv = index(target, "target")
    _C.cross_entropy_backward(matrix(x), tv, lse.data_ptr(), gl.data_ptr(), count.data_ptr(), o,
                              matrix(out), stream_of(x))


def _backward(grad_loss: Tensor, logits: Tensor, target: Tensor, lse: Tensor, count: Tensor,
              ignore_index: int, label_smoothing: float, formula: int, scope: int, z_loss: float,
              reduction: int, softcap: float, group: str) -> Tensor:
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    opts = (ignore_index, label_smoothing, formula, scope, z_loss, reduction, softcap, group)
    _backward_into(grad_loss, rows_of(logits), target, lse, count, opts, rows_of(grad))
    return grad


def _backward_fake(grad_loss, logits, *rest):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def _backward_inplace(grad_loss: Tensor, logits: Tensor, target: Tensor, lse: Tensor, count: Tensor,
                      ignore_index: int, label_smoothing: float, formula: int, scope: int,
                      z_loss: float, reduction: int, softcap: float, group: str) -> None:
    x = rows_of(logits)  # a view: setup() checked storage_is_ours
    opts = (ignore_index, label_smoothing, formula, scope, z_loss, reduction, softcap, group)
    _backward_into(apart_from(grad_loss, logits), x, apart_from(target, logits), lse, count, opts, x)


def _scale_inplace(grad_loss: Tensor, logits: Tensor) -> None:
    """The backward of a gradient written in the forward: logits (holding it) *= grad_loss,
    skipped on the device when grad_loss is exactly 1."""
    x = rows_of(logits)
    gl = values_in(apart_from(grad_loss, logits), torch.float32)  # the kernel reads its data_ptr
    _C.cross_entropy_scale_grad(matrix(x), gl.data_ptr(), stream_of(x))


def _setup(ctx, inputs, output):
    logits, target, *opts, _check, inplace, in_forward, _argmax = inputs
    _, lse, count = output
    ctx.opts = tuple(opts)
    ctx.in_forward = in_forward
    ctx.inplace = in_forward or (
        inplace and not inplace_refused(ctx, logits, _OP, "logits", _INPLACE_FLAGS))
    ctx.save_for_backward(logits, target, lse, count)


def _grads(ctx, grad_loss, kernels):
    logits, target, lse, count = ctx.saved_tensors
    no_grads = (None,) * (len(ctx.opts) + 5)
    if ctx.in_forward:
        kernels.scale_(grad_loss, logits)
        return (logits, *no_grads), logits
    if ctx.inplace:
        kernels.bwd_(grad_loss, logits, target, lse, count, *ctx.opts)
        return (logits, *no_grads), logits
    return (kernels.bwd(grad_loss, logits, target, lse, count, *ctx.opts), *no_grads), None


_KERNELS = {"bwd": (_backward, _backward_fake, ()),
            "bwd_": (_backward_inplace, None, ("logits",)),  # eager only
            "scale_": (_scale_inplace, None, ("logits",))}  # eager only
_cross_entropy = FusedOp(
    "cross_entropy", forward=_forward, forward_fake=_forward_fake, setup=_setup, backward=_grads,
    inplace_flag="inplace_backward", kernels=_KERNELS)
# return_z_loss: the same op with the merged lse as a second, non-differentiable output
_cross_entropy_lse = FusedOp(
    "cross_entropy_lse", forward=_forward, forward_fake=_forward_fake, setup=_setup,
    backward=lambda ctx, grads, kernels: _grads(ctx, grads[0], kernels), n_outputs=2,
    inplace_flag="inplace_backward", kernels=_KERNELS)
# eager calls without a tp_group: the same steps with the autograd node in C++
_EAGER = _native.ops.cross_entropy_eager.default if _native.ops is not None else None


def _validate(logits, target):
    require_values(logits, "logits")
    require_tensor(target, "target")
    if logits.dim() not in (2, 3) or logits.size(-1) == 0:
        raise ValueError(f"logits: got shape {tuple(logits.shape)}, expected a 2-D [N, V] or 3-D "
                         "[s, b, V] tensor with V >= 1")
    require_targets(target, logits, "the logits", "the logits' shape without the vocab dim")


_Options = CeOptions  # the op schemas' first plain arguments (the linear CE's begin with them)
# the cross-entropy op's own: then the logit soft cap
_CallOptions = NamedTuple("_CallOptions", [*CeOptions.__annotations__.items(), ("softcap", float)])


class CrossEntropyOutput(NamedTuple):
    """What cross_entropy() and linear_cross_entropy() return when a return_* option asks for
    more than the loss (Liger's CrossEntropyOutput fields; the options not asked for are None).

    loss              the loss, as without the options (it includes the z-loss)
    z_loss            z_loss * lse^2 of the counted rows, reduced as the loss (per row for
                      reduction='none', 0 on ignored rows); a detached value for logging
    token_accuracy    whether argmax == target: per row (0.0 on ignored rows) for 'none',
                      else the fraction over the counted rows (0 where none counts)
    predicted_tokens  [rows] int64 argmax of each row's logits (the smallest id of a tie; -1 on
                      ignored rows), whatever the reduction
    """
    loss: Tensor
    z_loss: Optional[Tensor] = None
    token_accuracy: Optional[Tensor] = None
    predicted_tokens: Optional[Tensor] = None


def as_softcap(logit_softcap, softcap) -> float:
    """logit_softcap, or Liger's name for it, softcap (one of them): 0.0 (off) for None; the
    range (0 or a finite value > 0) is the core's check."""
    if softcap is not None:
        if logit_softcap is not None:
            raise TypeError(f"softcap: got {softcap!r} with logit_softcap={logit_softcap!r}, "
                            "expected one of them (softcap is Liger's name for logit_softcap)")
        name, value = "softcap", softcap
    elif logit_softcap is None:
        return 0.0
    else:
        name, value = "logit_softcap", logit_softcap
    cap = as_float(value, name)
    if not 0 <= cap < float("inf"):  # (the core checks it too, under its own field's name)
        raise ValueError(f"{name}: got {value!r}, expected None or 0 (off), or a finite value > 0")
    return cap


def parse_options(ignore_index, label_smoothing, smoothing_formula, smoothing_scope, reduction,
                  z_loss) -> CeOptions:
    """The cross-entropy's keyword options as the op schemas carry them (types and choices
    checked here, ranges by the C++ validators); the linear CE's begin with them."""
    return _parse_ce_options(as_float, (_REDUCTIONS, _FORMULAS, _SCOPES), ignore_index,
                             label_smoothing, smoothing_formula, smoothing_scope, reduction, z_loss)


@parsed_once
def _option_args(ignore_index, label_smoothing, smoothing_formula, smoothing_scope, reduction,
                 z_loss, logit_softcap, softcap, inplace_backward, grad_in_forward):
    """Keyword options -> (the plain values the op schema carries, inplace_backward,
    grad_in_forward). The ranges are checked by the C++ validator; grad_in_forward against the
    reduction."""
    args = _CallOptions(*parse_options(ignore_index, label_smoothing, smoothing_formula,
                                       smoothing_scope, reduction, z_loss),
                        as_softcap(logit_softcap, softcap))
    if not torch.compiler.is_compiling():  # traced calls are checked when the op runs
        _options(*args, 0, 1, 2)  # raises on a bad range or enum
    inplace = as_bool(inplace_backward, "inplace_backward")
    in_forward = as_bool(grad_in_forward, "grad_in_forward")
    if in_forward and args.reduction == _NONE:
        raise ValueError("grad_in_forward: got True with reduction='none', expected reduction "
                         "'sum' or 'mean' (per-row losses have per-row upstream gradients)")
    return args, inplace, in_forward


def cross_entropy(logits: Tensor, target: Tensor, *, ignore_index: int = -100,
                  label_smoothing: float = 0.0, smoothing_formula: str = "pytorch",
                  reduction: str = "mean", z_loss: float = 0.0, inplace_backward: bool = False,
                  tp_group: Optional["dist.ProcessGroup"] = None,
                  smoothing_scope: str = "global", check_shard_agreement: bool = True,
                  grad_in_forward: bool = False, weight: Optional[Tensor] = None,
                  logit_softcap: Optional[float] = None, softcap: Optional[float] = None,
                  return_z_loss: bool = False, return_token_accuracy: bool = False,
                  return_predicted_tokens: bool = False):
    """Cross-entropy of logits [N, V] or [s, b, V] (fp32/fp16/bf16, any strides) against integer
    targets.

    Matches torch.nn.functional.cross_entropy for the options they share, but for one case:
    'mean' over no counted row (an empty batch, every target ignore_index) is 0 with zero
    gradients, where torch gives NaN. The loss is fp32 for every input dtype. `z_loss` adds
    z * lse^2 per row. `smoothing_formula='megatron'` uses a = ls * K / (K - 1) and
    `smoothing_scope='partition'` averages over the rank's own shard, as Megatron's
    vocab_parallel_cross_entropy does.

    tp_group of size > 1: the logits are this rank's contiguous vocab shard (rank r holds
    [r V_local, (r+1) V_local)) and targets are global ids. Every call first checks that all
    ranks agree (same rows, equal V_local, the same options, no rank rejected its arguments) and
    raises the same error on every rank otherwise; that costs one tiny all-gather and a host sync.
    `check_shard_agreement=False` skips it (for CUDA-graph capture): the caller then guarantees
    agreement, and a disagreement is undefined behaviour of the collective. The flag itself must
    be the same on every rank: it decides whether the exchange runs.

    inplace_backward=True writes the gradient into the logits' memory (no [N, V] gradient
    buffer); the logits are then consumed: they hold the gradient, autograd's version check
    fails for any later autograd use of them, and a second backward raises. Memory the caller
    owns is never written: when the logits are a leaf, a view of a leaf, or a layout the kernels
    must copy, the gradient goes to a new buffer (with a warning). Under torch.compile the
    gradient always goes to a new buffer (a traced graph cannot tell whose memory an input is).
    False by default, by the rule every fusedloss op follows: a backward overwrites a tensor the
    caller passed in only when asked (here the logits, which plain code may still read after
    the backward: argmax, accuracy, logging), while memory only the op can reach is reused by
    default (the linear cross-entropy's saved gradients: inplace_backward=True there).

    grad_in_forward=True (reduction 'sum' or 'mean'; implies inplace_backward) writes the
    gradient over the logits during the forward, which reads each row once for both (2 passes
    over the logits instead of 3 where the kernel pays): the logits hold the gradient as soon
    as the loss is returned, so nothing may read them afterwards (an autograd reader recorded
    earlier fails its version check; a later one, or plain code, would read the gradient), and
    the backward only scales it by the upstream gradient (nothing at all when that is exactly
    1). It applies eagerly to logits that require grad and whose memory is autograd's (else
    inplace_backward's rules apply); fp16 logits keep the 3-pass in-place backward, since a
    unit-upstream gradient rounded to fp16 would lose the small entries that loss scaling
    keeps.

    weight: F.cross_entropy's per-class weight [V_global] (any float dtype, no gradient, the
    same on every rank at TP > 1): row i's loss is scaled by weight[target_i], and 'mean'
    divides by the sum of those weights over the counted rows (0 where no row counts). Not with
    grad_in_forward. With label_smoothing eps, torch's weighted smoothing term too: row i costs
    (1 - eps) w[t] (lse - z_t) + eps / V sum_c w_c (lse - z_c), 'mean' still over sum w[t]
    (smoothing_formula='megatron': its label distribution, 1 - eps on the target and
    eps / (V - 1) on each other class, weighted alike). It costs one more read of the logits
    (logits @ weight in fp32 row chunks) and, in the backward, an [N, V_local] gradient term in
    the logits' dtype beside the op's; at TP > 1 one all-reduce of N floats. Not with z_loss or
    a soft cap, nor smoothing_scope='partition' at TP > 1.

    logit_softcap=c (Gemma 2's final logit soft-capping; `softcap` is Liger's name for it):
    the loss sees c * tanh(x / c) for every logit x, and the gradient is taken through it.
    grad_in_forward then reads the logits twice (its stats and gradient passes apart).

    return_z_loss, return_token_accuracy, return_predicted_tokens (Liger's options): return a
    CrossEntropyOutput(loss, z_loss, token_accuracy, predicted_tokens) instead of the loss, with
    the fields asked for (see CrossEntropyOutput). The z-loss comes from the lse the op keeps
    (no pass over the logits); the argmax behind the other two is one more read of the logits
    (before the op, so grad_in_forward may still overwrite them), at TP > 1 merged over the
    group with one all-gather of 16 B/row.

    Never synchronises the host on CUDA at TP=1; an out-of-range target makes its row NaN and
    is raised by fusedloss.check_device_errors().
    """
    want = _wanted(return_z_loss, return_token_accuracy, return_predicted_tokens)
    if weight is not None:
        per_token, row_weight, kind, weighted = class_weighted(
            lambda **o: cross_entropy(logits, target, **o), weight, target, logits.size(-1)
            if isinstance(logits, Tensor) and logits.dim() >= 1 else -1, tp_group,
            check_shard_agreement, reduction, label_smoothing, ignore_index,
            conflicts={"grad_in_forward": grad_in_forward}, arg="weight",
            options=dict(ignore_index=ignore_index, smoothing_formula=smoothing_formula,
                         z_loss=z_loss, inplace_backward=inplace_backward,
                         smoothing_scope=smoothing_scope, logit_softcap=logit_softcap,
                         softcap=softcap, **want._asdict()),
            smoothing_term=lambda *a: _weighted_logit_sums(logits, *a))
        return weighted_reduction(per_token, row_weight, kind, target != ignore_index, weighted)
    name = group_name(tp_group)
    check, bad_flag = agreement_flag(check_shard_agreement)
    with rank_checks(tp_group if name else None, check, _OP, only_on_error=True,
                     defer_when_compiling=True) as checks:
        if bad_flag is not None:
            raise bad_flag
        opts, inplace, in_forward = _option_args(ignore_index, label_smoothing, smoothing_formula,
                                                 smoothing_scope, reduction, z_loss, logit_softcap,
                                                 softcap, inplace_backward, grad_in_forward)
        _validate(logits, target)
    if checks.deferred is not None:  # traced: raised on every rank when the graph runs
        return deferred_rejection((logits, target), reduction, target, name, _OP, checks.deferred)
    inplace = inplace or in_forward
    in_forward = (in_forward and logits.dtype != torch.float16 and logits.requires_grad
                  and torch.is_grad_enabled() and not through_custom_ops()
                  and storage_is_ours(logits))
    argmax = want.return_token_accuracy or want.return_predicted_tokens
    # the argmax before the op at TP = 1 (grad_in_forward overwrites the logits); at TP > 1 after
    # it, once the op's agreement has checked the shapes its all-gather relies on, and the
    # gradient then waits for the backward
    predicted = _argmax(logits, None) if argmax and not name else None
    in_forward = in_forward and not (argmax and name)
    lse = None
    if want.return_z_loss:  # the same op, with the lse it keeps
        loss, lse = _cross_entropy_lse(logits, target, *opts, name, check, inplace, in_forward,
                                       argmax)
        lse = lse.detach()
    elif _EAGER is not None and not name and not through_custom_ops():
        # the C++ node (_native.py), with the Python node's in-place decision (and its warning),
        # made where the Python node's setup makes it: when a node is recorded
        if inplace and not in_forward:
            inplace = (torch.is_grad_enabled() and logits.requires_grad and not inplace_refused(
                EAGER_CALL, logits, _OP, "logits", _INPLACE_FLAGS))
        loss = _EAGER(logits, target, *opts, inplace, in_forward)
    else:
        loss = _cross_entropy(logits, target, *opts, name, check, inplace, in_forward, argmax)
    loss = loss.view(target.shape) if opts.reduction == _NONE else loss
    if not any(want):
        return loss
    if argmax and name:
        predicted = _argmax(logits, resolve_group(name))
    return _with_extras(loss, lse, predicted, target, opts, want)


class _Wanted(NamedTuple):
    return_z_loss: bool
    return_token_accuracy: bool
    return_predicted_tokens: bool


def _wanted(*flags) -> _Wanted:
    return _Wanted(*(as_bool(f, n) for f, n in zip(flags, _Wanted._fields)))


def _argmax(logits: Tensor, group) -> Tensor:
    """[rows] int64 global argmax of each row of logits [..., V_local] (the smallest id of a
    tie, as torch.argmax), merged over `group` (None: one rank) by one all-gather of
    (max, id) pairs in float64, which holds both exactly."""
    best, at = logits.detach().max(dim=-1)  # over any layout, without a copy of the logits
    best, at = best.reshape(-1), at.reshape(-1)
    if group is None:
        return at
    rank, world = rank_and_size(group)
    mine = torch.stack([best.double(), (at + rank * logits.size(-1)).double()], dim=-1)
    every = mine.new_empty((world * mine.size(0), 2))  # rank-major, as gloo wants it
    dist.all_gather_into_tensor(every, mine, group=group)
    every = every.view(world, -1, 2)
    # the first rank holding the maximum has the smallest id among its ties
    owner = every[..., 0].argmax(dim=0, keepdim=True)
    return every[..., 1].gather(0, owner).squeeze(0).long()


def _reduced(per_row: Tensor, counted: Tensor, kind: int) -> Tensor:
    """A per-row metric reduced as Liger reduces it: as is ('none'), summed ('sum'), or over
    the counted rows ('mean'; 0 where none counts)."""
    if kind == 0:
        return per_row
    total = per_row.sum()
    if kind == 1:
        return total
    n = counted.sum()
    return torch.where(n > 0, total / n.clamp(min=1), 0.0)


def reduced_output(per_row: CrossEntropyOutput, counted: Tensor, kind: int,
                   reduce=None) -> CrossEntropyOutput:
    """A CrossEntropyOutput of per-row values (`counted`: the rows whose target is not
    ignore_index, the targets' shape) reduced for reduction `kind` (0 none, 1 sum, 2 mean): the
    loss and z-loss by `reduce` (default: _reduced over the counted rows), the accuracy as a
    fraction of the counted rows ('sum' too, as Liger's), the predicted tokens as they are.
    Absent fields stay absent."""
    reduce = reduce or (lambda t: _reduced(t, counted, kind))
    loss, z, acc, tokens = per_row
    return CrossEntropyOutput(None if loss is None else reduce(loss),
                              None if z is None else reduce(z),
                              acc if acc is None or kind == 0 else _reduced(acc, counted, 2),
                              tokens)


def _with_extras(loss, lse, predicted, target, opts, want) -> CrossEntropyOutput:
    """The reduced loss with the extras asked for, from the lse [rows] and the arg-max [rows]."""
    counted = target != opts.ignore_index
    kind = {_REDUCTIONS["none"]: 0, _REDUCTIONS["sum"]: 1, _REDUCTIONS["mean"]: 2}[opts.reduction]
    z = (torch.where(counted, opts.z_loss * lse.view(target.shape) ** 2, 0.0)
         if want.return_z_loss else None)
    acc = tokens = None
    if predicted is not None:
        predicted = predicted.view(target.shape)
        if want.return_token_accuracy:
            acc = (counted & (predicted == target)).float()
        if want.return_predicted_tokens:
            tokens = torch.where(counted, predicted, -1)
    return reduced_output(CrossEntropyOutput(None, z, acc, tokens), counted, kind)._replace(loss=loss)


class CrossEntropyLoss(torch.nn.Module):
    """nn.Module form of fusedloss.cross_entropy (same keyword options, checked here)."""

    def __init__(self, **options):
        super().__init__()
        unknown = set(options) - set(cross_entropy.__kwdefaults__)
        if unknown:
            raise TypeError(f"CrossEntropyLoss: unknown options {sorted(unknown)}; expected some of "
                            f"{sorted(cross_entropy.__kwdefaults__)}")
        kw = {**cross_entropy.__kwdefaults__, **options}
        _option_args(kw["ignore_index"], kw["label_smoothing"], kw["smoothing_formula"],
                     kw["smoothing_scope"], kw["reduction"], kw["z_loss"], kw["logit_softcap"],
                     kw["softcap"], kw["inplace_backward"], kw["grad_in_forward"])
        _wanted(kw["return_z_loss"], kw["return_token_accuracy"], kw["return_predicted_tokens"])
        as_bool(kw["check_shard_agreement"], "check_shard_agreement")
        group_name(kw["tp_group"])
        # the per-class weight as torch's CrossEntropyLoss keeps it: a buffer (moves with .to())
        self.register_buffer("weight", options.pop("weight", None))
        self.options = options

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return cross_entropy(logits, target, weight=self.weight, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


_WEIGHTED_REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}


class _WeightedLogitSums(torch.autograd.Function):
    """Per row W z_t (on the rank that holds the target) - sum_c w_c z_c of logits z [N, V]:
    the fp32 sums over row chunks of at most 64 MiB of fp32 logits (no fp32 copy of the whole),
    and a backward that writes its [N, V] gradient once, in the logits' dtype (without the
    logits: the function is linear)."""

    @staticmethod
    def forward(ctx, z, t_local, owned, w, weight_sum):
        ctx.save_for_backward(t_local, owned, w, weight_sum)
        ctx.dtype = z.dtype
        sums = torch.empty(z.size(0), dtype=torch.float32, device=z.device)
        for r, n in _row_chunks(z.size(0), z.size(1)):
            sums[r:r + n] = z[r:r + n].float() @ w
        zt = z.gather(1, t_local[:, None]).squeeze(1).float()
        return torch.where(owned, weight_sum * zt, 0.0) - sums

    @staticmethod
    def backward(ctx, grad):
        t_local, owned, w, weight_sum = ctx.saved_tensors
        out = torch.empty(grad.size(0), w.size(0), dtype=ctx.dtype, device=grad.device)
        for r, n in _row_chunks(out.size(0), out.size(1)):
            out[r:r + n] = torch.outer(-grad[r:r + n], w)
        # the target's column in fp32 before its one rounding: g (W - w_t), or -g w_t
        at_target = grad * (torch.where(owned, weight_sum, 0.0) - w[t_local])
        out.scatter_(1, t_local[:, None], at_target.to(ctx.dtype)[:, None])
        return out, None, None, None, None


def _row_chunks(rows, cols, budget=64 << 20):
    """(first row, rows) of chunks of at most `budget` bytes of fp32 [rows, cols]."""
    n = max(1, budget // (4 * max(cols, 1)))
    return ((r, min(n, rows - r)) for r in range(0, rows, n))


def _weighted_logit_sums(logits, t_local, owned, w, weight_sum):
    """_WeightedLogitSums of this rank's logits [..., V_local]: one more read of them, and in
    the backward an [N, V_local] gradient term (the logits' dtype) beside the op's."""
    z = logits.reshape(-1, logits.size(-1))
    return _WeightedLogitSums.apply(z, t_local, owned, w, weight_sum)


def class_weighted(op, class_weight, target, v_local, tp_group, check, reduction, label_smoothing,
                   ignore_index, conflicts, options, row_weights_to_op=False, arg="class_weight",
                   op_name=_OP, smoothing_term=None):
    """F.cross_entropy(weight=...)'s per-class weight for a fused loss `op` (called with keyword
    options, reduction='none'): (per-token losses, the row weights class_weight[target] (0 for
    ignored rows), the reduction's kind, whether the losses already carry the weights) for
    weighted_reduction. `arg`: the weight's name in the op's signature, for the messages. The
    checks run inside the agreement's reach, so a rank that fails them raises on every rank.
    row_weights_to_op: the op takes the row weights as its loss_mask (the linear CE's 3-GEMM
    backward for sum/mean); op_name: the op's name in an agreement error.

    label_smoothing: see _smoothed; smoothing_term(t_local, owned, w_local, W) gives this rank's
    part of W z_t - sum_c w_c z_c per row (each op knows where its logits come from)."""
    name = group_name(tp_group)
    sharded = bool(name) and group_size(tp_group) > 1
    with rank_checks(resolve_group(name) if name else None, as_bool(check, "check_shard_agreement"),
                     op_name, only_on_error=True):
        kind = as_choice(reduction, "reduction", _WEIGHTED_REDUCTIONS)
        require_tensor(class_weight, arg)
        require_tensor(target, "target")
        for option, value in conflicts.items():
            if value is not None and value is not False:
                what = f"a {option}" if isinstance(value, Tensor) else f"{option}={value!r}"
                raise ValueError(f"{arg}: got a tensor with {what}, expected no {option} (not "
                                 "supported with a per-class weight)")
        eps = as_float(label_smoothing, "label_smoothing")
        v_global = v_local * (group_size(tp_group) if name else 1) if v_local > 0 else -1
        if eps != 0.0:
            _check_weighted_smoothing(eps, arg, sharded, v_global, options)
        if (class_weight.dim() != 1 or class_weight.size(0) != v_global
                or not class_weight.is_floating_point()):
            raise ValueError(f"{arg}: got {class_weight.dtype} {tuple(class_weight.shape)}, "
                             f"expected a floating-point [{v_global}] (one weight per class of the "
                             "whole vocabulary)")
        if class_weight.requires_grad:
            raise ValueError(f"{arg}: got a tensor that requires grad, expected a constant "
                             "(no gradient flows to it)")
        require_same_device(class_weight, arg, target, "target")
        counted = target != as_int(ignore_index, "ignore_index")
        # ignored rows weigh 0; an out-of-range target is the op's error (a 0-weight lookup here)
        safe = torch.where(counted & (target >= 0) & (target < v_global), target, 0).long()
        row_weight = torch.where(counted, class_weight.float()[safe], 0.0)
    call = dict(tp_group=tp_group, check_shard_agreement=check, **options)
    if eps != 0.0:
        megatron = options.get("smoothing_formula") == "megatron"
        total = _smoothed(lambda **o: op(**call, **o), class_weight.float(), safe, counted,
                          row_weight, kind, eps, megatron, name, v_local, row_weights_to_op,
                          smoothing_term)
        return total, row_weight, kind, True
    extra = {"loss_mask": row_weight} if row_weights_to_op and kind else {}
    return op(reduction="none", **call, **extra), row_weight, kind, False


def _smoothed(op, w, safe, counted, row_weight, kind, eps, megatron, group, v_local,
              row_weights_to_op, smoothing_term):
    """Per-token losses with a per-class weight w [V] and label smoothing eps, torch's
    definition for the PyTorch formula (a = eps) and the same label distribution's weighting
    for Megatron's (a = eps V / (V - 1): 1 - eps on the target, eps / (V - 1) on each other
    class): sum_c q_c w_c (lse - z_c) with q = (1 - a) [c = t] + a / V, that is

        (1 - a) w_t nll + a / V (W lse - z . w) = coef nll + a / V (W z_t - z . w)

    with nll = lse - z_t (the op's plain per-token loss), W = sum_c w_c and
    coef = (1 - a) w_t + a W / V. The op's loss carries its gradient, taking coef as its row
    weights where it can (row_weights_to_op, sum/mean); the second term is linear in the logits
    (smoothing_term: this rank's part of it, summed over the group at TP > 1). 'mean' divides
    by sum w_t, as torch's. A CrossEntropyOutput of the op (the extra outputs) keeps its
    fields, its loss replaced."""
    g = resolve_group(group) if group else None
    rank, _ = rank_and_size(g)
    v = w.numel()
    a = eps * v / (v - 1) if megatron else eps
    weight_sum = w.sum()
    coef = torch.where(counted, (1.0 - a) * row_weight + a * weight_sum / v, 0.0)
    out = op(reduction="none", **({"loss_mask": coef} if row_weights_to_op and kind else {}))
    nll = out.loss if isinstance(out, CrossEntropyOutput) else out
    t_local = safe.reshape(-1) - rank * v_local
    owned = (t_local >= 0) & (t_local < v_local)
    part = smoothing_term(torch.where(owned, t_local, 0), owned,
                          w[rank * v_local:(rank + 1) * v_local], weight_sum)
    linear = sum_over_group(part, g).view(nll.shape)
    total = coef * nll + torch.where(counted, linear, 0.0) * (a / v)
    return out._replace(loss=total) if isinstance(out, CrossEntropyOutput) else total


def _check_weighted_smoothing(eps, arg, sharded, v_global, options):
    """What a per-class weight with label smoothing takes: the plain per-token loss the weighted
    terms are built from (no z-loss or soft cap inside it), a vocabulary the Megatron formula
    can spread over, and the global smoothing scope at TP > 1."""
    if not 0.0 < eps < 1.0:
        raise ValueError(f"label_smoothing: got {eps}, expected in [0, 1)")
    if options.get("smoothing_formula") == "megatron" and 0 <= v_global < 2:
        raise ValueError(f"label_smoothing: got {eps} with smoothing_formula='megatron' and a "
                         f"vocabulary of {v_global}, expected V >= 2 (the formula's eps V / (V - 1))")
    if sharded and options.get("smoothing_scope") == "partition":
        raise ValueError(f"{arg}: got a tensor with label_smoothing={eps} and smoothing_scope="
                         "'partition' at a tp_group of more than one rank, expected "
                         "smoothing_scope='global' (each rank's smoothing term over its own "
                         "shard would weigh the classes of that shard alone, and the ranks' "
                         "losses would differ)")
    built_from_the_plain_loss = ("the weighted smoothing term is built from the plain loss and "
                                 "the logits as they are")
    refused = {"z_loss": (bool(options.get("z_loss")), built_from_the_plain_loss),
               "logit_softcap": (options.get("logit_softcap") is not None,
                                 built_from_the_plain_loss),
               "softcap": (options.get("softcap") is not None, built_from_the_plain_loss),
               # the term's weight gradient goes where autograd puts it, not into the accumulator
               "weight_grad_accumulator": (options.get("weight_grad_accumulator") is not None,
                                           "the smoothing term's weight gradient is autograd's")}
    for option, (given, why) in refused.items():
        if given:
            value = options.get(option)
            shown = "a tensor" if isinstance(value, Tensor) else repr(value)
            raise ValueError(f"{arg}: got a tensor with label_smoothing={eps} and {option}="
                             f"{shown}, expected {option} at its default ({why})")


def weighted_reduction(per_token, row_weight: Tensor, kind: int, counted: Optional[Tensor] = None,
                       weighted: bool = False):
    """The per-token losses weighted (unless `weighted`: they carry the weights already) and
    reduced as F.cross_entropy(weight=...) does; 'mean' over no weight is 0. A CrossEntropyOutput of per-token values: its z-loss weighted as the
    loss that includes it, its accuracy a plain fraction of the `counted` rows (the targets that
    are not ignore_index; Liger's accuracy is unweighted), its predicted tokens as they are."""
    if isinstance(per_token, CrossEntropyOutput):  # (its z-loss never carries the weights)
        extras = reduced_output(per_token._replace(loss=None), counted, kind,
                                lambda t: weighted_reduction(t, row_weight, kind))
        return extras._replace(loss=weighted_reduction(per_token.loss, row_weight, kind,
                                                       weighted=weighted))
    total = per_token if weighted else per_token * row_weight
    if kind == 0:
        return total
    total = total.sum()
    if kind == 1:
        return total
    norm = row_weight.sum()
    return torch.where(norm != 0, total / torch.where(norm != 0, norm, 1.0), 0.0)
