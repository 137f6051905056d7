"""fusedloss.jax.linear_log_probs: per-token log-probabilities at a temperature, entropy and
arg-max from hidden states and the LM head's weight, without the [tokens, V] logits: the head RL
post-training runs for the policy and the reference model, as fusedloss.linear_log_probs
computes it (the same C++ core: include/fusedloss/linear_log_probs.h).

A jax.custom_vjp over XLA FFI calls. The forward runs one GEMM a token chunk and keeps lse and
entropy (8 B a token); the backward recomputes each chunk's logits for the upstream gradients of
log_probs and entropy together (4 GEMMs in all). A call that is not differentiated runs the
forward alone.

Vocab-parallel (axis_name, inside jax.shard_map): the weight is this device's shard of the
vocabulary; this shard's per-token statistics (24 B: max, sum-exp, the entropy's sum, the
token's logit, the arg-max), an all_gather over the axis, the merge: every device gets the same
results. The backward gives this shard's dweight and its partial dhidden, which JAX sums over
the axis (as the linear cross-entropy's, _vocab_parallel.py), or reduce-scatters with
sequence_parallel (the op all-gathers the token slices: the transpose of that all_gather is a
psum_scatter).
"""
from functools import partial
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi
from ._args import (allows_tf32, as_bool, as_float, as_int, index, require_array,
                    validate_head_operands)
from ._vocab_parallel import (all_gather_invariant, axis_place, axis_size, local_targets,
                              replicated_cotangent, shard_options)

_F32 = jnp.float32


class LogProbs(NamedTuple):
    """The head's results per token, in tokens' shape: log_probs and entropy fp32 (0 where the
    token is ignore_index or masked), argmax int32 global ids (ties: the smallest id), or None
    where not asked for."""
    log_probs: jax.Array
    entropy: Optional[jax.Array]
    argmax: Optional[jax.Array]


class LpOptions(NamedTuple):
    temperature: float
    ignore_index: int
    workspace_bytes: int  # 0: the core's default
    tf32: bool

    def attributes(self, vocab_global: int = -1) -> dict:
        return dict(temperature=self.temperature, ignore_index=self.ignore_index,
                    workspace_bytes=self.workspace_bytes, allow_tf32=self.tf32,
                    vocab_global=vocab_global)


def _results(n):
    """log_probs, entropy, lse [n] fp32 and the arg-max [n, 2]: each id an int64 in two int32
    words, low word first (XLA without x64 has no int64 array; vocabularies fit the low word)."""
    return [((n,), _F32)] * 3 + [((n, 2), jnp.int32)]


def _forward(o: LpOptions, h, w, t):
    lp, ent, lse, am = _ffi.call("lp_forward", _results(h.shape[0]), h, w, t, **o.attributes())
    return lp, ent, lse, am[:, 0]


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _log_probs(o, h, w, t):
    lp, ent, _, am = _forward(o, h, w, t)
    return lp, ent, am


def _log_probs_fwd(o, h, w, t):
    lp, ent, lse, am = _forward(o, h, w, t)
    return (lp, ent, am), (h, w, t, lse, ent)


def _log_probs_bwd(o, saved, grads):
    h, w, t, lse, ent = saved
    g_lp, g_ent, _ = grads  # the arg-max has no gradient
    dh, dw = _ffi.call("lp_backward", [(h.shape, h.dtype), (w.shape, w.dtype)], h, w, t, lse, ent,
                       g_lp.astype(_F32), g_ent.astype(_F32), **o.attributes())
    return dh, dw, None


_log_probs.defvjp(_log_probs_fwd, _log_probs_bwd)


# ---- vocab-parallel: w is this device's shard of the vocabulary along axis_name ----

def _sharded_fwd(o: LpOptions, axis_name, h, w, t):
    rank, parts = axis_place(axis_name)
    rows, vocab_local = h.shape[0], w.shape[0]
    vocab_global = parts * vocab_local
    tl, shard = local_targets(t, o, rank, vocab_local, vocab_global)
    (stats,) = _ffi.call("lp_local_stats", [((rows, 6), jnp.int32)], h, w, tl,
                         **shard.attributes(vocab_global))
    # the shard's arg-max (words 4-5: an int64, low word first) as a global id; a row with no
    # finite logit keeps the core's "none" (its high word set)
    offset = (rank * vocab_local).astype(jnp.int32)
    stats = stats.at[:, 4].set(jnp.where(stats[:, 5] == 0, stats[:, 4] + offset, stats[:, 4]))
    gathered = all_gather_invariant(stats, axis_name)  # [parts, N, 6]
    lp, ent, lse, am = _ffi.call("lp_merge", _results(rows), gathered, t,
                                 **o.attributes(vocab_global))
    return (lp, ent, am[:, 0]), (h, w, tl, lse, ent)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sharded_log_probs(o, axis_name, h, w, t):
    return _sharded_fwd(o, axis_name, h, w, t)[0]


def _sharded_bwd(o, axis_name, saved, grads):
    h, w, tl, lse, ent = saved
    g_lp, g_ent = (replicated_cotangent(g.astype(_F32), w, axis_name) for g in grads[:2])
    vocab_global = axis_size(axis_name) * w.shape[0]
    shard = shard_options(o, vocab_global)
    # dhidden: this shard's partial sum, summed over the axis by JAX
    dh, dw = _ffi.call("lp_backward", [(h.shape, h.dtype), (w.shape, w.dtype)], h, w, tl, lse, ent,
                       g_lp, g_ent, **shard.attributes(vocab_global))
    return dh, dw, None


