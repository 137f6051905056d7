"""fusedloss.linear_cross_entropy: the LM head's projection and the cross-entropy in one op,
without a [tokens, V] logits buffer (logits exist one token chunk at a time in a bounded
workspace; see include/fusedloss/linear_cross_entropy.h).

backward modes (chosen here, both exact):
  in_forward  reduction sum/mean: the forward also computes the gradients of the loss for an
              upstream gradient of 1 (3 GEMMs in all); the backward scales them by the upstream
              scalar on the device. Saved: dhidden [N, H] (hidden's dtype) and dweight [V, H]
              (the weight's dtype, or fp32: dweight_accumulation). reduction none with a
              loss_mask m: the gradients of sum(m * loss), for an upstream gradient c * m
              (found on the device).
  recompute   reduction none without a loss_mask (or asked for): the forward keeps lse
              (4 B/row); the backward recomputes each chunk's logits (4 GEMMs in all).
tp_group of size > 1, after the shard agreement: in_forward runs the C++ hook per chunk (local
stats, an all-gather of 16 B/row through the group, merge); recompute takes this rank's stats
of every row and merges them after one all-gather. The hidden gradient is this rank's partial
sum, unless dhidden_reduction is "all_reduce" (summed here) or "reduce_scatter" (hidden is this
rank's slice of the tokens, gathered before the op; the gradient is summed back to the slices).
"""
import functools
from typing import NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _C, _native
from ._distributed import (callback_communicator, deferred_rejection, fingerprint, gathered_rows,
                           grad_summed_over_group, group_name, group_size, merge_buffers,
                           merge_over_group, rank_and_size, rank_checks, resolve_group)
from ._op import FusedOp, through_custom_ops
from ._sequence_parallel import gather_token_slices, gathered_shape, own_rows_buffer, sum_into_own_rows
from ._views import (agreement_flag, as_bool, as_choice, as_float, as_int, autocast_dtype,
                     autocast_operands,
                     choice_name, device_of, _DTYPES, index, matrix, parsed_once,
                     require_same_device, require_targets, require_tensor, require_values,
                     rows_of, _rows_view, shares_memory, stream_of, validated, values_in,
                     vector)
from .cross_entropy import (_REDUCTIONS, _row_chunks, as_softcap, check_targets_on_host,
                            reduced_output, class_weighted, loss_outputs, _wanted, _with_extras,
                            make_options, option_names, parse_options, weighted_reduction)
from .cross_entropy import _Options as CeOptions
from ._head import as_workspace_bytes, validate_head_operands  # noqa: F401  (the heads' shared checks)
from .linear_log_probs import linear_log_probs

_NONE = _REDUCTIONS["none"]
_IN_FORWARD, _RECOMPUTE = int(_C.LinearCeBackward.IN_FORWARD), int(_C.LinearCeBackward.RECOMPUTE)
_MODES = {"auto": -1, "in_forward": _IN_FORWARD, "recompute": _RECOMPUTE}
# A call no gradient follows: the recompute form's forward (no gradients kept), told apart from
# recompute in the TP agreement, since only ranks with a gradient to compute run a backward.
_FORWARD_ONLY = -2


_DHIDDEN = {"partial": 0, "all_reduce": 1, "reduce_scatter": 2}
# what the TP agreement's mismatch error calls the accumulator (fingerprint's named options)
_ACCUMULATOR_KINDS = ("none", "a tensor", "a callable")
# dweight_accumulation: "auto" (-1) resolves per call (_fp32_accumulation)
_ACCUMULATION = {"auto": -1, "weight_dtype": 0, "fp32": 1}
_OP = "fusedloss.linear_cross_entropy"


# The checked keyword options the op schema carries first, in its order: the cross-entropy's,
# then the linear CE's own.
_Options = NamedTuple("_Options", [*CeOptions.__annotations__.items(), ("softcap", float),
                                   ("workspace_bytes", int)])


# Every plain argument of the op's kernels after its tensors, in the schema's order (the custom
# ops take them flat: *options): the keyword options, then what the call resolved.
_KernelOptions = NamedTuple("_KernelOptions", [
    *_Options.__annotations__.items(), ("mode", int), ("tf32", bool), ("group", str),
    ("check", bool), ("dhidden_reduction", int), ("acc32", bool), ("inplace", bool),
    ("bias_grad", bool)])


def _cpp_mode(mode: int) -> int:
    """The C++ backward mode that runs `mode`: the forward alone is the recompute form's."""
    return _RECOMPUTE if mode == _FORWARD_ONLY else mode


@functools.lru_cache(maxsize=256)
def _options(ignore_index, label_smoothing, formula, scope, z_loss, reduction, softcap,
             workspace_bytes, mode, tf32, rank, world, v_local, hidden, vocab_block=0):
    """(CrossEntropyOptions, LinearCrossEntropyOptions), validated, one per distinct call."""
    o = make_options(ignore_index, label_smoothing, formula, scope, z_loss, reduction, rank, world,
                     v_local)
    if world > 1:
        o.check_shard_agreement = False  # _forward runs the agreement over the group itself
    lo = _C.LinearCrossEntropyOptions()
    lo.logit_softcap = softcap
    if workspace_bytes > 0:
        lo.workspace_bytes = workspace_bytes
    lo.allow_tf32 = tf32
    lo.backward_mode = _C.LinearCeBackward(mode)
    lo.vocab_block = vocab_block
    validated(_C.validate_linear_cross_entropy_options, o, lo, 1, v_local, hidden)
    return o, lo


def chunk_rows(dtype: torch.dtype, rows: int, v_local: int, workspace_bytes: int = 0) -> int:
    """The token chunk for these sizes, as workspace_bytes (0: the default) and the
    FUSEDLOSS_LCE_* knobs set it. The in-forward mode runs one collective per chunk, so ranks
    must agree on it: the op's agreement compares it, and so does a caller that runs the
    agreement for the op (the Megatron head)."""
    lo = _C.LinearCrossEntropyOptions()
    if workspace_bytes:
        lo.workspace_bytes = workspace_bytes
    return _C.linear_cross_entropy_chunk_rows(lo, rows, v_local, _DTYPES[dtype])


def gemm_operand(weight: Tensor, hidden: Tensor) -> Tensor:
    """weight's rows in hidden's dtype, as the GEMMs read them: an fp32 weight under
    torch.autocast stays fp32 outside the op (its gradient leaves in fp32, unrounded) and is
    cast here, for this call only (a recompute backward casts again instead of keeping it)."""
    w = rows_of(weight)
    return w if w.dtype == hidden.dtype else w.to(hidden.dtype)


def _absent(device):
    return _C.MatrixView(0, 0, 1, 1, _C.DType.F32, device)


def _address(row_weight: Optional[Tensor]) -> int:
    """The row weights' (or a gradient buffer's) address for the core (0: none or empty)."""
    return 0 if row_weight is None or row_weight.numel() == 0 else row_weight.data_ptr()


def _bias_operand(bias: Optional[Tensor]) -> Optional[Tensor]:
    """The bias as the kernels read it: contiguous in its own dtype (the weight's, or fp32
    beside a 16-bit hidden under torch.autocast), a copy of an expanded or strided view."""
    return None if bias is None else bias.contiguous()


