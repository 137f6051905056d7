"""fusedloss.jax.linear_cross_entropy: the LM head's projection and the cross-entropy in one
jax.custom_vjp over XLA FFI calls, without a [tokens, V] logits buffer (the core computes the
logits one token chunk at a time in a bounded workspace: include/fusedloss/linear_cross_entropy.h).

backward modes (both exact), as the PyTorch op's:
  in_forward  reduction sum/mean (not fp16): the forward also computes the gradients for an
              upstream gradient of 1 (3 GEMMs in all); the backward scales them. Kept between
              them: dhidden [N, H] and dweight [V, H], in the inputs' dtype.
  recompute   reduction none, fp16, or asked for: the forward keeps lse (4 B/row); the backward
              recomputes each chunk's logits (4 GEMMs in all).
A call that is not differentiated runs the forward alone (1 GEMM).

Vocab-parallel (axis_name, inside jax.shard_map): the weight is this device's shard of the
vocabulary; this shard's per-row stats (one GEMM per chunk), an all_gather of 16 B/row, the
merge; the recompute backward gives this shard's dweight and its partial dhidden, which JAX sums
over the axis (hidden enters the op as varying over the axis: the transpose of that cast is a
psum), or reduce-scatters with sequence_parallel (the op all-gathers the token slices: the
transpose of that all_gather is a psum_scatter).
"""
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi
from ._args import (DTYPES, NONE, CeOptions, allows_tf32, as_bool, as_choice, as_int, as_float,
                    index, loss_results, parse_ce_options, require_array, require_targets,
                    validate_head_operands)
from ._class_weight import check_class_weight, weighted
from ._cross_entropy import Extras, with_extras
from ._linear_log_probs import linear_log_probs
from ._vocab_parallel import axis_place, axis_size, local_targets, merge, replicated_cotangent, shard_options

_F32 = jnp.float32
# fusedloss::LinearCeBackward
_AUTO, _IN_FORWARD, _RECOMPUTE = 0, 1, 2
_MODES = {"auto": _AUTO, "in_forward": _IN_FORWARD, "recompute": _RECOMPUTE}
# How the weight gradient sums over token chunks (the PyTorch op's dweight_accumulation)
_ACCUMULATION = {"auto": -1, "weight_dtype": 0, "fp32": 1}


class LceOptions(NamedTuple):
    ce: CeOptions
    softcap: float
    workspace_bytes: int  # 0: the core's default
    tf32: bool
    mode: int  # what a differentiated call runs: _IN_FORWARD or _RECOMPUTE
    fp32_dweight: bool  # the weight gradient sums over token chunks in fp32
    weight_dtype: np.dtype  # its gradient's (an fp32 in-forward sum is rounded to it once)
    vocab_block: int  # > 0: the recompute backward's fp32 blocks of a 16-bit dweight

    def attributes(self, mode: int, vocab_global: int = -1) -> dict:
        return dict(self.ce.attributes(vocab_global), logit_softcap=self.softcap,
                    workspace_bytes=self.workspace_bytes, allow_tf32=self.tf32, backward_mode=mode,
                    vocab_block=self.vocab_block if mode == _RECOMPUTE else 0)


def _grads_like(h, w):
    return [(h.shape, h.dtype), (w.shape, w.dtype)]


def _kept_like(o: LceOptions, h, w):
    """The in-forward gradients' buffers: dweight fp32 where it sums in fp32 (rounded once, in
    the backward), else in the weight's dtype."""
    return [(h.shape, h.dtype), (w.shape, _F32 if o.fp32_dweight else w.dtype)]


def _scaled(unit_grad, g, dtype):
    """A gradient kept for an upstream gradient of 1, for the upstream gradient g (a scalar)."""
    return (unit_grad.astype(_F32) * g.astype(_F32)).astype(dtype)


def _recompute_backward(o: LceOptions, h, w, t, lse, count, g, vocab_global=-1):
    return _ffi.call("lce_backward", _grads_like(h, w), h, w, t, lse, g.astype(_F32), count,
                     **o.attributes(_RECOMPUTE, vocab_global))


