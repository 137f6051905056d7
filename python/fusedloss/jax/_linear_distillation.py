"""fusedloss.jax.linear_distillation_loss: a distillation loss between a student's and a
teacher's next-token distributions from each model's last hidden states and LM-head weight,
without the [tokens, V] logits of either, as fusedloss.linear_distillation_loss computes it (the
same C++ core: include/fusedloss/linear_distillation.h).

A jax.custom_vjp over XLA FFI calls, in one of two backward modes (as the PyTorch op's):
  in_forward  a mean or a sum (not fp16, one device): when differentiated, the forward also runs
              the student's gradient GEMMs (4 GEMMs in all) and keeps the gradients, which the
              backward scales by the loss's cotangent.
  recompute   reduction 'none', fp16, vocab-parallel, or asked for: the forward gives per-token
              losses and keeps 32 B a token, the backward recomputes both models' logits a chunk
              at a time for the per-token upstream gradients (6 GEMMs); the reduction is jnp's.
The teacher gets no gradient (a zero cotangent).

Vocab-parallel (axis_name, inside jax.shard_map): both weights are this device's shard of the
vocabulary; each device computes its shard's partial statistics (32 B a token), an all_gather
over the axis and the merge give every device the same losses; jsd adds a second pass over
the logits and a psum of 8 B a token. The backward is local: each shard's dweight and its
partial dhidden, which JAX sums over the axis.
"""
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._args import check_distillation_shapes
from . import _ffi
from ._args import allows_tf32, as_float, as_int, index, require_array, validate_head_operands
from ._vocab_parallel import (all_gather_invariant, axis_place, axis_size, local_targets,
                              replicated_cotangent, shard_options)

_F32 = jnp.float32
_DIVERGENCE = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}
_REDUCTIONS = ("mean", "sum", "none")
_MODES = ("auto", "in_forward", "recompute")


class DistillOptions(NamedTuple):
    divergence: int
    beta: float
    temperature: float
    hard_label_weight: float
    ignore_index: int
    workspace_bytes: int  # 0: the core's default
    tf32: bool
    has_target: bool

    def attributes(self, vocab_global: int = -1) -> dict:
        return dict(divergence=self.divergence, beta=self.beta, temperature=self.temperature,
                    hard_label_weight=self.hard_label_weight, ignore_index=self.ignore_index,
                    workspace_bytes=self.workspace_bytes, allow_tf32=self.tf32,
                    has_target=self.has_target, vocab_global=vocab_global)


def _forward(o, sh, sw, th, tw, t):
    n = sh.shape[0]
    return _ffi.call("distill_forward", [((n,), _F32), ((n, 8), jnp.int32)], sh, sw, th, tw, t,
                     **o.attributes())


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _losses(o, sh, sw, th, tw, t):
    return _forward(o, sh, sw, th, tw, t)[0]


def _losses_fwd(o, sh, sw, th, tw, t):
    loss, stats = _forward(o, sh, sw, th, tw, t)
    return loss, (sh, sw, th, tw, t, stats)


def _losses_bwd(o, saved, g):
    sh, sw, th, tw, t, stats = saved
    dh, dw = _ffi.call("distill_backward", [(sh.shape, sh.dtype), (sw.shape, sw.dtype)],
                       sh, sw, th, tw, t, stats, g.astype(_F32), **o.attributes())
    return dh, dw, jnp.zeros_like(th), jnp.zeros_like(tw), None


_losses.defvjp(_losses_fwd, _losses_bwd)


# ---- in_forward: the mean or sum, its gradients computed by the forward ----

def _row_gradients(o, t, rows, mean: bool):
    """(each row's upstream gradient of the reduced loss [N], the mean's divisor)."""
    counted = jnp.ones((rows,), bool) if not o.has_target else t != o.ignore_index
    count = jnp.maximum(counted.sum(), 1).astype(_F32)
    g = jnp.where(counted, 1.0 / count if mean else 1.0, 0.0).astype(_F32)
    return g, count


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _reduced(o, mean, sh, sw, th, tw, t):
    loss = _forward(o, sh, sw, th, tw, t)[0]
    return loss.sum() / _row_gradients(o, t, sh.shape[0], mean)[1] if mean else loss.sum()


def _reduced_fwd(o, mean, sh, sw, th, tw, t):
    g, count = _row_gradients(o, t, sh.shape[0], mean)
    loss, _, dh, dw = _ffi.call(
        "distill_forward", [((sh.shape[0],), _F32), ((sh.shape[0], 8), jnp.int32),
                            (sh.shape, sh.dtype), (sw.shape, sw.dtype)],
        sh, sw, th, tw, t, g, **o.attributes())
    total = loss.sum() / count if mean else loss.sum()
    return total, (dh, dw, th, tw)