def _forward(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor],
             row_weight: Optional[Tensor], ignore_index: int,
             label_smoothing: float, formula: int, scope: int, z_loss: float, reduction: int,
             softcap: float, workspace_bytes: int, lce_mode: int, tf32: bool, group: str,
             check_agreement: bool, dhidden_reduction: int, acc32: bool, inplace: bool,
             bias_grad: bool, weight_grad_accumulator: Optional[Tensor], argmax: bool
             ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    mode = _cpp_mode(lce_mode)  # ("mode" would clash with torch's functionalization of the ops)
    g = resolve_group(group)
    rank, world = rank_and_size(g)
    dev = hidden.device
    f32 = dict(dtype=torch.float32, device=dev)
    unit_dw = dict(dtype=torch.float32 if acc32 else weight.dtype, device=dev)
    args = (ignore_index, label_smoothing, formula, scope, z_loss, reduction, softcap,
            workspace_bytes, mode, tf32)

    def outputs(h, rows, v_local):
        loss, lse, count = loss_outputs(rows, reduction, dev)
        if mode != _IN_FORWARD:  # distinct: outputs never alias
            return (loss, lse, count, torch.empty(0, **f32), torch.empty(0, **f32),
                    torch.empty(0, **f32))
        # the bias's unit gradient in fp32 (summed over the chunks there), when it needs one
        db = torch.empty(v_local if bias is not None and bias_grad else 0, **f32)
        return (loss, lse, count, torch.empty(rows, h.size(1), dtype=h.dtype, device=dev),
                torch.empty(v_local, h.size(1), **unit_dw), db)

    if g is None:
        h = rows_of(hidden)
        w = gemm_operand(weight, hidden)
        t, tv = index(target, "target")
        rows, v_local = h.size(0), w.size(0)
        o, lo = _options(*args, 0, 1, v_local, h.size(1))
        b = _bias_operand(bias)
        loss, lse, count, dh, dw, db = outputs(h, rows, v_local)
        grads = (matrix(dh), matrix(dw)) if mode == _IN_FORWARD else (_absent(device_of(h)),) * 2
        _C.linear_cross_entropy_forward(matrix(h), matrix(w), tv, o, lo, loss.data_ptr(),
                                        lse.data_ptr(), count.data_ptr(), *grads, stream_of(h),
                                        row_weight=_address(row_weight), bias=vector(b),
                                        dbias=_address(db))
        return loss, lse, count, dh, dw, db
    # the fingerprint leaves the workspace out (the chunking it sets is its own field); it
    # holds what changes the collectives (mode, dhidden_reduction; a callable accumulator,
    # agreed on again in the backward), the dtype, H (the dhidden all-reduce's size) and the
    # target's shape ([s, b] on one rank and [b, s] on another have equal rows)
    accumulator = (0 if weight_grad_accumulator is None else
                   2 if callable(weight_grad_accumulator) else 1)
    mode_name = ("none (no gradient follows: the forward alone)" if lce_mode == _FORWARD_ONLY
                 else choice_name(_MODES, lce_mode))
    # where one rank scales the saved gradients in place, a second backward (retain_graph)
    # raises there before the dhidden collective the others would wait in
    scaled_in_place = _scales_in_place(inplace, lce_mode, acc32, weight.dtype)
    options = fingerprint(**option_names(*args[:6]), logit_softcap=softcap,
                          loss_mask=row_weight is not None, backward_mode=mode_name,
                          allow_tf32=tf32, dhidden_reduction=choice_name(_DHIDDEN, dhidden_reduction),
                          bias=bias is not None,
                          dtype=str(hidden.dtype), H=hidden.size(-1),
                          weight_grad_accumulator=_ACCUMULATOR_KINDS[accumulator],
                          inplace_backward=scaled_in_place, target_shape=tuple(target.shape),
                          # the log-prob head's arg-max (and its collectives) follows on the
                          # ranks that ask for it
                          return_token_accuracy_or_predicted_tokens=argmax)
    # Everything that may fail on this rank alone (a copy, an allocation: the gradients, the
    # scratch, the staging) before the agreement.
    with rank_checks(g, check_agreement, _OP, options=options) as checks:
        h = rows_of(hidden)
        w = gemm_operand(weight, hidden)
        t, tv = index(target, "target")
        checks.rows, checks.v_local = rows, v_local = h.size(0), w.size(0)
        checks.target = t if row_weight is None else (t, row_weight)  # both compared
        o, lo = _options(*args, rank, world, v_local, h.size(1))
        if check_agreement:
            check_targets_on_host(t.reshape(-1), o)  # (flat positions in its message)
        b = _bias_operand(bias)
        loss, lse, count, dh, dw, db = outputs(h, rows, v_local)
        stream = stream_of(h)
        if mode == _IN_FORWARD:  # one collective per chunk: the chunking must agree too
            checks.chunk_rows = chunk_rows(h.dtype, rows, v_local, workspace_bytes)
            scratch = torch.empty(_C.linear_cross_entropy_forward_scratch_bytes(
                matrix(h), matrix(w), o, lo, world), dtype=torch.uint8, device=dev)
            comm = callback_communicator(g, dev, checks.chunk_rows)
        else:
            stats = torch.empty(rows, _C.ROW_STATS_FLOATS, **f32)
            buffers = merge_buffers(g, stats)
            scratch = torch.empty(_C.linear_cross_entropy_local_stats_scratch_bytes(
                matrix(h), matrix(w), lo), dtype=torch.uint8, device=dev)
            _C.linear_cross_entropy_prepare(device_of(h), stream)  # what its first call creates
    if mode == _IN_FORWARD:  # per chunk: stats, the all-gather (a callback to the group), merge
        _C.linear_cross_entropy_forward(matrix(h), matrix(w), tv, o, lo, loss.data_ptr(),
                                        lse.data_ptr(), count.data_ptr(), matrix(dh), matrix(dw),
                                        stream, comm, scratch.data_ptr(), scratch.numel(),
                                        _address(row_weight), vector(b), _address(db))
        return loss, lse, count, dh, dw, db
    _C.linear_cross_entropy_local_stats(matrix(h), matrix(w), tv, o, lo, stats.data_ptr(), stream,
                                        scratch.data_ptr(), scratch.numel(), vector(b))
    merge_over_group(g, stats, buffers, tv, o, v_local, loss, lse, count, stream)
    return loss, lse, count, dh, dw, db


def _forward_fake(hidden, weight, target, bias, row_weight, ignore_index, label_smoothing, formula,
                  scope, z_loss, reduction, softcap, workspace_bytes, lce_mode, tf32, group,
                  check_agreement, dhidden_reduction, acc32, inplace, bias_grad,
                  weight_grad_accumulator, argmax):
    rows, H = target.numel(), hidden.size(-1)
    f32 = dict(dtype=torch.float32, device=hidden.device)
    loss = hidden.new_empty(rows if reduction == _NONE else (), **f32)
    db = hidden.new_empty(0, **f32)
    if lce_mode == _IN_FORWARD:
        dh = hidden.new_empty(rows, H, dtype=hidden.dtype)
        dw = hidden.new_empty(weight.size(0), H, dtype=torch.float32 if acc32 else weight.dtype)
        if bias is not None and bias_grad:
            db = hidden.new_empty(weight.size(0), **f32)
    else:
        dh, dw = hidden.new_empty(0, **f32), hidden.new_empty(0, **f32)
    return loss, hidden.new_empty(rows, **f32), hidden.new_empty((), **f32), dh, dw, db


