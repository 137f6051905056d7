"""Vocab-parallel under jax.shard_map: the core's split passes with JAX's own collective between
them, as the C++ hook runs them (include/fusedloss/cross_entropy.h):

    local stats   this device's shard: per row max, sum-exp, target logit, sum (16 B/row)
    all_gather    the stats of every shard over the mesh axis (XLA's collective: NCCL on GPUs)
    merge         loss, lse and the valid count, the same bits on every device

The shard's place on the axis (jax.lax.axis_index) is a traced value, and the handlers' options
are static attributes. So the handlers see every shard as the vocabulary's first: its targets
renumbered (local_targets), the core's vocab_start 0 and vocab_global the whole vocabulary.
"""
import inspect

import jax
import jax.numpy as jnp

from . import _ffi
from ._args import SCOPES, CeOptions, loss_results


def all_gather_invariant(x, axis_name):
    """all_gather whose result shard_map's type system (check_vma) knows is the same on every
    device, so that the merged loss is too (out_specs=P()); older JAX has no such form."""
    if "to" in inspect.signature(jax.lax.all_gather).parameters:
        for to in ("invarying", "invariant"):  # (its name has changed between releases)
            try:
                return jax.lax.all_gather(x, axis_name, to=to)
            except ValueError:
                pass
    if hasattr(jax.lax, "all_gather_invariant"):
        return jax.lax.all_gather_invariant(x, axis_name)
    return jax.lax.all_gather(x, axis_name)


def replicated_cotangent(g, shard, axis_name):
    """The cotangent of the merged loss, summed over the axis where shard_map hands each device
    its part of it: without check_vma (the shard then carries no varying type) shard_map splits a
    replicated output's cotangent over the devices, for the transpose of a psum to add it up
    again; here the collective is the op's own all_gather, so the op adds it up itself."""
    if axis_name in _ffi.varying_axes(shard):
        return g
    return jax.lax.psum(g, axis_name)


def axis_size(axis_name) -> int:
    """The mesh axis' size, static (older JAX: psum of a constant, which it folds)."""
    if hasattr(jax.lax, "axis_size"):
        return jax.lax.axis_size(axis_name)
    return jax.lax.psum(1, axis_name)


def axis_place(axis_name):
    """(this device's index on the axis, traced; the axis size, static)."""
    return jax.lax.axis_index(axis_name), axis_size(axis_name)


def shard_options(o: CeOptions, vocab_global: int) -> CeOptions:
    """The options a shard's handlers read its renumbered targets with: the ignore value is
    ignore_index where no column can take it, else -1."""
    return o._replace(ignore_index=o.ignore_index if not 0 <= o.ignore_index < vocab_global else -1)


def local_targets(t, o: CeOptions, rank, vocab_local: int, vocab_global: int):
    """(t as this shard's handlers read it, shard_options). A target in this shard becomes its
    column; one in another shard a valid column outside [0, vocab_local) (vocab_local itself:
    vocab_global > vocab_local on more than one shard); an ignored row the ignore value; an
    out-of-range target stays out of range (the core flags it as it would at TP=1; an
    out-of-range -1 where -1 is the ignore value becomes vocab_global)."""
    shard = shard_options(o, vocab_global)
    ignore = shard.ignore_index
    start = rank * vocab_local
    ignored = t == o.ignore_index
    valid = (t >= 0) & (t < vocab_global)
    local = valid & (t >= start) & (t < start + vocab_local)
    bad = jnp.where(t == ignore, vocab_global, t)
    renumbered = jnp.where(ignored, ignore, jnp.where(
        local, t - start, jnp.where(valid, vocab_local, bad)))
    return renumbered.astype(t.dtype), shard


def merge(stats, t, o: CeOptions, axis_name, vocab_local: int, vocab_global: int, rows: int):
    """All-gather this shard's stats [N, 4] over the axis and merge them: (loss, lse, count)."""
    gathered = all_gather_invariant(stats, axis_name)  # [parts, N, 4]
    # `local` is read for the partition scope alone (its loss is per shard by definition)
    local = stats if o.scope == SCOPES["partition"] else gathered[0]
    return _ffi.call("ce_merge", loss_results(rows, o.reduction), gathered, local, t,
                     vocab_local=vocab_local, **o.attributes(vocab_global))


def sharded_argmax(x, axis_name):
    """The arg-max over the whole vocabulary of x [N, V_local], this device's shard: each
    shard's best value and its global id, one all_gather, the first shard holding the best
    (shards are in id order, so a tie gives the smallest id)."""
    rank, _ = axis_place(axis_name)
    best = jnp.max(x, -1)
    ids = jnp.argmax(x, -1).astype(jnp.int32) + (rank * x.shape[-1]).astype(jnp.int32)
    values = all_gather_invariant(best, axis_name)  # [parts, N]
    owner = jnp.argmax(values, 0)
    return jnp.take_along_axis(all_gather_invariant(ids, axis_name), owner[None], 0)[0]