# ---- one device holds the whole vocabulary ----

def _forward(o: LceOptions, h, w, t, m, mode: int):
    """m: the loss_mask's row weights [N] fp32 (reduction 'none'), read by in_forward alone."""
    in_forward = mode == _IN_FORWARD
    kept = _kept_like(o, h, w) if in_forward else [((0,), _F32), ((0,), _F32)]
    weighted = in_forward and m is not None
    return _ffi.call("lce_forward", loss_results(h.shape[0], o.ce.reduction) + kept, h, w, t,
                     *((m,) if weighted else ()), has_row_weight=weighted, **o.attributes(mode))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _linear_cross_entropy(o, h, w, t, m):
    return _forward(o, h, w, t, m, _RECOMPUTE)[:2]  # not differentiated: the forward alone


def _linear_cross_entropy_fwd(o, h, w, t, m):
    loss, lse, count, dh, dw = _forward(o, h, w, t, m, o.mode)
    if o.mode != _IN_FORWARD:
        return (loss, lse), (h, w, t, lse, count)
    # with a loss_mask the backward finds the upstream gradient's c (= c * m) in the core
    return (loss, lse), ((dh, dw) if m is None else (h, w, t, m, dh, dw))


def _linear_cross_entropy_bwd(o, saved, grads):
    g = grads[0]  # lse is returned for the z-loss apart: detached
    if o.mode == _IN_FORWARD and len(saved) == 2:
        dh, dw = saved
        return _scaled(dh, g, dh.dtype), _scaled(dw, g, o.weight_dtype), None, None
    if o.mode == _IN_FORWARD:
        h, w, t, m, dh, dw = saved
        return (*_ffi.call("lce_scale_rows", _grads_like(h, w), h, w, t, dh, dw, m,
                           g.astype(_F32), **o.attributes(_IN_FORWARD)), None, None)
    h, w, t, lse, count = saved
    return (*_recompute_backward(o, h, w, t, lse, count, g), None, None)


_linear_cross_entropy.defvjp(_linear_cross_entropy_fwd, _linear_cross_entropy_bwd)


# ---- vocab-parallel: w is this device's shard of the vocabulary along axis_name ----

def _sharded_forward(o: LceOptions, axis_name, h, w, t):
    rank, parts = axis_place(axis_name)
    rows, vocab_local = h.shape[0], w.shape[0]
    vocab_global = parts * vocab_local
    tl, shard = local_targets(t, o.ce, rank, vocab_local, vocab_global)
    (stats,) = _ffi.call("lce_local_stats", [((rows, 4), _F32)], h, w, tl,
                         **o._replace(ce=shard).attributes(_RECOMPUTE, vocab_global))
    loss, lse, count = merge(stats, t, o.ce, axis_name, vocab_local, vocab_global, rows)
    return (loss, lse), (h, w, tl, lse, count)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sharded_linear_cross_entropy(o, axis_name, h, w, t):
    return _sharded_forward(o, axis_name, h, w, t)[0]


def _sharded_linear_cross_entropy_bwd(o, axis_name, saved, grads):
    g = grads[0]  # lse: detached
    h, w, tl, lse, count = saved
    g = replicated_cotangent(g, w, axis_name)
    vocab_global = axis_size(axis_name) * w.shape[0]
    shard = o._replace(ce=shard_options(o.ce, vocab_global))
    # dhidden: this shard's partial sum, summed over the axis by JAX (see the module's note)
    return (*_recompute_backward(shard, h, w, tl, lse, count, g, vocab_global), None)


_sharded_linear_cross_entropy.defvjp(_sharded_forward, _sharded_linear_cross_entropy_bwd)


# ---- the op ----

def _validate(hidden, weight, target, token_slices: int):
    validate_head_operands(hidden, weight)
    require_array(target, "target")
    if token_slices == 1:
        require_targets(target, hidden, "hidden's shape without the hidden dim")
    else:
        shape = (hidden.shape[0] * token_slices, *hidden.shape[1:-1])
        require_targets(target, hidden, f"the tokens of {token_slices} devices' slices of hidden "
                        "along dim 0, without the hidden dim: sequence_parallel=True", shape=shape)