def _run_backward(grad_loss, hidden, weight, target, lse, count, row_weight, saved_dh, saved_dw,
                  opts, dh, dw, accumulate=False, bias=None, saved_db=None, db=None):
    """The C++ backward into rows dh [N, H] and dw [V_local, H] (which may be the saved ones;
    accumulate: dw += the weight's gradient) and, with a bias, db [V_local] (None or empty: no
    bias gradient), then dh's collective over the group, if any."""
    (ignore_index, label_smoothing, formula, scope, z_loss, reduction, softcap, workspace_bytes,
     mode, tf32, group, _check, dhidden_reduction, acc32, _inplace, _bias_grad) = opts
    g = resolve_group(group)
    rank, world = rank_and_size(g)
    # the collective over dh on every rank: the all-reduce, or the reduce-scatter of the
    # gathered token slices (each rank's own rows summed)
    reduced = (None if g is None else
               "all-reduce" if dhidden_reduction == _DHIDDEN["all_reduce"] else
               "reduce-scatter" if dhidden_reduction == _DHIDDEN["reduce_scatter"] else None)
    # Whatever may fail on this rank alone (a copy, an allocation, the C++ call) comes before
    # the collective, inside the try: a rank that raised outside it would leave the others
    # waiting there.
    try:
        h = rows_of(hidden)
        w = gemm_operand(weight, hidden)
        t, tv = index(target, "target")
        # recompute into a 16-bit dweight, exactly: vocabulary blocks outside (each block's
        # dweight sums over all tokens in an fp32 buffer), dhidden summed over blocks in fp32.
        block = _C.linear_cross_entropy_backward_vocab_block(
            _C.LinearCeBackward(_cpp_mode(mode)), acc32, _DTYPES[dw.dtype], h.size(1))
        o, lo = _options(ignore_index, label_smoothing, formula, scope, z_loss, reduction, softcap,
                         workspace_bytes, mode, tf32, rank, world, w.size(0), h.size(1), block)
        gl = values_in(grad_loss, torch.float32)  # may arrive expanded; the kernel reads its data_ptr
        if mode == _IN_FORWARD:
            sdh, sdw = matrix(saved_dh), matrix(saved_dw)
        else:
            sdh = sdw = _absent(device_of(h))
        own_rows = own_rows_buffer(dh, g) if reduced == "reduce-scatter" else None
        b = _bias_operand(bias)
        _C.linear_cross_entropy_backward(matrix(h), matrix(w), tv, lse.data_ptr(), gl.data_ptr(),
                                         count.data_ptr(), o, lo, sdh, sdw, matrix(dh), matrix(dw),
                                         accumulate, stream_of(h), _address(row_weight), vector(b),
                                         _address(saved_db), _address(db),
                                         _DTYPES[db.dtype] if db is not None else _C.DType.F32)
    except Exception as error:
        if reduced is not None:
            _join_failed(dh, g, reduced, error)
        raise
    if reduced == "all-reduce":
        dist.all_reduce(dh, group=g)
    elif reduced == "reduce-scatter":
        sum_into_own_rows(dh, g, own_rows)


def _join_failed(dh, group, reduced, error):
    """A rank whose backward raised (an upstream gradient that is not c * loss_mask on this rank
    alone, a FUSEDLOSS_LCE_* knob changed since the forward, out of memory) still takes part in
    the dhidden collective the other ranks wait in (`reduced`: "all-reduce" or
    "reduce-scatter"), with NaN: their dhidden comes back NaN instead of a hang, and this rank
    raises. (No agreement here: it would synchronise every backward with the host.) Nothing is
    allocated that could fail again: dh itself holds the NaN where a copy does not fit."""
    try:
        nan = torch.full_like(dh, float("nan"))
    except Exception:  # noqa: BLE001 (out of memory: this failed backward's own buffer)
        nan = dh.fill_(float("nan"))
    if reduced == "all-reduce":
        dist.all_reduce(nan, group=group)
    else:  # received into this rank's own rows of its NaN: NaN either way, nothing allocated
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        n = nan.size(0) // world
        dist.reduce_scatter_tensor(nan.narrow(0, rank * n, n), nan, group=group)
    if hasattr(error, "add_note"):  # Python 3.11
        error.add_note(f"{_OP}: this rank joined the dhidden {reduced} with NaN, so the other "
                       "ranks' dhidden is NaN (they did not fail and raise nothing)")


def _backward(grad_loss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, lse: Tensor,
              count: Tensor, bias: Optional[Tensor], row_weight: Optional[Tensor],
              saved_dh: Tensor, saved_dw: Tensor, saved_db: Tensor, ignore_index: int,
              label_smoothing: float, formula: int, scope: int, z_loss: float, reduction: int,
              softcap: float, workspace_bytes: int, lce_mode: int, tf32: bool, group: str,
              check_agreement: bool, dhidden_reduction: int, acc32: bool,
              inplace: bool, bias_grad: bool) -> Tuple[Tensor, Tensor, Tensor]:
    opts = _KernelOptions(ignore_index, label_smoothing, formula, scope, z_loss, reduction, softcap,
                          workspace_bytes, lce_mode, tf32, group, check_agreement, dhidden_reduction,
                          acc32, inplace, bias_grad)
    N, H = target.numel(), hidden.size(-1)
    dh = torch.empty(N, H, dtype=hidden.dtype, device=hidden.device)
    # recompute: dweight sums over all tokens in fp32 per vocabulary block (acc32), or chunk pair
    # by chunk pair in the weight's dtype. in_forward: the saved unit gradient, scaled.
    dw = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    # the bias's, in its dtype (summed in fp32, rounded once); empty without one to compute
    db = (torch.empty(bias.shape, dtype=bias.dtype, device=bias.device)
          if bias is not None and bias_grad else hidden.new_empty(0, dtype=torch.float32))
    _run_backward(grad_loss, hidden, weight, target, lse, count, row_weight, saved_dh, saved_dw,
                  opts, dh, dw, bias=bias, saved_db=saved_db, db=db)
    return dh.view(hidden.shape), dw, db


def _scale_inplace(grad_loss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, lse: Tensor,
                   count: Tensor, bias: Optional[Tensor], row_weight: Optional[Tensor],
                   saved_dh: Tensor, saved_dw: Tensor, saved_db: Tensor, ignore_index: int,
                   label_smoothing: float, formula: int, scope: int, z_loss: float, reduction: int,
                   softcap: float, workspace_bytes: int, lce_mode: int, tf32: bool, group: str,
                   check_agreement: bool, dhidden_reduction: int, acc32: bool,
                   inplace: bool, bias_grad: bool) -> None:
    """in_forward with saved gradients in the inputs' dtypes: scaled where they are (the bias's
    too, in fp32: _grads casts it to the bias's dtype)."""
    opts = _KernelOptions(ignore_index, label_smoothing, formula, scope, z_loss, reduction, softcap,
                          workspace_bytes, lce_mode, tf32, group, check_agreement, dhidden_reduction,
                          acc32, inplace, bias_grad)
    _run_backward(grad_loss, hidden, weight, target, lse, count, row_weight, saved_dh, saved_dw,
                  opts, saved_dh, saved_dw, bias=bias, saved_db=saved_db, db=saved_db)


def _backward_fake(grad_loss, hidden, weight, target, lse, count, bias, row_weight, saved_dh,
                   saved_dw, saved_db, *opts):
    # contiguous, as _backward returns them (empty_like would keep a transposed input's strides)
    bias_grad = _KernelOptions(*opts).bias_grad
    db = (bias.new_empty(bias.shape) if bias is not None and bias_grad
          else hidden.new_empty(0, dtype=torch.float32))
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape), db


