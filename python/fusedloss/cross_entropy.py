"""fusedloss.cross_entropy: torch custom ops over the C++ core.

forward  one pass over the logits (online softmax) -> per-row loss and lse (4 B/row saved);
         with a tp_group of size > 1 the logits are this rank's vocab shard and one
         all_gather_into_tensor of 16 B/row merges the shards
backward one pass that reads the logits and writes the gradient, optionally into the logits
"""
import functools
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _C
from ._autograd import first_order_only
from ._views import as_rows, check_float, check_index, index, matrix, stream_of

# Plain ints (what the op schemas carry, and what torch.compile traces).
_REDUCTIONS = {"none": int(_C.Reduction.NONE), "sum": int(_C.Reduction.SUM), "mean": int(_C.Reduction.MEAN)}
_FORMULAS = {"pytorch": int(_C.SmoothingFormula.PYTORCH), "megatron": int(_C.SmoothingFormula.MEGATRON)}
_SCOPES = {"global": int(_C.SmoothingScope.GLOBAL), "partition": int(_C.SmoothingScope.PARTITION)}
_NONE = _REDUCTIONS["none"]

# Custom-op schemas cannot carry process groups: they carry the group's name ("" at TP=1),
# which torch.compile traces as a constant, and the op resolves it back at run time.
_GROUPS = {}  # name -> group, for torch builds without c10d's name resolver
_AGREED = {}  # (name, id(group)) -> (rows, V_local) last checked on every rank


def _group_name(group) -> str:
    if group is None or dist.get_world_size(group) == 1:
        return ""
    name = group.group_name
    if not torch.compiler.is_compiling():
        _GROUPS[name] = group
    return name


try:  # c10d's own name -> group map (what functional collectives use)
    from torch.distributed.distributed_c10d import _resolve_process_group
except ImportError:
    _resolve_process_group = None


def _resolve_group(name: str):
    """The process group behind a name from _group_name; None for "" (TP=1)."""
    if not name:
        return None
    if _resolve_process_group is not None:
        try:
            return _resolve_process_group(name)
        except (LookupError, ValueError, RuntimeError):
            pass
    return _GROUPS[name]


def _options(ignore_index, label_smoothing, formula, scope, z_loss, reduction, g, v_local):
    """Options for group `g` (a resolved process group, or None at TP=1)."""
    rank, world = (dist.get_rank(g), dist.get_world_size(g)) if g is not None else (0, 1)
    return _options_for(ignore_index, label_smoothing, formula, scope, z_loss, reduction, rank, world,
                        v_local)


@functools.lru_cache(maxsize=256)
def _options_for(ignore_index, label_smoothing, formula, scope, z_loss, reduction, rank, world, v_local):
    """One options object per distinct call (the C++ side only reads it): building it field by
    field costs more host time than the rest of a small call."""
    o = _C.CrossEntropyOptions()
    o.ignore_index = ignore_index
    o.label_smoothing = label_smoothing
    o.smoothing_formula = _C.SmoothingFormula(formula)
    o.smoothing_scope = _C.SmoothingScope(scope)
    o.z_loss = z_loss
    o.reduction = _C.Reduction(reduction)
    if world > 1:
        o.vocab_start = rank * v_local
        o.vocab_global = world * v_local
    return o


def _check_shard_agreement(group, name, rows, v_local, device):
    """Every rank must hold the same rows and an equal vocab shard. One tiny all-gather (a
    host sync) when the shape changes; afterwards nothing. Raises on every rank."""
    key = (name, id(group))  # a re-created world may reuse a name
    if _AGREED.get(key) == (rows, v_local):
        return
    world = dist.get_world_size(group)
    mine = torch.tensor([rows, v_local], dtype=torch.int64, device=device)
    every = torch.empty(2 * world, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine, group=group)
    every = every.view(world, 2).tolist()
    for r, (rr, vv) in enumerate(every):
        if rr != every[0][0]:
            raise ValueError(f"vocab-parallel rows: rank {r} has {rr} rows, rank 0 has {every[0][0]}; "
                             "expected the same rows on every rank")
        if vv != every[0][1]:
            raise ValueError(f"vocab-parallel shard size: rank {r} has V_local {vv}, rank 0 has "
                             f"{every[0][1]}; expected equal shards on every rank")
    _AGREED[key] = (rows, v_local)