def _reduced_bwd(o, mean, saved, g):
    dh, dw, th, tw = saved
    return ((dh * g).astype(dh.dtype), (dw * g).astype(dw.dtype), jnp.zeros_like(th),
            jnp.zeros_like(tw), None)


_reduced.defvjp(_reduced_fwd, _reduced_bwd)


# ---- vocab-parallel: both weights are this device's shard of the vocabulary along axis_name ----

def _sharded_fwd(o: DistillOptions, axis_name, sh, sw, th, tw, t):
    rank, parts = axis_place(axis_name)
    rows, vocab_local = sh.shape[0], sw.shape[0]
    vocab_global = parts * vocab_local
    tl, shard = local_targets(t, o, rank, vocab_local, vocab_global)
    (partials,) = _ffi.call("distill_local_partials", [((rows, 8), jnp.int32)], sh, sw, th, tw,
                            tl, **shard.attributes(vocab_global))
    gathered = all_gather_invariant(partials, axis_name)  # [parts, N, 8]
    loss, stats = _ffi.call("distill_merge", [((rows,), _F32), ((rows, 8), jnp.int32)], gathered,
                            t, **o.attributes(vocab_global))
    if o.divergence == _DIVERGENCE["jsd"]:  # the soft term needs the merged lse: a second pass
        (sums,) = _ffi.call("distill_jsd_sums", [((rows, 2), _F32)], sh, sw, th, tw, tl, stats,
                            **shard.attributes(vocab_global))
        sums = jax.lax.psum(sums, axis_name)
        counted = jnp.ones((rows,), bool) if not o.has_target else t != o.ignore_index
        soft = jnp.where(counted[:, None], sums, 0.0)
        loss = loss + (1.0 - o.hard_label_weight) * soft[:, 0]
        words = jax.lax.bitcast_convert_type(soft, jnp.int32)  # stats' words 6-7: the two sums
        stats = stats.at[:, 6:8].set(words)
    return loss, (sh, sw, th, tw, tl, stats)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sharded_losses(o, axis_name, sh, sw, th, tw, t):
    return _sharded_fwd(o, axis_name, sh, sw, th, tw, t)[0]


def _sharded_bwd(o, axis_name, saved, g):
    sh, sw, th, tw, tl, stats = saved
    g = replicated_cotangent(g.astype(_F32), sw, axis_name)
    vocab_global = axis_size(axis_name) * sw.shape[0]
    shard = shard_options(o, vocab_global)
    # dhidden: this shard's partial sum, summed over the axis by JAX
    dh, dw = _ffi.call("distill_backward", [(sh.shape, sh.dtype), (sw.shape, sw.dtype)],
                       sh, sw, th, tw, tl, stats, g, **shard.attributes(vocab_global))
    return dh, dw, jnp.zeros_like(th), jnp.zeros_like(tw), None


_sharded_losses.defvjp(_sharded_fwd, _sharded_bwd)