def _setup(ctx, inputs, output):
    hidden, weight, target, bias, row_weight, *opts, accumulator, _argmax = inputs
    _, lse, count, dh, dw, db = output
    if accumulator is not None and ctx.traced:  # (refused before the call; a traced op still)
        raise RuntimeError(f"{_OP}: weight_grad_accumulator is not supported under torch.compile "
                           "(the backward would write into a tensor the graph does not own); "
                           "call the op eagerly, or leave the accumulator out")
    # An attribute, not a saved tensor: a gradient buffer (Megatron's main_grad, a view of one
    # flat buffer) is written by other parameters' backward before this one's. A callable is
    # asked at the backward (a buffer bound late).
    ctx.accumulator = accumulator
    ctx.opts = opts = _KernelOptions(*opts)
    # Scaling the saved gradients in place needs them in the inputs' dtypes (the saved ones are
    # owned here alone); the second backward this rules out raises (the scaffold's guard).
    ctx.inplace = _scales_in_place(opts.inplace, opts.mode, opts.acc32, weight.dtype)
    ctx.save_for_backward(hidden, weight, target, lse, count, bias, row_weight, dh, dw, db)


def _scales_in_place(inplace: bool, mode: int, acc32: bool, weight_dtype: torch.dtype) -> bool:
    """Whether the backward scales the saved gradients where they are: in_forward with them in
    the inputs' dtypes (dhidden always is; dweight unless kept in fp32 for a 16-bit weight)."""
    return inplace and mode == _IN_FORWARD and (not acc32 or weight_dtype == torch.float32)


def _accumulator_at_backward(ctx, weight, hidden):
    """The buffer the weight's gradient is added to, or None (none given, the weight needs no
    gradient, or a callable that returns None: the gradient then goes through autograd)."""
    accumulator = ctx.accumulator
    if accumulator is None or not ctx.needs_input_grad[1]:
        return None
    if callable(accumulator):
        accumulator = accumulator()
        if accumulator is not None:
            _validate_accumulator(accumulator, weight, hidden)
    return accumulator


def _grads(ctx, grad_loss, kernels):
    hidden, weight, target, lse, count, bias, row_weight, dh, dw, db = ctx.saved_tensors
    # the row weights, the options, the accumulator, the arg-max flag
    nones = (None,) * (len(ctx.opts) + 3)
    group, check = ctx.opts.group, ctx.opts.check
    g = resolve_group(group) if callable(ctx.accumulator) and check else None
    # A callable's buffer is known only now: at TP > 1 every rank takes part in one agreement,
    # so a bad buffer on one rank raises its error on every rank (not a hang in the all-reduce).
    with rank_checks(g, check, _OP):
        accumulator = _accumulator_at_backward(ctx, weight, hidden)
    bias_grad = bias is not None and ctx.opts.bias_grad
    if accumulator is not None:  # eager only (see _setup)
        out_dh = dh if ctx.inplace else torch.empty(target.numel(), hidden.size(-1),
                                                    dtype=hidden.dtype, device=hidden.device)
        out_db = torch.empty(bias.shape, dtype=bias.dtype, device=bias.device) if bias_grad else None
        _run_backward(grad_loss, hidden, weight, target, lse, count, row_weight, dh, dw, ctx.opts,
                      out_dh, accumulator, accumulate=True, bias=bias, saved_db=db, db=out_db)
        # autograd still gets a weight gradient (Megatron's DDP hooks wait for one): zeros,
        # expanded from one element
        zeros = torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)
        return ((out_dh.view(hidden.shape), zeros, None, out_db) + nones,
                (dh if ctx.inplace else None))
    if ctx.inplace:
        kernels.scale_(grad_loss, hidden, weight, target, lse, count, bias, row_weight, dh, dw, db,
                       *ctx.opts)
        out_db = db.to(bias.dtype) if bias_grad else None  # scaled in fp32, rounded once
        return (dh.view(hidden.shape), dw.view(weight.shape), None, out_db) + nones, dh
    dh, dw, db = kernels.bwd(grad_loss, hidden, weight, target, lse, count, bias, row_weight, dh,
                             dw, db, *ctx.opts)
    return (dh, dw, None, db if bias_grad else None) + nones, None


_CONSUMED = "scaled the gradients its forward saved in place (the inputs are untouched)"
_KERNELS = {"bwd": (_backward, _backward_fake, ()),
            "scale_": (_scale_inplace, lambda *args: None, ("saved_dh", "saved_dw", "saved_db"))}
_linear_cross_entropy = FusedOp(
    "linear_cross_entropy", forward=_forward, forward_fake=_forward_fake, setup=_setup,
    backward=_grads, inplace_flag="inplace_backward", consumed=_CONSUMED, kernels=_KERNELS)
# return_z_loss: the same op with the merged lse as a second, non-differentiable output
_linear_cross_entropy_lse = FusedOp(
    "linear_cross_entropy_lse", forward=_forward, forward_fake=_forward_fake, setup=_setup,
    backward=lambda ctx, grads, kernels: _grads(ctx, grads[0], kernels), n_outputs=2,
    inplace_flag="inplace_backward", consumed=_CONSUMED, kernels=_KERNELS)


# eager calls without a tp_group or an accumulator: the same steps with the node in C++
_EAGER = _native.ops.linear_cross_entropy_eager.default if _native.ops is not None else None


def _casts_weight_inside(hidden, weight) -> bool:
    """Whether torch.autocast would cast an fp32 weight to a 16-bit dtype for this call: the op
    then takes it uncast (gemm_operand) and its gradient stays fp32."""
    return (isinstance(hidden, Tensor) and isinstance(weight, Tensor)
            and weight.dtype == torch.float32
            and autocast_dtype(weight, hidden) in (torch.bfloat16, torch.float16))


def validate_inputs(hidden, weight, target, token_slices: int = 1, fp32_weight_ok=False):
    """token_slices > 1: hidden is one of that many ranks' slices of the tokens (dim 0), and
    target covers them all. fp32_weight_ok: an fp32 weight beside a 16-bit hidden (torch.autocast's
    operands, cast inside the op)."""
    validate_head_operands(hidden, weight, fp32_weight_ok)
    require_tensor(target, "target")
    if token_slices == 1:
        require_targets(target, hidden, "hidden", "hidden's shape without the hidden dim")
    else:
        require_targets(target, hidden, "hidden", f"the tokens of {token_slices} ranks' slices "
                        "of hidden along dim 0, without the hidden dim: dhidden_reduction="
                        "'reduce_scatter'", shape=gathered_shape(hidden.shape[:-1], token_slices))


def _checked_bias(bias, weight, hidden):
    """The bias as the op takes it: [V_local] of weight's dtype (as passed; the op's own cast
    to the GEMMs' dtype under torch.autocast is differentiated back to it) and device."""
    require_values(bias, "bias")
    if bias.dim() != 1 or bias.size(0) != weight.size(0):
        raise ValueError(f"bias: got shape {tuple(bias.shape)}, expected [{weight.size(0)}] "
                         "(V_local = weight.shape[0]: this rank's shard of the vocabulary)")
    if bias.dtype != weight.dtype:
        raise ValueError(f"bias.dtype: got {bias.dtype}, expected {weight.dtype} (weight's dtype)")
    require_same_device(bias, "bias", weight, "weight")
    # the kernels read it in the GEMMs' dtype or fp32 (an fp32 weight cast inside the op)
    return bias if bias.dtype in (hidden.dtype, torch.float32) else bias.to(hidden.dtype)