def _forward_impl(logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, formula: int,
         scope: int, z_loss: float, reduction: int, group: str,
         inplace_backward: bool) -> Tuple[Tensor, Tensor, Tensor]:
    x = as_rows(logits, "logits")
    t = target.reshape(-1).contiguous()
    rows, v_local = x.shape
    dev = x.device
    loss = torch.empty(rows if reduction == _NONE else (), dtype=torch.float32, device=dev)
    lse = torch.empty(rows, dtype=torch.float32, device=dev)
    count = torch.empty((), dtype=torch.float32, device=dev)
    g = _resolve_group(group)
    o = _options(ignore_index, label_smoothing, formula, scope, z_loss, reduction, g, v_local)
    stream = stream_of(x)
    xv, tv = matrix(x, "logits"), index(t, "target")
    if g is None:
        _C.cross_entropy_forward(xv, tv, o, loss.data_ptr(), lse.data_ptr(), count.data_ptr(), stream)
        return loss, lse, count
    world = dist.get_world_size(g)
    _check_shard_agreement(g, group, rows, v_local, dev)
    stats = torch.empty(rows, _C.ROW_STATS_FLOATS, dtype=torch.float32, device=dev)
    _C.cross_entropy_local_stats(xv, tv, o, stats.data_ptr(), stream)
    gathered = torch.empty(world * rows, _C.ROW_STATS_FLOATS, dtype=torch.float32, device=dev)
    dist.all_gather_into_tensor(gathered, stats, group=g)  # the hook: 16 B/row, once
    _C.cross_entropy_merge(gathered.data_ptr(), world, stats.data_ptr(), tv, o, v_local,
                           loss.data_ptr(), lse.data_ptr(), count.data_ptr(), stream)
    return loss, lse, count


_fwd = torch.library.custom_op("fusedloss::cross_entropy_fwd", mutates_args=())(_forward_impl)


@_fwd.register_fake
def _(logits, target, ignore_index, label_smoothing, formula, scope, z_loss, reduction, group,
      inplace_backward):
    rows = target.numel()
    f32 = dict(dtype=torch.float32, device=logits.device)
    loss = logits.new_empty(rows if reduction == _NONE else (), **f32)
    return loss, logits.new_empty(rows, **f32), logits.new_empty((), **f32)


def _backward_into(grad_loss, logits, target, lse, count, opts, out):
    x = as_rows(logits, "logits")
    t = target.reshape(-1).contiguous()
    *head, group = opts
    o = _options(*head, _resolve_group(group), x.size(1))
    gl = grad_loss.to(torch.float32).reshape(-1).contiguous()
    _C.cross_entropy_backward(matrix(x, "logits"), index(t, "target"), lse.data_ptr(), gl.data_ptr(),
                              count.data_ptr(), o, matrix(out, "grad_logits"), stream_of(x))


@torch.library.custom_op("fusedloss::cross_entropy_bwd", mutates_args=())
def _bwd(grad_loss: Tensor, logits: Tensor, target: Tensor, lse: Tensor, count: Tensor,
         ignore_index: int, label_smoothing: float, formula: int, scope: int, z_loss: float,
         reduction: int, group: str) -> Tensor:
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    opts = (ignore_index, label_smoothing, formula, scope, z_loss, reduction, group)
    _backward_into(grad_loss, logits, target, lse, count, opts, grad.view(-1, grad.size(-1)))
    return grad


@_bwd.register_fake
def _(grad_loss, logits, *rest):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.custom_op("fusedloss::cross_entropy_bwd_", mutates_args=("logits",))
def _bwd_inplace(grad_loss: Tensor, logits: Tensor, target: Tensor, lse: Tensor, count: Tensor,
                 ignore_index: int, label_smoothing: float, formula: int, scope: int,
                 z_loss: float, reduction: int, group: str) -> None:
    x = as_rows(logits, "logits")
    opts = (ignore_index, label_smoothing, formula, scope, z_loss, reduction, group)
    _backward_into(grad_loss, x, target, lse, count, opts, x)


@_bwd_inplace.register_fake
def _(*args):
    return None


def _can_write_in_place(logits: Tensor) -> bool:
    """The gradient can land in the logits' own storage when rows are a view of it. A leaf
    (a parameter or user tensor) is never overwritten: its gradient goes to a new buffer."""
    if logits.is_leaf:
        return False
    if logits.stride(-1) != 1 and logits.size(-1) > 1:
        return False
    try:
        logits.view(-1, logits.size(-1))
        return True
    except RuntimeError:
        return False


def _setup_context(ctx, inputs, output):
    logits, target, *opts, inplace = inputs
    _, lse, count = output
    ctx.opts = tuple(opts)
    ctx.inplace = inplace
    ctx.save_for_backward(logits, target, lse, count)


def _run_backward(ctx, grad_loss, eager):
    """The backward of both paths: eager calls the core directly, traced code the custom ops."""
    if getattr(ctx, "consumed", False):
        raise RuntimeError(
            "fusedloss.cross_entropy: second backward through a loss computed with "
            "inplace_backward=True; the first backward overwrote the logits with their gradient, "
            "so they cannot be differentiated again. Use inplace_backward=False to backward twice "
            "(retain_graph=True).")
    logits, target, lse, count = ctx.saved_tensors
    no_grads = [None] * (len(ctx.opts) + 2)
    if ctx.inplace and _can_write_in_place(logits):
        ctx.consumed = True
        if eager:
            _backward_into(grad_loss, logits, target, lse, count, ctx.opts, as_rows(logits, "logits"))
        else:
            torch.ops.fusedloss.cross_entropy_bwd_(grad_loss, logits, target, lse, count, *ctx.opts)
        # The logits now hold their gradient: any later reader trips autograd's version check.
        torch.autograd.graph.increment_version(logits)
        return (logits, *no_grads)
    if eager:
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        _backward_into(grad_loss, logits, target, lse, count, ctx.opts, grad.view(-1, grad.size(-1)))
    else:
        grad = torch.ops.fusedloss.cross_entropy_bwd(grad_loss, logits, target, lse, count, *ctx.opts)
    return (grad, *no_grads)


