"""fusedloss.jax.cross_entropy: the core's cross-entropy as a jax.custom_vjp over XLA FFI calls.

forward  one pass over the logits (online softmax) -> per-row loss and lse (4 B/row kept);
         vocab-parallel (axis_name): this device's shard's stats, an all_gather of 16 B/row over
         the mesh axis, the merge
backward one pass that reads the logits and writes the gradient, into the logits' buffer where
         XLA lets it (an input-output alias: XLA copies the logits first if anything else still
         reads them)
"""
from functools import partial
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from . import _ffi
from ._args import (NONE, REDUCTIONS, CeOptions, as_bool, as_float, index, loss_results,
                    parse_ce_options, require_targets, require_values)
from ._class_weight import check_class_weight, weighted
from ._vocab_parallel import (axis_place, axis_size, local_targets, merge, replicated_cotangent,
                              shard_options, sharded_argmax)

_F32 = jnp.float32


def _attrs(o: CeOptions, softcap: float, vocab_global: int = -1) -> dict:
    """The handlers' attributes: the options and the soft cap (0: none) of the logits."""
    return dict(o.attributes(vocab_global), logit_softcap=softcap)


def _backward(o: CeOptions, softcap, x, t, lse, count, g, vocab_global=-1):
    (dx,) = _ffi.call("ce_backward", [(x.shape, x.dtype)], x, t, lse, g.astype(_F32), count,
                      aliases={0: 0}, **_attrs(o, softcap, vocab_global))
    return dx


# ---- one device holds the whole vocabulary ----

def _forward(o: CeOptions, softcap, x, t):
    return _ffi.call("ce_forward", loss_results(x.shape[0], o.reduction), x, t,
                     **_attrs(o, softcap))


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _cross_entropy(o, softcap, x, t):
    return _forward(o, softcap, x, t)[:2]


def _cross_entropy_fwd(o, softcap, x, t):
    loss, lse, count = _forward(o, softcap, x, t)
    return (loss, lse), (x, t, lse, count)


def _cross_entropy_bwd(o, softcap, saved, grads):
    g = grads[0]  # lse is returned for the z-loss apart: detached
    x, t, lse, count = saved
    return _backward(o, softcap, x, t, lse, count, g), None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


# ---- vocab-parallel: x is this device's shard of the vocabulary along axis_name ----

def _sharded_forward(o: CeOptions, softcap, axis_name, x, t):
    rank, parts = axis_place(axis_name)
    rows, vocab_local = x.shape
    vocab_global = parts * vocab_local
    tl, ol = local_targets(t, o, rank, vocab_local, vocab_global)
    (stats,) = _ffi.call("ce_local_stats", [((rows, 4), _F32)], x, tl,
                         **_attrs(ol, softcap, vocab_global))
    loss, lse, count = merge(stats, t, o, axis_name, vocab_local, vocab_global, rows)
    return (loss, lse), (x, tl, lse, count)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _sharded_cross_entropy(o, softcap, axis_name, x, t):
    return _sharded_forward(o, softcap, axis_name, x, t)[0]


def _sharded_cross_entropy_bwd(o, softcap, axis_name, saved, grads):
    g = grads[0]  # lse: detached
    x, tl, lse, count = saved
    g = replicated_cotangent(g, x, axis_name)
    vocab_global = axis_size(axis_name) * x.shape[1]
    # each shard's gradient is its own: nothing is communicated in the backward
    return _backward(shard_options(o, vocab_global), softcap, x, tl, lse, count, g,
                     vocab_global), None


_sharded_cross_entropy.defvjp(_sharded_forward, _sharded_cross_entropy_bwd)


def _validate(logits, target):
    require_values(logits, "logits")
    if logits.ndim not in (2, 3) or logits.shape[-1] == 0:
        raise ValueError(f"logits: got shape {tuple(logits.shape)}, expected a 2-D [N, V] or 3-D "
                         "[s, b, V] tensor with V >= 1")
    require_targets(target, logits, "the logits' shape without the vocab dim")