def validate_loss_mask(loss_mask, target, hidden, per_token, reduction):
    require_tensor(loss_mask, "loss_mask")
    if not per_token:
        raise ValueError(f"loss_mask: got a tensor with reduction={reduction!r}, expected "
                         "reduction='none' (it weights the per-token losses; a sum or mean "
                         "takes the in-forward backward without one)")
    if loss_mask.shape != target.shape:
        raise ValueError(f"loss_mask: got shape {tuple(loss_mask.shape)}, expected target's "
                         f"shape {tuple(target.shape)}")
    if loss_mask.is_complex():
        raise ValueError(f"loss_mask.dtype: got {loss_mask.dtype}, expected a real dtype "
                         "(bool, integer or floating point)")
    if loss_mask.requires_grad:
        raise ValueError("loss_mask: got a tensor that requires grad, expected a constant (no "
                         "gradient flows to it)")
    require_same_device(loss_mask, "loss_mask", hidden, "hidden")


def _validate_accumulator(acc, weight, hidden):
    require_tensor(acc, "weight_grad_accumulator")
    if acc.dtype != torch.float32 or tuple(acc.shape) != tuple(weight.shape):
        raise ValueError(f"weight_grad_accumulator: got {acc.dtype} {tuple(acc.shape)}, expected "
                         f"torch.float32 {tuple(weight.shape)} (fp32, weight's shape)")
    require_same_device(acc, "weight_grad_accumulator", weight, "weight")
    if acc.requires_grad:
        raise ValueError("weight_grad_accumulator: got a tensor that requires grad, expected a "
                         "gradient buffer (the backward writes into it)")
    if _rows_view(acc) is None:
        raise ValueError(f"weight_grad_accumulator: got strides {acc.stride()}, expected rows of "
                         "unit-stride columns that do not overlap (the backward writes there, "
                         "not into a copy)")
    for other, name in ((weight, "weight"), (hidden, "hidden")):
        if shares_memory(acc, other):
            raise ValueError(f"weight_grad_accumulator: overlaps {name}'s memory, expected "
                             "a separate buffer")


def _resolve_mode(mode: int, reduction: int, needs_grad: bool, dtype: torch.dtype,
                  masked: bool) -> int:
    """backward_mode "auto" (-1): in_forward for sum/mean and for none with a loss_mask
    (masked), recompute for none without one and for fp16 inputs. A call that no gradient will follow (no_grad, or neither hidden nor weight requires
    one) runs the forward alone whatever the mode: in_forward would compute and keep dhidden and
    an fp32 dweight for nothing (3 GEMMs instead of 1).

    fp16: in_forward stores the gradient of a unit upstream gradient in fp16 before the real one
    (a loss scale, 1/N) reaches it, so its small entries flush to zero where recompute, scaling
    first, keeps them (measured: 13-15% error in dhidden at 4096 tokens x V 8192 under any loss
    scale, against torch's 5e-4)."""
    auto = _AUTO_MODE[reduction, dtype, masked]  # the core's rule: in_forward where auto takes it
    if mode == _IN_FORWARD and auto != _IN_FORWARD:
        raise ValueError(
            "backward_mode: got 'in_forward' with reduction='none' and no loss_mask, expected "
            "'recompute' or 'auto' (per-row losses have per-row upstream gradients, known only "
            "in the backward), or a loss_mask the upstream gradient is proportional to"
            if reduction == _NONE else
            f"backward_mode: got 'in_forward' with {dtype} inputs, expected 'recompute' or 'auto' "
            "(the in-forward gradient is stored in fp16 before the upstream gradient scales it, so "
            "the entries a loss scale would keep flush to zero)")
    if mode == -1:
        mode = auto
    return mode if needs_grad else _FORWARD_ONLY


def wants_grad(hidden, weight, bias=None) -> bool:
    """Whether a gradient follows the call (else it runs the forward alone). Under vmap a
    batched tensor does not say whether the tensor under it requires grad."""
    return torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad or
                                        (bias is not None and bias.requires_grad) or
                                        torch._C._are_functorch_transforms_active())


def resolved_mode(mode: int, reduction: int, needs_grad: bool, dtype: torch.dtype, rows: int,
                  masked: bool) -> int:
    """The mode a call runs (_resolve_mode), and recompute where no rows leave anything to
    weight (an empty mask has no address)."""
    mode = _resolve_mode(mode, reduction, needs_grad, dtype, masked)
    return _RECOMPUTE if mode == _IN_FORWARD and reduction == _NONE and rows == 0 else mode


def runs_in_forward(backward_mode: str, hidden, weight, rows: int, masked: bool) -> bool:
    """For a caller that runs the op's TP agreement in its place (the Megatron head), before the
    call: whether linear_cross_entropy(hidden, weight, ..., reduction="none",
    backward_mode=backward_mode) runs the in-forward mode, which takes one collective per token
    chunk and reads the mask (torch.autocast's dtype applied as the op applies it)."""
    mode = resolved_mode(as_choice(backward_mode, "backward_mode", _MODES), _NONE,
                         wants_grad(hidden, weight), autocast_dtype(hidden), rows, masked)
    return mode == _IN_FORWARD


# What "auto" resolves to, asked of the core (fusedloss::resolve_linear_ce_backward) once per
# reduction, dtype and row weights (none with a loss_mask): a plain lookup, which torch.compile
# traces
_AUTO_MODE = {(int(r), dtype, masked): int(_C.resolve_linear_ce_backward(
                  _C.LinearCeBackward.AUTO, r, _DTYPES[dtype], masked and r == _C.Reduction.NONE))
              for r in (_C.Reduction.NONE, _C.Reduction.SUM, _C.Reduction.MEAN)
              for dtype in (torch.float32, torch.float16, torch.bfloat16)
              for masked in (False, True)}


@parsed_once
def _option_args(ignore_index, label_smoothing, smoothing_formula, smoothing_scope, reduction,
                 z_loss, logit_softcap, softcap, workspace_bytes, backward_mode, dhidden_reduction,
                 dweight_accumulation, inplace_backward):
    """Keyword options -> (the plain values the op schema carries, the backward mode (auto
    unresolved), dhidden_reduction, fp32 accumulation, inplace_backward)."""
    opts = _Options(*parse_options(ignore_index, label_smoothing, smoothing_formula,
                                   smoothing_scope, reduction, z_loss),
                    as_softcap(logit_softcap, softcap),
                    as_workspace_bytes(workspace_bytes))
    return (opts, as_choice(backward_mode, "backward_mode", _MODES),
            as_choice(dhidden_reduction, "dhidden_reduction", _DHIDDEN),
            as_choice(dweight_accumulation, "dweight_accumulation", _ACCUMULATION),
            as_bool(inplace_backward, "inplace_backward"))