_sharded_log_probs.defvjp(_sharded_fwd, _sharded_bwd)


def _validate(hidden, weight, tokens, loss_mask, slices: int):
    """The operands, with fusedloss.linear_log_probs' messages; slices > 1: hidden is this
    device's slice of the tokens along dim 0 (sequence_parallel) and tokens cover every slice."""
    validate_head_operands(hidden, weight)
    require_array(tokens, "tokens")
    shape = tuple(hidden.shape[:-1])
    what = "hidden's shape without the hidden dim"
    if slices > 1:
        shape = (shape[0] * slices, *shape[1:])
        what = f"the tokens of {slices} ranks' slices of hidden along dim 0"
    if tuple(tokens.shape) != shape:
        raise ValueError(f"tokens: got shape {tuple(tokens.shape)}, expected {shape} ({what})")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens.dtype: got {np.dtype(tokens.dtype).name}, expected an integer "
                         "dtype")
    if loss_mask is not None:
        require_array(loss_mask, "loss_mask")
        if tuple(loss_mask.shape) != shape:
            raise ValueError(f"loss_mask: got shape {tuple(loss_mask.shape)}, expected tokens' "
                             f"shape {shape}")
        if jnp.issubdtype(loss_mask.dtype, jnp.complexfloating):
            raise ValueError(f"loss_mask.dtype: got {np.dtype(loss_mask.dtype).name}, expected a "
                             "real dtype (bool, integer or floating point)")


def linear_log_probs(hidden, weight, tokens, *, temperature: float = 1.0, entropy: bool = True,
                     argmax: bool = False, loss_mask=None, ignore_index: int = -100,
                     workspace_bytes=None, axis_name=None,
                     sequence_parallel: bool = False) -> LogProbs:
    """log softmax(hidden @ weight.T / temperature) at each token, its entropy and arg-max,
    without the [N, V] logits, as fusedloss.linear_log_probs computes them.

    hidden [N, H] or [s, b, H] and weight [V, H] (float32/float16/bfloat16, one dtype); tokens:
    integer ids of hidden's shape without H. Tokens equal to ignore_index, or where loss_mask is
    zero (prompt tokens, padding), give log_prob = entropy = 0 and no gradient. Gradients flow
    from log_probs and entropy together (jax.grad of any function of both); the arg-max has
    none. workspace_bytes bounds the logits chunk buffer and the GEMM workspace together
    (default 256 MiB). An out-of-range token raises at the call on the CPU; on CUDA its row is
    NaN and fusedloss.jax.check_device_errors() names it.

    axis_name (inside jax.shard_map): weight is this device's contiguous shard of the vocabulary
    along that mesh axis (device r of P holds rows [r V_local, (r+1) V_local)); tokens are global
    ids and hidden holds every token, the same on every device; or with sequence_parallel=True,
    this device's slice of the tokens along dim 0 (tokens, loss_mask and the results cover every
    device's slice in axis order: PyTorch's dhidden_reduction='reduce_scatter'): the op
    all-gathers the slices, and their gradient comes back reduce-scattered. The results are the
    same on every device.
    """
    temperature = as_float(temperature, "temperature")
    want_entropy, want_argmax = as_bool(entropy, "entropy"), as_bool(argmax, "argmax")
    ignore_index = as_int(ignore_index, "ignore_index")
    workspace = 0 if workspace_bytes is None else as_int(workspace_bytes, "workspace_bytes")
    if workspace_bytes is not None and workspace <= 0:
        raise ValueError(f"workspace_bytes: got {workspace}, expected None or a positive number "
                         "of bytes")
    sequence_parallel = as_bool(sequence_parallel, "sequence_parallel")
    if sequence_parallel and axis_name is None:
        raise ValueError("sequence_parallel: got True without axis_name, expected the mesh axis "
                         "the token slices and the vocabulary are split over")
    _validate(hidden, weight, tokens, loss_mask, axis_size(axis_name) if sequence_parallel else 1)
    h = hidden.reshape(-1, hidden.shape[-1])
    if sequence_parallel:  # its transpose reduce-scatters the slices' gradient
        h = jax.lax.all_gather(h, axis_name, tiled=True)
    _ffi.validate_linear_log_probs(temperature, workspace, h.shape[0], weight.shape[0], h.shape[1])
    t = index(tokens)
    if loss_mask is not None:  # a masked token is an ignored one (the kernels skip its row)
        t = jnp.where(loss_mask.reshape(-1) != 0, t, jnp.asarray(ignore_index, t.dtype))
    o = LpOptions(temperature, ignore_index, workspace, allows_tf32())
    if axis_name is None:
        lp, ent, am = _log_probs(o, h, weight, t)
    else:
        if axis_name in _ffi.varying_axes(weight):  # (check_vma: shard_map's types)
            # varying over the axis like the weight shard: the transpose of that cast sums the
            # partial dhidden of every shard (nothing to do for gathered slices, which vary)
            h = _ffi.varying(h, (axis_name,))
        lp, ent, am = _sharded_log_probs(o, axis_name, h, weight, t)
    shape = tokens.shape
    return LogProbs(lp.reshape(shape), ent.reshape(shape) if want_entropy else None,
                    am.reshape(shape) if want_argmax else None)