def _backward(ctx, grad_loss, _grad_lse, _grad_count):
    return _run_backward(ctx, grad_loss, eager=False)


_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerCrossEntropy(torch.autograd.Function):
    """The same forward and backward without the custom-op dispatch, for eager mode (the
    custom ops are what torch.compile traces; eagerly they would cost ~0.1 ms per call)."""

    @staticmethod
    def forward(ctx, logits, target, *opts_and_inplace):
        *opts, inplace = opts_and_inplace
        loss, lse, count = _forward_impl(logits, target, *opts, inplace)
        ctx.opts, ctx.inplace = tuple(opts), inplace
        ctx.save_for_backward(logits, target, lse, count)
        return loss

    @staticmethod
    @first_order_only("fusedloss.cross_entropy")
    def backward(ctx, grad_loss):
        return _run_backward(ctx, grad_loss, eager=True)


def _check_args(logits, target, label_smoothing, smoothing_formula, smoothing_scope, reduction, z_loss):
    if not isinstance(logits, Tensor) or logits.dim() not in (2, 3):
        raise ValueError(f"logits: got {getattr(logits, 'shape', type(logits))}, expected a 2-D [N, V] "
                         "or 3-D [s, b, V] tensor")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"target: got shape {tuple(target.shape)}, expected {tuple(logits.shape[:-1])} "
                         "(the logits' shape without the vocab dim)")
    check_float(logits, "logits")
    check_index(target, "target")
    if target.device != logits.device:
        raise ValueError(f"target.device: got {target.device}, expected {logits.device} (the logits' device)")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing: got {label_smoothing}, expected in [0, 1)")
    if not z_loss >= 0.0:
        raise ValueError(f"z_loss: got {z_loss}, expected >= 0")
    for name, value, allowed in (("reduction", reduction, _REDUCTIONS),
                                 ("smoothing_formula", smoothing_formula, _FORMULAS),
                                 ("smoothing_scope", smoothing_scope, _SCOPES)):
        if value not in allowed:
            raise ValueError(f"{name}: got {value!r}, expected one of {sorted(allowed)}")


def cross_entropy(logits: Tensor, target: Tensor, *, ignore_index: int = -100,
                  label_smoothing: float = 0.0, smoothing_formula: str = "pytorch",
                  reduction: str = "mean", z_loss: float = 0.0, inplace_backward: bool = False,
                  tp_group: Optional["dist.ProcessGroup"] = None,
                  smoothing_scope: str = "global") -> Tensor:
    """Cross-entropy of logits [N, V] or [s, b, V] (fp32/fp16/bf16) against int targets.

    Matches torch.nn.functional.cross_entropy for the options they share. `z_loss` adds
    z * lse^2 per row. `smoothing_formula='megatron'` uses a = ls * K / (K - 1) and
    `smoothing_scope='partition'` averages over the rank's own shard, as Megatron's
    vocab_parallel_cross_entropy does. With a `tp_group` of size > 1 the logits are this rank's
    contiguous vocab shard (rank r holds [r V_local, (r+1) V_local)) and targets are global ids.
    `inplace_backward=True` writes the gradient into the logits (no [N, V] gradient buffer);
    the logits are then consumed: reading them afterwards, or a second backward, raises.
    Never synchronises the host on CUDA; an out-of-range target makes its row NaN and is
    raised by fusedloss.check_device_errors().
    """
    _check_args(logits, target, label_smoothing, smoothing_formula, smoothing_scope, reduction, z_loss)
    args = (logits, target, int(ignore_index), float(label_smoothing), _FORMULAS[smoothing_formula],
            _SCOPES[smoothing_scope], float(z_loss), _REDUCTIONS[reduction], _group_name(tp_group),
            bool(inplace_backward))
    if torch.compiler.is_compiling():
        loss, _, _ = torch.ops.fusedloss.cross_entropy_fwd(*args)
    else:
        loss = _EagerCrossEntropy.apply(*args)
    return loss.view(target.shape) if reduction == "none" else loss


class CrossEntropyLoss(torch.nn.Module):
    """nn.Module form of fusedloss.cross_entropy (same keyword options)."""

    def __init__(self, **options):
        super().__init__()
        self.options = options

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return cross_entropy(logits, target, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())