def linear_distillation_loss(student_hidden, student_weight, teacher_hidden, teacher_weight,
                             target=None, *, divergence: str = "forward_kl", beta: float = 0.5,
                             temperature: float = 1.0, ignore_index: int = -100,
                             hard_label_weight: float = 0.0, reduction: str = "mean",
                             workspace_bytes=None, axis_name=None, backward_mode: str = "auto"):
    """fusedloss.linear_distillation_loss for JAX: with s = the student's logits / temperature,
    t = the teacher's, q = softmax(s), p = softmax(t), per token KL(p || q) ("forward_kl"),
    KL(q || p) ("reverse_kl") or beta KL(p || m) + (1 - beta) KL(q || m), m = beta p +
    (1 - beta) q ("jsd"); with target and hard_label_weight w, (1 - w) times that plus w times
    the cross-entropy of the student's logits at the target. Tokens whose target is
    ignore_index count for nothing; reduction "mean" (over the counted tokens), "sum" or "none".

    student_hidden [N, H_s] or [s, b, H_s] with student_weight [V, H_s] (one float dtype);
    teacher_hidden [..., H_t] with teacher_weight [V, H_t] (one float dtype of their own).
    Gradients flow to the student's hidden states and weight; the teacher's are zero. A CPU
    target outside [0, V) that is not ignore_index raises at the call; on CUDA a hard-label row
    with one is NaN and fusedloss.jax.check_device_errors() names it.

    axis_name (inside jax.shard_map): both weights are this device's contiguous shard of the
    vocabulary along that mesh axis (device r of P holds rows [r V_local, (r+1) V_local));
    targets are global ids, and the hidden states hold every token, the same on every device.
    The losses are the same on every device.

    backward_mode: "auto" (in_forward for a mean or a sum without axis_name and for fp32 / bf16
    students, else recompute), "in_forward" or "recompute" (see the module).
    """
    if not isinstance(divergence, str) or divergence not in _DIVERGENCE:
        raise ValueError(f"divergence: got {divergence!r}, expected one of {sorted(_DIVERGENCE)}")
    if not isinstance(reduction, str) or reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: got {reduction!r}, expected one of {sorted(_REDUCTIONS)}")
    if not isinstance(backward_mode, str) or backward_mode not in _MODES:
        raise ValueError(f"backward_mode: got {backward_mode!r}, expected one of {sorted(_MODES)}")
    if backward_mode == "in_forward" and getattr(student_hidden, "dtype", None) == jnp.float16:
        raise ValueError("backward_mode: got 'in_forward' with float16 students, expected "
                         "'recompute' or 'auto' (the kept fp16 gradients of the unit upstream "
                         "gradient would flush where a loss scale keeps them)")
    if backward_mode == "in_forward" and (reduction == "none" or axis_name is not None):
        raise ValueError("backward_mode: got 'in_forward' with "
                         + ("reduction='none'" if reduction == "none" else "axis_name")
                         + ", expected 'recompute' or 'auto' (the per-token losses' upstream "
                         "gradients are known only at the backward; vocab-parallel recomputes)")
    beta, temperature = as_float(beta, "beta"), as_float(temperature, "temperature")
    hard = as_float(hard_label_weight, "hard_label_weight")
    ignore_index = as_int(ignore_index, "ignore_index")
    workspace = 0 if workspace_bytes is None else as_int(workspace_bytes, "workspace_bytes")
    if workspace_bytes is not None and workspace <= 0:
        raise ValueError(f"workspace_bytes: got {workspace}, expected None or a positive number "
                         "of bytes")
    validate_head_operands(student_hidden, student_weight, ("student_hidden", "student_weight"))
    validate_head_operands(teacher_hidden, teacher_weight, ("teacher_hidden", "teacher_weight"))
    if target is not None:
        require_array(target, "target")
    shape = check_distillation_shapes(student_hidden, student_weight, teacher_hidden,
                                      teacher_weight, target)
    if target is not None and not jnp.issubdtype(target.dtype, jnp.integer):
        raise ValueError(f"target.dtype: got {np.dtype(target.dtype).name}, expected an integer "
                         "dtype")
    sh = student_hidden.reshape(-1, student_hidden.shape[-1])
    th = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
    rows = sh.shape[0]
    vocab = student_weight.shape[0] * (1 if axis_name is None else axis_size(axis_name))
    _ffi.validate_linear_distillation(_DIVERGENCE[divergence], beta, temperature, hard,
                                      ignore_index, workspace, rows, vocab, target is not None)
    t = index(target) if target is not None else jnp.zeros((rows,), jnp.int32)
    o = DistillOptions(_DIVERGENCE[divergence], beta, temperature, hard, ignore_index, workspace,
                       allows_tf32(), target is not None)
    th, tw = jax.lax.stop_gradient(th), jax.lax.stop_gradient(teacher_weight)
    in_forward = backward_mode == "in_forward" or (
        backward_mode == "auto" and reduction != "none" and axis_name is None
        and student_hidden.dtype != jnp.float16)
    if in_forward:
        return _reduced(o, reduction == "mean", sh, student_weight, th, tw, t)
    if axis_name is None:
        losses = _losses(o, sh, student_weight, th, tw, t)
    else:
        if axis_name in _ffi.varying_axes(student_weight):  # (check_vma: shard_map's types)
            # varying over the axis like the weight shard: the transpose of that cast sums the
            # partial dhidden of every shard
            sh = _ffi.varying(sh, (axis_name,))
        losses = _sharded_losses(o, axis_name, sh, student_weight, th, tw, t)
    if reduction == "none":
        return losses.reshape(shape)
    total = losses.sum()
    if reduction == "sum":
        return total
    counted = rows if target is None else (t != ignore_index).sum()
    return total / jnp.maximum(counted, 1)