def _fp32_accumulation(accumulation: int, weight, accumulator) -> bool:
    """Whether the weight gradient sums over token chunks in fp32. "auto": where it lands in
    fp32 anyway (an fp32 weight, under torch.autocast too, whose gradient autograd hands back in
    fp32; a weight_grad_accumulator), else in the weight's dtype: no fp32 [V, H] copy of a 16-bit
    weight's gradient, which measured 2.4x the memory of the weight-dtype sum and 1.1-1.2x its
    time for a smaller gain in accuracy than the final rounding to bf16 costs (bench/NOTES.md)."""
    if accumulation != _ACCUMULATION["auto"]:
        return bool(accumulation)
    return accumulator is not None or getattr(weight, "dtype", None) == torch.float32


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor,
                         bias: Optional[Tensor] = None, *,
                         ignore_index: int = -100, label_smoothing: float = 0.0,
                         smoothing_formula: str = "pytorch", smoothing_scope: str = "global",
                         reduction: str = "mean", z_loss: float = 0.0,
                         logit_softcap: Optional[float] = None,
                         tp_group: Optional["dist.ProcessGroup"] = None,
                         check_shard_agreement: bool = True,
                         workspace_bytes: Optional[int] = None,
                         backward_mode: str = "auto",
                         dhidden_reduction: str = "partial",
                         dweight_accumulation: str = "auto",
                         inplace_backward: bool = True,
                         weight_grad_accumulator: Optional[Tensor] = None,
                         loss_mask: Optional[Tensor] = None,
                         class_weight: Optional[Tensor] = None,
                         softcap: Optional[float] = None, return_z_loss: bool = False,
                         return_token_accuracy: bool = False,
                         return_predicted_tokens: bool = False, use_token_scaling: bool = False):
    """cross_entropy(F.linear(hidden, weight, bias), target) without the [N, V] logits.

    hidden [N, H] or [s, b, H] and weight [V_local, H] (fp32/fp16/bf16, one dtype, any strides);
    target: integer class ids of hidden's shape without H. bias (optional, as F.linear's and
    Liger's): [V_local] of weight's dtype and device (at tp_group size > 1 this rank's shard of
    the [V_global] bias, the weight's rows), any strides (read, never written); it is added to
    the logits before the soft-cap and the loss, and its gradient (the column sums of the
    logits' gradient, summed over the token chunks in fp32 and rounded once to its dtype) is
    computed only when it requires grad. At tp_group size > 1 every rank passes one or none (the
    shard agreement raises on every rank otherwise). The options are those of
    fusedloss.cross_entropy; logit_softcap=c applies c * tanh(z / c) to the logits first
    (Gemma-2; `softcap` is Liger's name for it). Gradients for hidden and weight come back in their dtypes; the weight's
    accumulates over token chunks as dweight_accumulation says. fp32 inputs follow
    torch.backends.cuda.matmul.allow_tf32. Under torch.autocast, the GEMMs run in its dtype as
    F.linear's would (a 16-bit hidden and an fp32 weight, too: the weight is cast inside the op,
    and its gradient comes back in fp32); the loss stays fp32. workspace_bytes bounds the logits chunk buffer and the
    GEMM workspace together (default 256 MiB, of which cuBLASLt takes an eighth, at most 4 MiB).

    backward_mode "auto": "in_forward" for sum/mean (the forward computes the gradients, the
    backward scales them: 3 GEMMs), "recompute" for none and for fp16 inputs (4 GEMMs, any
    upstream gradient; in fp16 a unit gradient would flush what a loss scale keeps, so
    "in_forward" is refused there). A call no gradient follows (no_grad, or no input requiring
    one) runs the forward alone.

    loss_mask (reduction="none"): a tensor of target's shape (any real dtype, no gradient) that
    the caller reduces the per-token loss with, as Megatron's loss_func does: loss = c *
    sum(loss_mask * per_token_loss) for one scalar c (1 / the number of tokens, a loss scale).
    "auto" then takes "in_forward" (3 GEMMs, not 4): the forward computes the gradients of
    sum(loss_mask * loss), and the backward finds c on the device from the upstream gradient,
    which must be c * loss_mask. The returned loss is not masked. An upstream gradient of
    another form has no such c: on CUDA the gradients are NaN and fusedloss.check_device_errors()
    raises (no host sync); on the CPU the backward raises (at TP > 1 with dhidden_reduction
    "all_reduce" or "reduce_scatter", after joining that collective with NaN). Use backward_mode="recompute" for
    any other reduction of the per-token loss. At tp_group size > 1 it must be equal on every
    rank: the agreement compares a checksum of it with the targets' when the in-forward
    backward uses it (recompute, fp16 and no_grad calls do not read it).

    tp_group of size > 1: weight is this rank's vocab shard (rank r holds rows
    [r V_local, (r+1) V_local)), targets are global ids; the per-row stats are merged with an
    all-gather of 16 B/row (per token chunk in_forward, once in recompute) after the shard
    agreement (see fusedloss.cross_entropy). dhidden_reduction: the hidden gradient is this
    rank's partial sum ("partial": Megatron's copy_to_tensor_model_parallel_region all-reduces
    it, its sequence-parallel gather reduce-scatters it), or summed here ("all_reduce"), or
    "reduce_scatter" (sequence parallel): hidden is this rank's slice of the tokens along dim 0
    ([N / tp, H] or [s / tp, b, H], equal on every rank), target (and loss_mask, and the loss of
    reduction "none") cover the tokens of every rank's slice in rank order ([N] or [s, b]); the
    op all-gathers the slices (after an agreement on their shapes) and its backward
    reduce-scatters the hidden gradient back to them. At tp_group size 1 it is "partial".

    dweight_accumulation: how the weight gradient sums over token chunks. "auto" (default): in
    fp32 where the gradient lands in fp32 anyway (an fp32 weight, also under torch.autocast,
    where the op casts it for its GEMMs itself and hands its gradient back in fp32; a
    weight_grad_accumulator), else in the weight's dtype. "weight_dtype": chunk pair by chunk
    pair in the weight's dtype, no fp32 copy of a 16-bit weight's gradient, so the peak is the
    gradients plus the workspace; the gradient carries one rounding per pair of chunks.
    "fp32": as exact as one GEMM over all tokens, for a 16-bit weight too: in_forward keeps an
    fp32 [V, H] between forward and backward, recompute loops over vocabulary blocks outside
    the token chunks (fp32 scratch: [N, H] plus a 128 MiB block).

    inplace_backward (in_forward, gradients kept in the inputs' dtypes): the backward scales the saved gradients where they are and returns them (True by default, as
    every op's rule has it: a backward reuses memory only the op can reach, and overwrites a
    tensor the caller passed only when asked; these are the op's own); a second backward
    through the result (retain_graph) then raises. False keeps them, at the cost of a copy.

    weight_grad_accumulator: an fp32 tensor of weight's shape (Megatron's main_grad under
    gradient-accumulation fusion), or a callable that returns one (or None: then autograd gets
    the gradient) when the backward runs, for a buffer bound late (at tp_group size > 1 with
    check_shard_agreement, the ranks agree on its buffer in the backward: one more 48 B
    all-gather, read on the host). The backward adds the
    weight's gradient to it in fp32, never rounded to the weight's dtype (dweight_accumulation
    is "fp32" then), and autograd gets zeros for the weight (expanded from one element; a leaf
    weight's .grad materialises them). Nothing is added when the weight needs no gradient.
    Eager calls only.

    class_weight: a per-class weight [V_global] (torch's and Liger's `weight` of the
    cross-entropy; any float dtype, no gradient, the same on every rank at TP > 1): row i's loss
    is scaled by class_weight[target_i], and "mean" divides by the sum of those weights over the
    counted rows, as F.cross_entropy(weight=...) does (0 where no row counts). Through the
    row-weighted in-forward backward (3 GEMMs) for "sum" and "mean". Not with a loss_mask.
    With label_smoothing eps, torch's weighted smoothing term too: row i costs
    (1 - eps) w[t] (lse - z_t) + eps / V sum_c w_c (lse - z_c) (smoothing_formula='megatron':
    its label distribution weighted alike), from the op's plain per-token losses (row weights
    (1 - eps) w[t] + eps W / V, W = sum_c w_c) and the term W z_t - z . w, which needs no
    logits: z . w = hidden . (weight^T w) (+ bias . w), a GEMV over the weight in fp32 row
    chunks, and z_t from N rows of the weight; its gradient adds a [V_local, H] and an [N, H]
    term. At TP > 1 one all-reduce of N floats, hidden's gradient as dhidden_reduction says.
    Not with z_loss, a soft cap or a weight_grad_accumulator, nor smoothing_scope='partition'
    at TP > 1.

    return_z_loss, return_token_accuracy, return_predicted_tokens: as fusedloss.cross_entropy's
    (a CrossEntropyOutput). The z-loss comes from the lse the op keeps; the argmax behind the
    other two is the log-prob head's (fusedloss.linear_log_probs with argmax=True, without a
    gradient): one more logits GEMM over the tokens, so a third more time; with a bias, the
    arg-max of the biased logits, torch's addmm over token chunks of at most workspace_bytes of
    logits (at TP > 1 an all-gather of 12 B a token). At tp_group size > 1 the shard agreement checks that every
    rank asks for the arg-max, or none.

    use_token_scaling (Liger's option): each counted token's loss (and z-loss) is multiplied by
    the probability the model gives its target, p = exp(-(loss - z-loss)), taken as a constant
    (no gradient through it), then reduced (mean: over the counted tokens). The factors are
    known only after the forward, so the gradient takes the recompute backward (4 GEMMs). Not
    with label_smoothing (the loss then no longer gives p) or class_weight.

    No host synchronisation at TP=1 on CUDA; an out-of-range target makes its row NaN and is
    raised by fusedloss.check_device_errors().
    """
    if as_bool(use_token_scaling, "use_token_scaling"):
        return _token_scaled(hidden, weight, target, bias, locals())
    want = _wanted(return_z_loss, return_token_accuracy, return_predicted_tokens)
    argmax = want.return_token_accuracy or want.return_predicted_tokens
    if class_weight is not None:
        return _class_weighted(hidden, weight, target, bias, class_weight, loss_mask, tp_group,
                               check_shard_agreement, reduction, label_smoothing,
                               ignore_index=ignore_index, smoothing_formula=smoothing_formula,
                               smoothing_scope=smoothing_scope, z_loss=z_loss,
                               logit_softcap=logit_softcap, softcap=softcap,
                               workspace_bytes=workspace_bytes, **want._asdict(),
                               backward_mode=backward_mode, dhidden_reduction=dhidden_reduction,
                               dweight_accumulation=dweight_accumulation,
                               inplace_backward=inplace_backward,
                               weight_grad_accumulator=weight_grad_accumulator)
    name = group_name(tp_group)
    check, bad_flag = agreement_flag(check_shard_agreement)
    given_hidden = hidden  # what the arg-max's head reads (before autocast and the gather)
    with rank_checks(tp_group if name else None, check, _OP, only_on_error=True,
                     defer_when_compiling=True) as checks:
        if bad_flag is not None:
            raise bad_flag
        opts, mode, dh_red, accumulation, inplace = _option_args(
            ignore_index, label_smoothing, smoothing_formula, smoothing_scope, reduction, z_loss,
            logit_softcap, softcap, workspace_bytes, backward_mode, dhidden_reduction, dweight_accumulation,
            inplace_backward)
        acc32 = _fp32_accumulation(accumulation, weight, weight_grad_accumulator)
        # under torch.autocast the GEMMs run in its dtype, as F.linear's would (an accumulator
        # leaves autograd expanded zeros for the weight, which the cast keeps expanded)
        # An fp32 weight is kept: the op casts it for the GEMMs and returns its gradient in fp32,
        # summed there without a rounding to the autocast dtype (autograd's cast would round it).
        given_weight = weight  # the bias has its dtype, whatever autocast makes of it below
        cast_inside = _casts_weight_inside(hidden, weight)
        if cast_inside:
            (hidden,) = autocast_operands(hidden)
        else:
            hidden, weight = autocast_operands(hidden, weight,
                                               expanded_grads=weight_grad_accumulator is not None)
        # reduce_scatter at TP > 1: hidden is this rank's slice of the tokens
        token_slices = (group_size(tp_group) if name and dh_red == _DHIDDEN["reduce_scatter"]
                        else 1)
        validate_inputs(hidden, weight, target, token_slices, fp32_weight_ok=cast_inside)
        if bias is not None:
            bias = _checked_bias(bias, given_weight, hidden)
        if loss_mask is not None:
            validate_loss_mask(loss_mask, target, hidden, opts.reduction == _NONE, reduction)
        mode = resolved_mode(mode, opts.reduction, wants_grad(hidden, weight, bias), hidden.dtype,
                             target.numel(), loss_mask is not None)
        bias_grad = bias is not None and torch.is_grad_enabled() and bias.requires_grad
        # the row weights of the in-forward gradients, fp32 [N] (copied here, inside the
        # agreement's reach: an allocation that fails on one rank fails on every rank)
        row_weight = (loss_mask.detach().reshape(-1).to(torch.float32).contiguous()
                      if loss_mask is not None and mode == _IN_FORWARD else None)
        tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
        if not torch.compiler.is_compiling():  # traced calls are checked when the op runs
            _options(*opts, _cpp_mode(mode), tf32, 0, 1, 2, 1)
        if weight_grad_accumulator is not None:
            if through_custom_ops():
                raise RuntimeError(f"{_OP}: weight_grad_accumulator is not supported under "
                                   "torch.compile, a FakeTensorMode or torch.func (the backward "
                                   "writes into a tensor the graph or transform does not own); "
                                   "call the op eagerly, or leave it out")
            if not callable(weight_grad_accumulator):
                _validate_accumulator(weight_grad_accumulator, weight, hidden)
            acc32 = True  # the saved unit gradient in fp32 too: no rounding on the way
    if checks.deferred is not None:  # traced: raised on every rank when the graph runs
        return deferred_rejection((hidden, weight, target), reduction, target, name, _OP,
                                  checks.deferred)
    if token_slices > 1:  # (agreed on first: every rank's slice has the same shape)
        hidden_grad = torch.is_grad_enabled() and hidden.requires_grad
        if not hidden_grad:
            dh_red = _DHIDDEN["partial"]  # no hidden gradient: nothing to reduce-scatter
        hidden = gather_token_slices(hidden, name, check, hidden_grad, target.numel(),
                                     weight.size(0), _OP)
    lse = None
    if want.return_z_loss:  # the same op, with the lse it keeps
        loss, lse = _linear_cross_entropy_lse(hidden, weight, target, bias, row_weight, *opts, mode,
                                              tf32, name, check, dh_red, acc32, inplace, bias_grad,
                                              weight_grad_accumulator, argmax)
        lse = lse.detach()
    elif (_EAGER is not None and not name and weight_grad_accumulator is None and bias is None
            and not cast_inside and not through_custom_ops()):
        loss = _EAGER(hidden, weight, target, row_weight, *opts, mode, tf32, acc32, inplace)
    else:
        loss = _linear_cross_entropy(hidden, weight, target, bias, row_weight, *opts, mode, tf32,
                                     name, check, dh_red, acc32, inplace, bias_grad,
                                     weight_grad_accumulator, argmax)
    loss = loss.view(target.shape) if opts.reduction == _NONE else loss
    if not any(want):
        return loss
    if not argmax:
        predicted = None
    elif bias is None:
        predicted = _head_argmax(given_hidden, given_weight, target, opts.ignore_index, tp_group,
                                 check_shard_agreement, dhidden_reduction, workspace_bytes)
    else:  # hidden: every token (gathered where it came in slices), in the GEMMs' dtype
        predicted = _biased_argmax(hidden, weight, bias, name, workspace_bytes)
    return _with_extras(loss, lse, predicted, target, opts, want)