def _mode(mode: int, reduction: int, dtype, masked: bool) -> int:
    """backward_mode "auto": in_forward for sum/mean and for none with a loss_mask (masked),
    recompute for none without one and for fp16 inputs (the core's rule); an explicit
    in_forward where auto would not take it is refused."""
    auto = _ffi.resolve_linear_ce_backward(_AUTO, reduction, DTYPES[np.dtype(dtype)], masked)
    if mode == _IN_FORWARD and auto != _IN_FORWARD:
        raise ValueError(
            "backward_mode: got 'in_forward' with reduction='none' and no loss_mask, expected "
            "'recompute' or 'auto' (per-row losses have per-row upstream gradients, known only "
            "in the backward), or a loss_mask the upstream gradient is proportional to"
            if reduction == NONE else
            f"backward_mode: got 'in_forward' with {np.dtype(dtype).name} inputs, expected "
            "'recompute' or 'auto' (the in-forward gradient is stored in fp16 before the upstream "
            "gradient scales it, so the entries a loss scale would keep flush to zero)")
    return auto if mode == _AUTO else mode


def _options(ce, softcap, workspace, mode, weight, accumulation) -> LceOptions:
    """The handlers' options; the weight gradient's sum in fp32 where asked, or ('auto') where it
    is fp32 anyway (a float32 weight: JAX has no fp32 accumulator beside a 16-bit weight)."""
    dtype = np.dtype(weight.dtype)
    fp32 = bool(accumulation) if accumulation != _ACCUMULATION["auto"] else dtype == np.float32
    block = _ffi.backward_vocab_block(_RECOMPUTE, fp32, DTYPES[dtype], weight.shape[1])
    return LceOptions(ce, softcap, workspace, allows_tf32(), mode, fp32, dtype, block)