def cross_entropy(logits, target, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                  smoothing_formula: str = "pytorch", smoothing_scope: str = "global",
                  reduction: str = "mean", z_loss: float = 0.0, logit_softcap=None,
                  weight=None, return_z_loss: bool = False, return_token_accuracy: bool = False,
                  return_predicted_tokens: bool = False, axis_name=None):
    """Cross-entropy of logits [N, V] or [s, b, V] (float32/float16/bfloat16) against integer
    targets of the logits' shape without V, as fusedloss.cross_entropy computes it (the same C++
    core): no [N, V] softmax, the loss in float32 for every input dtype, and a 'mean' over no
    counted row is 0 with zero gradients (where a plain log-softmax gives NaN). `z_loss` adds
    z * lse^2 per row; `smoothing_formula='megatron'` and `smoothing_scope='partition'` are
    Megatron's label smoothing; logit_softcap=c applies c * tanh(z / c) to the logits first
    (Gemma 2), inside the same passes. A differentiable function of the logits: jax.jit, jax.grad,
    jax.vmap (each batch element is its own problem: a 'mean' per element).

    axis_name (inside jax.shard_map): the logits are this device's contiguous shard of the
    vocabulary along that mesh axis (device r of P holds [r V_local, (r+1) V_local)); targets are
    global ids, the same on every device. The per-row statistics are merged with one
    jax.lax.all_gather of 16 B/row, and every device gets the same loss (a per-device loss with
    smoothing_scope='partition'); the gradient of each shard stays on its device.

    return_z_loss, return_token_accuracy, return_predicted_tokens (Liger's options): a
    CrossEntropyOutput(loss, z_loss, token_accuracy, predicted_tokens) instead of the loss, with
    the fields asked for (see there); the arg-max under axis_name is the whole vocabulary's (each
    shard's best, one all_gather). With a class weight the accuracy is unweighted, as the
    PyTorch op's.

    weight: a per-class weight [V], as torch.nn.functional.cross_entropy's (with label smoothing
    too: torch's weighted smoothing term, one more read of the logits), not with axis_name.

    A target outside [0, V) that is not ignore_index is an error of the call (on the CPU; on
    CUDA its row's loss is NaN and fusedloss.jax.check_device_errors() raises).
    """
    want = Extras.of(return_z_loss, return_token_accuracy, return_predicted_tokens)
    if weight is not None:
        if want.z_loss:
            raise ValueError("weight: got an array with return_z_loss=True, expected "
                             "return_z_loss=False (not returned apart with a class weight)")
        loss = _class_weighted(logits, target, weight, ignore_index, label_smoothing,
                               smoothing_formula, smoothing_scope, reduction, z_loss,
                               logit_softcap, axis_name)
        o = parse_ce_options(ignore_index, label_smoothing, smoothing_formula, smoothing_scope,
                             reduction, z_loss)
        x = logits.reshape(-1, logits.shape[-1])
        return with_extras(loss, None, target, o, want, lambda: _argmax(x, None))
    o = parse_ce_options(ignore_index, label_smoothing, smoothing_formula, smoothing_scope,
                         reduction, z_loss)
    softcap = 0.0 if logit_softcap is None else as_float(logit_softcap, "logit_softcap")
    if not softcap >= 0.0:  # (NaN too)
        raise ValueError(f"logit_softcap: got {logit_softcap!r}, expected None (off) or a "
                         "finite value > 0")
    _validate(logits, target)
    x = logits.reshape(-1, logits.shape[-1])
    _ffi.validate_cross_entropy(o, x.shape[0], x.shape[1])
    t = index(target)
    if axis_name is None:
        loss, lse = _cross_entropy(o, softcap, x, t)
    else:
        loss, lse = _sharded_cross_entropy(o, softcap, axis_name, x, t)
    return with_extras(loss, lse, target, o, want, lambda: _argmax(x, axis_name))


def _argmax(x, axis_name):
    """Each row's arg-max of the logits x [N, V_local] (the soft cap, monotonic, keeps it), the
    whole vocabulary's under axis_name; no gradient."""
    x = jax.lax.stop_gradient(x)
    return jnp.argmax(x, -1) if axis_name is None else sharded_argmax(x, axis_name)