def _head_argmax(hidden, weight, target, ignore_index, tp_group, check, dhidden_reduction,
                 workspace_bytes):
    """[N] arg-max of hidden @ weight^T over the (global) vocabulary: the log-prob head's,
    without a gradient, after the loss (at TP > 1 the loss's agreement checked that every rank
    asks for it)."""
    # the head refuses an ignore_index among the class ids (the loss allows it): those rows are
    # masked by _with_extras anyway, so an id outside the vocabulary stands for it there
    with torch.no_grad():
        return linear_log_probs(
            hidden.detach(), weight.detach(), target, entropy=False, argmax=True,
            ignore_index=ignore_index if ignore_index < 0 else -1, tp_group=tp_group,
            check_shard_agreement=check, dhidden_reduction=dhidden_reduction,
            workspace_bytes=workspace_bytes).argmax.reshape(-1)


def _biased_argmax(hidden, weight, bias, group, workspace_bytes):
    """[N] arg-max of hidden @ weight^T + bias over the (global) vocabulary, rounded as the op's
    logits are (torch's addmm in the GEMMs' dtype), ties to the smallest id: token chunks of at
    most workspace_bytes (default 256 MiB) of logits, no gradient. At TP > 1 each rank's best
    (value, global id) are all-gathered (12 B a token) and the first rank of the largest value
    wins, so every rank gets the same ids (the loss's agreement checked that all ask)."""
    with torch.no_grad():
        h = rows_of(hidden)
        w = weight.detach().to(h.dtype)
        b = bias.detach().to(h.dtype)
        v_local = w.size(0)
        budget = as_workspace_bytes(workspace_bytes) or (256 << 20)
        chunk = max(1, budget // (v_local * h.element_size()))
        best = torch.empty(h.size(0), dtype=torch.float32, device=h.device)
        ids = torch.empty(h.size(0), dtype=torch.int64, device=h.device)
        for r in range(0, h.size(0), chunk):
            z = torch.addmm(b, h[r:r + chunk], w.t()).float()
            best[r:r + chunk], ids[r:r + chunk] = z.max(-1)
        if not group:
            return ids
        g = resolve_group(group)
        rank, world = rank_and_size(g)
        ids += rank * v_local
        all_best = [torch.empty_like(best) for _ in range(world)]
        all_ids = [torch.empty_like(ids) for _ in range(world)]
        dist.all_gather(all_best, best, group=g)
        dist.all_gather(all_ids, ids, group=g)
        winner = torch.stack(all_best).argmax(0)  # the first rank of the largest: the smallest id
        return torch.stack(all_ids).gather(0, winner[None]).squeeze(0)


def _token_scaled(hidden, weight, target, bias, arguments):
    """linear_cross_entropy(**arguments) with Liger's token scaling: the per-token losses
    (reduction 'none', with their z-loss parts) scaled by the detached target probability,
    then reduced as asked."""
    want = _wanted(arguments["return_z_loss"], arguments["return_token_accuracy"],
                   arguments["return_predicted_tokens"])
    as_float(arguments["label_smoothing"], "label_smoothing")
    for name, off in (("label_smoothing", 0.0), ("class_weight", None), ("loss_mask", None)):
        if arguments[name] is not None and arguments[name] != off:
            raise ValueError(f"use_token_scaling: got True with {name}="
                             f"{'a tensor' if isinstance(arguments[name], Tensor) else repr(arguments[name])}, "
                             f"expected {name}={off!r} (the scaling needs the plain loss's "
                             "target probability, and weighs each token itself)")
    if arguments["backward_mode"] == "in_forward":
        raise ValueError("backward_mode: got 'in_forward' with use_token_scaling=True, expected "
                         "'auto' or 'recompute' (the scaling factors exist only after the forward)")
    kind = as_choice(arguments["reduction"], "reduction", {"none": 0, "sum": 1, "mean": 2})
    call = {k: v for k, v in arguments.items() if k not in ("hidden", "weight", "target", "bias")}
    call.update(reduction="none", use_token_scaling=False, return_z_loss=True,
                backward_mode="recompute")
    out = linear_cross_entropy(hidden, weight, target, bias, **call)
    counted = target != as_int(arguments["ignore_index"], "ignore_index")
    p = torch.where(counted, torch.exp(out.z_loss - out.loss.detach()), 0.0)
    scaled = reduced_output(out._replace(loss=out.loss * p, z_loss=out.z_loss * p), counted, kind)
    if not any(want):
        return scaled.loss
    return scaled if want.return_z_loss else scaled._replace(z_loss=None)


def _class_weighted(hidden, weight, target, bias, class_weight, loss_mask, tp_group, check,
                    reduction, label_smoothing, **options):
    """linear_cross_entropy with a per-class weight: the per-token losses weighted by
    class_weight[target], as their row weights for sum and mean (the in-forward backward: 3
    GEMMs), reduced as F.cross_entropy(weight=...) reduces them; with label smoothing, the
    weighted smoothing term from a GEMV over the weight (_head_weighted_sums)."""
    v_local = weight.size(0) if isinstance(weight, Tensor) and weight.dim() == 2 else -1
    dh_reduction = options["dhidden_reduction"]
    per_token, row_weight, kind, weighted = class_weighted(
        lambda **o: linear_cross_entropy(hidden, weight, target, bias, **o), class_weight, target,
        v_local, tp_group, check, reduction, label_smoothing, options["ignore_index"],
        conflicts={"loss_mask": loss_mask}, options=options, row_weights_to_op=True,
        op_name=_OP,
        smoothing_term=lambda *a: _head_weighted_sums(hidden, weight, bias, tp_group,
                                                      dh_reduction, *a))
    return weighted_reduction(per_token, row_weight, kind, target != options["ignore_index"],
                              weighted)


def _head_weighted_sums(hidden, weight, bias, tp_group, dhidden_reduction, t_local, owned, w,
                        weight_sum):
    """Per row W z_t (where this rank holds the target) - z . w of this rank's logits
    z = hidden weight^T (+ bias), without them: z . w = h . (weight^T w) (+ bias . w) and
    z_t = h . weight[t] (+ bias[t]), a GEMV over the weight and a gather of N of its rows. At TP
    > 1 hidden's gradient follows dhidden_reduction as the op's does (this rank's partial sum,
    summed over the group, or summed into each rank's slice of the tokens)."""
    name = group_name(tp_group)
    g = resolve_group(name) if name else None
    if g is not None and dhidden_reduction == "all_reduce":
        hidden = grad_summed_over_group(hidden, g)
    elif g is not None and dhidden_reduction == "reduce_scatter":
        hidden = gathered_rows(hidden, g)
    h = hidden.reshape(-1, hidden.size(-1)).float()
    zw = h @ _WeightedRows.apply(weight, w)
    zt = (h * weight[t_local].float()).sum(-1)
    if bias is not None:
        zw = zw + bias.float() @ w
        zt = zt + bias[t_local].float()
    return torch.where(owned, weight_sum * zt, 0.0) - zw


class _WeightedRows(torch.autograd.Function):
    """weight^T w [H] of weight [V, H] (any float dtype) and fp32 w [V], summed in fp32 over
    row chunks of at most 64 MiB of fp32 rows (no fp32 copy of the whole weight); the backward
    writes weight's gradient, w outer the upstream [H], once in weight's dtype."""

    @staticmethod
    def forward(ctx, weight, w):
        ctx.save_for_backward(w)
        ctx.dtype = weight.dtype
        u = torch.zeros(weight.size(1), dtype=torch.float32, device=weight.device)
        for r, n in _row_chunks(weight.size(0), weight.size(1)):
            u += w[r:r + n] @ weight[r:r + n].float()
        return u

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        out = torch.empty(w.size(0), grad.size(0), dtype=ctx.dtype, device=grad.device)
        for r, n in _row_chunks(out.size(0), out.size(1)):
            out[r:r + n] = torch.outer(w[r:r + n], grad)
        return out, None