def linear_cross_entropy(hidden, weight, target, *, ignore_index: int = -100,
                         label_smoothing: float = 0.0, smoothing_formula: str = "pytorch",
                         smoothing_scope: str = "global", reduction: str = "mean",
                         z_loss: float = 0.0, logit_softcap=None, workspace_bytes=None,
                         backward_mode: str = "auto", dweight_accumulation: str = "auto",
                         loss_mask=None, class_weight=None, return_z_loss: bool = False,
                         return_token_accuracy: bool = False,
                         return_predicted_tokens: bool = False, axis_name=None,
                         sequence_parallel: bool = False):
    """cross_entropy(hidden @ weight.T, target) without the [N, V] logits, as
    fusedloss.linear_cross_entropy computes it (the same C++ core).

    hidden [N, H] or [s, b, H] and weight [V_local, H] (float32/float16/bfloat16, one dtype);
    target: integer class ids of hidden's shape without H. The options are those of
    fusedloss.jax.cross_entropy; logit_softcap=c applies c * tanh(z / c) to the logits first
    (Gemma-2). workspace_bytes bounds the logits chunk buffer and the GEMM workspace together
    (default 256 MiB). float32 inputs may use TF32 GEMMs on GPUs unless
    jax.default_matmul_precision is 'highest' / 'float32'. backward_mode: 'auto' (in_forward for
    sum/mean, recompute for none and float16), 'in_forward' or 'recompute' (see the module).

    dweight_accumulation: how the weight gradient sums over token chunks, as the PyTorch op's.
    'auto': in fp32 for a float32 weight, else in the weight's dtype. 'weight_dtype': chunk pair
    by chunk pair in the weight's dtype (no fp32 [V, H] copy). 'fp32': as exact as one GEMM over
    all tokens, for a 16-bit weight too: in_forward keeps an fp32 [V, H] between forward and
    backward (rounded once there); recompute loops over vocabulary blocks outside the token
    chunks (fp32 scratch: [N, H] plus a 128 MiB block).

    loss_mask (reduction='none'): an array of target's shape (any real dtype, no gradient) the
    caller reduces the per-token loss with, loss = c * sum(loss_mask * loss) for one scalar c
    (Megatron's loss_func). 'auto' then takes in_forward (3 GEMMs, not 4): the forward computes
    the gradients of sum(loss_mask * loss), and the backward finds c from the upstream gradient,
    which must be c * loss_mask (on the CPU another one raises at the call; on CUDA its
    gradients are NaN and fusedloss.jax.check_device_errors() raises). The returned loss is not
    masked. backward_mode='recompute' (and float16, and axis_name) takes any upstream gradient
    and does not read the mask.

    axis_name (inside jax.shard_map): weight is this device's contiguous shard of the
    vocabulary along that mesh axis (device r of P holds rows [r V_local, (r+1) V_local));
    targets are global ids. The backward is recompute there. hidden holds every token, the same
    on every device; or with sequence_parallel=True, this device's slice of the tokens along
    dim 0 (target, and the loss of reduction 'none', cover every device's slice in axis order):
    the op all-gathers the slices, and their gradient comes back reduce-scattered.

    return_z_loss, return_token_accuracy, return_predicted_tokens: a CrossEntropyOutput, as
    fusedloss.jax.cross_entropy's. The arg-max behind the last two is the log-prob head's
    (fusedloss.jax.linear_log_probs with argmax=True, no gradient): one more logits GEMM over the
    tokens; vocab- and sequence-parallel as the loss.

    class_weight: a per-class weight [V], as torch.nn.functional.cross_entropy's weight (with
    label smoothing too: torch's weighted smoothing term, from a GEMV over the weight, no
    logits), not with axis_name.
    """
    want = Extras.of(return_z_loss, return_token_accuracy, return_predicted_tokens)
    if class_weight is not None:
        if loss_mask is not None:
            raise ValueError("loss_mask: got an array with class_weight, expected None (a class "
                             "weight weighs the rows itself: scale them with reduction='none')")
        if want.z_loss:
            raise ValueError("class_weight: got an array with return_z_loss=True, expected "
                             "return_z_loss=False (not returned apart with a class weight)")
        loss = _class_weighted(hidden, weight, target, class_weight, axis_name, sequence_parallel,
                               dict(ignore_index=ignore_index, label_smoothing=label_smoothing,
                                    smoothing_formula=smoothing_formula,
                                    smoothing_scope=smoothing_scope, reduction=reduction,
                                    z_loss=z_loss, logit_softcap=logit_softcap,
                                    workspace_bytes=workspace_bytes, backward_mode=backward_mode,
                                    dweight_accumulation=dweight_accumulation))
        ce = parse_ce_options(ignore_index, label_smoothing, smoothing_formula, smoothing_scope,
                              reduction, z_loss)
        return with_extras(loss, None, target, ce, want, lambda: _head_argmax(
            hidden, weight, target, ignore_index, workspace_bytes, None, False))
    ce = parse_ce_options(ignore_index, label_smoothing, smoothing_formula, smoothing_scope,
                          reduction, z_loss)
    softcap = 0.0 if logit_softcap is None else as_float(logit_softcap, "logit_softcap")
    workspace = 0 if workspace_bytes is None else as_int(workspace_bytes, "workspace_bytes")
    if workspace_bytes is not None and workspace <= 0:
        raise ValueError(f"workspace_bytes: got {workspace}, expected None or a positive number "
                         "of bytes")
    mode = as_choice(backward_mode, "backward_mode", _MODES)
    accumulation = as_choice(dweight_accumulation, "dweight_accumulation", _ACCUMULATION)
    sequence_parallel = as_bool(sequence_parallel, "sequence_parallel")
    if sequence_parallel and axis_name is None:
        raise ValueError("sequence_parallel: got True without axis_name, expected the mesh axis "
                         "the token slices and the vocabulary are split over")
    slices = axis_size(axis_name) if sequence_parallel else 1
    _validate(hidden, weight, target, slices)
    h = hidden.reshape(-1, hidden.shape[-1])
    if sequence_parallel:  # its transpose reduce-scatters the slices' gradient
        h = jax.lax.all_gather(h, axis_name, tiled=True)
    if axis_name is not None:
        mode = _RECOMPUTE if mode == _AUTO else mode
        if mode == _IN_FORWARD:
            raise ValueError("backward_mode: got 'in_forward' with axis_name, expected 'recompute' "
                             "or 'auto' (the in-forward gradients need the merged statistics of "
                             "every chunk inside the GEMM loop, where XLA runs no collective)")
    m = None if loss_mask is None else _row_weights(loss_mask, target, reduction)
    mode = _mode(mode, ce.reduction, hidden.dtype, m is not None and axis_name is None)
    _ffi.validate_linear_cross_entropy(ce, softcap, workspace, mode, h.shape[0], weight.shape[0],
                                       h.shape[1])
    o = _options(ce, softcap, workspace, mode, weight, accumulation)
    t = index(target)
    if axis_name is None:
        loss, lse = _linear_cross_entropy(o, h, weight, t, m)
    else:
        if axis_name in _ffi.varying_axes(weight):  # (check_vma: shard_map's types)
            # varying over the axis like the weight shard: the transpose of that cast sums the
            # partial dhidden of every shard (nothing to do for gathered slices, which vary)
            h = _ffi.varying(h, (axis_name,))
        loss, lse = _sharded_linear_cross_entropy(o, axis_name, h, weight, t)
    return with_extras(loss, lse, target, ce, want, lambda: _head_argmax(
        hidden, weight, target, ignore_index, workspace_bytes, axis_name, sequence_parallel))