class CrossEntropyOutput(NamedTuple):
    """What cross_entropy() and linear_cross_entropy() return when a return_* option asks for
    more than the loss (Liger's fields, as fusedloss.CrossEntropyOutput's; those not asked for
    are None). All but the loss are detached (for logging).

    loss              the loss, as without the options (it includes the z-loss)
    z_loss            z_loss * lse^2 of the counted rows, reduced as the loss (per row for
                      reduction='none', 0 on ignored rows)
    token_accuracy    whether argmax == target: per row (0.0 on ignored rows) for 'none', else
                      the fraction over the counted rows (0 where none counts)
    predicted_tokens  the arg-max of each row's logits in target's shape (the smallest id of a
                      tie; -1 on ignored rows), whatever the reduction
    """
    loss: jax.Array
    z_loss: Optional[jax.Array] = None
    token_accuracy: Optional[jax.Array] = None
    predicted_tokens: Optional[jax.Array] = None


class Extras(NamedTuple):
    """The return_* options asked for."""
    z_loss: bool
    token_accuracy: bool
    predicted_tokens: bool

    @staticmethod
    def of(return_z_loss, return_token_accuracy, return_predicted_tokens) -> "Extras":
        return Extras(as_bool(return_z_loss, "return_z_loss"),
                      as_bool(return_token_accuracy, "return_token_accuracy"),
                      as_bool(return_predicted_tokens, "return_predicted_tokens"))

    @property
    def argmax(self) -> bool:
        return self.token_accuracy or self.predicted_tokens


def _reduced(part, counted, target, reduction: int):
    """A per-row extra reduced as the loss: per row in target's shape ('none'), summed, or the
    mean over the counted rows (0 over none, as the loss)."""
    if reduction == NONE:
        return part.reshape(target.shape)
    if reduction == REDUCTIONS["sum"]:
        return part.sum()
    n = counted.sum()
    return jnp.where(n > 0, part.sum() / jnp.maximum(n, 1), 0.0)


def with_extras(loss, lse, target, o: CeOptions, want: Extras, argmax):
    """The loss in target's shape (reduction 'none'), with the extras asked for; argmax: a
    callable giving each row's arg-max [rows], called only where one is asked for."""
    loss = loss.reshape(target.shape) if o.reduction == NONE else loss
    if not any(want):
        return loss
    t = target.reshape(-1)
    counted = t != o.ignore_index
    z = acc = tokens = None
    if want.z_loss:
        part = jnp.where(counted, o.z_loss * jax.lax.stop_gradient(lse) ** 2, 0.0)
        z = _reduced(part, counted, target, o.reduction)
    if want.argmax:
        predicted = argmax().astype(jax.dtypes.canonicalize_dtype(jnp.int64))
        if want.token_accuracy:
            hits = (counted & (predicted == t)).astype(jnp.float32)
            acc = _reduced(hits, counted, target, o.reduction)
        if want.predicted_tokens:
            tokens = jnp.where(counted, predicted, -1).reshape(target.shape)
    return CrossEntropyOutput(loss, z, acc, tokens)


def _class_weighted(logits, target, weight, ignore_index, label_smoothing, smoothing_formula,
                    smoothing_scope, reduction, z_loss, logit_softcap, axis_name):
    o = parse_ce_options(ignore_index, label_smoothing, smoothing_formula, smoothing_scope,
                         reduction, z_loss)
    _validate(logits, target)
    check_class_weight(weight, "weight", logits.shape[-1], axis_name, o.label_smoothing,
                       smoothing_formula, o.z_loss, logit_softcap)
    nll = cross_entropy(logits, target, ignore_index=ignore_index, smoothing_formula=smoothing_formula,
                        smoothing_scope=smoothing_scope, reduction="none", z_loss=z_loss,
                        logit_softcap=logit_softcap)
    x = logits.reshape(-1, logits.shape[-1]).astype(_F32)

    def z_terms(safe):
        return jnp.take_along_axis(x, safe[:, None], -1)[:, 0], x @ weight.astype(_F32)
    return weighted(nll, weight, target, o.ignore_index, reduction, o.label_smoothing, z_terms)