def _head_argmax(hidden, weight, target, ignore_index, workspace_bytes, axis_name,
                 sequence_parallel):
    """Each row's arg-max of the logits [rows]: the log-prob head's (one more logits GEMM), no
    gradient; the soft cap, monotonic, keeps it."""
    return linear_log_probs(jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(weight), target,
                            entropy=False, argmax=True, ignore_index=ignore_index,
                            workspace_bytes=workspace_bytes, axis_name=axis_name,
                            sequence_parallel=sequence_parallel).argmax.reshape(-1)


def _row_weights(loss_mask, target, reduction):
    """The loss_mask as the in-forward backward's row weights: flat fp32, no gradient; checked
    with the PyTorch op's messages."""
    require_array(loss_mask, "loss_mask")
    if reduction != "none":
        raise ValueError(f"loss_mask: got an array with reduction={reduction!r}, expected "
                         "reduction='none' (it weights the per-token losses; a sum or mean "
                         "takes the in-forward backward without one)")
    if tuple(loss_mask.shape) != tuple(target.shape):
        raise ValueError(f"loss_mask: got shape {tuple(loss_mask.shape)}, expected target's "
                         f"shape {tuple(target.shape)}")
    if jnp.issubdtype(loss_mask.dtype, jnp.complexfloating):
        raise ValueError(f"loss_mask.dtype: got {np.dtype(loss_mask.dtype).name}, expected a real "
                         "dtype (bool, integer or floating point)")
    return jax.lax.stop_gradient(loss_mask.reshape(-1).astype(_F32))


def _class_weighted(hidden, weight, target, class_weight, axis_name, sequence_parallel, kw):
    _validate(hidden, weight, target, 1)
    eps = as_float(kw["label_smoothing"], "label_smoothing")
    check_class_weight(class_weight, "class_weight", weight.shape[0], axis_name, eps,
                       kw["smoothing_formula"], as_float(kw["z_loss"], "z_loss"),
                       kw["logit_softcap"])
    nll = linear_cross_entropy(hidden, weight, target, **dict(kw, reduction="none",
                                                              label_smoothing=0.0))
    h = hidden.reshape(-1, hidden.shape[-1]).astype(_F32)

    def z_terms(safe):  # z_t = h . weight[t] and z . w = h . (weight^T w), without the logits
        z_t = (h * weight[safe].astype(_F32)).sum(-1)
        u = jnp.matmul(class_weight.astype(weight.dtype), weight,  # (no fp32 copy of weight)
                       preferred_element_type=_F32)
        return z_t, h @ u
    ignore = as_int(kw["ignore_index"], "ignore_index")
    return weighted(nll, class_weight, target, ignore, kw["reduction"], eps, z_terms)
