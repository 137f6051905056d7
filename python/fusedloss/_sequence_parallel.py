"""Sequence parallelism for an op over hidden states: each rank of the TP group holds a slice of
the tokens along dim 0 (Megatron's sequence-parallel layout, [s/tp, b, H]), and the op works on
all of them. The slices are all-gathered in the forward; in the backward the op sums its hidden
gradient (a partial sum on each rank) over the group into each rank's own rows (a
reduce-scatter), and the gather's backward takes those rows.

The reduce-scatter runs inside the op's backward, not the gather's: every rank that runs the op's
backward takes part in it, whichever gradients autograd was asked for (the gather's node is
skipped when only the weight's is), and a rank whose backward fails joins it there (with NaN)
instead of leaving the others waiting. So the gather's backward is not an adjoint for any other
consumer of the gathered tensor: only the op may consume it.

The gather is a custom op (the group travels as its name), so torch.compile traces it as it
traces the op, and it runs the shard agreement on the slices' shapes first: a rank with another
slice would otherwise pair an all-gather of another size with the others'."""
from typing import Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ._distributed import fingerprint, rank_checks, resolve_group


def gathered_shape(shape, world: int) -> Tuple[int, ...]:
    """The shape of every rank's slices of `shape` together (dim 0 times the group's size)."""
    return (world * shape[0], *shape[1:])


@torch.library.custom_op("fusedloss::gather_token_slices", mutates_args=())
def gather_token_slices(hidden: Tensor, group: str, check: bool, grad: bool, rows: int,
                        v_local: int, op: str) -> Tensor:
    """Every rank's slice of the tokens, in rank order along dim 0 (group: a name from
    group_name(), of size > 1), for an op whose backward calls sum_into_own_rows on its hidden
    gradient. check: the shard agreement on the slices first, with the op's rows (every
    slice's tokens) and V_local, which also reports a rank whose own arguments the op refused;
    without it the caller guarantees equal slices on every rank. grad: whether a gradient for
    hidden follows (compared too: only those ranks take part in the op's reduce-scatter)."""
    g = resolve_group(group)
    world = dist.get_world_size(g)
    # the op's rows and V_local, as its own agreement would compare them first
    options = fingerprint(dhidden_reduction="reduce_scatter", hidden_slice_shape=tuple(hidden.shape),
                          dtype=str(hidden.dtype), hidden_requires_grad=grad)
    with rank_checks(g, check, op, rows=rows, v_local=v_local, options=options):
        out = hidden.new_empty(gathered_shape(hidden.shape, world))
        mine = hidden.contiguous()
    dist.all_gather_into_tensor(out, mine, group=g)
    return out


@gather_token_slices.register_fake
def _gather_fake(hidden, group, check, grad, rows, v_local, op):
    return hidden.new_empty(gathered_shape(hidden.shape, dist.get_world_size(resolve_group(group))))


def _setup(ctx, inputs, output):
    g = resolve_group(inputs[1])
    ctx.rank, ctx.world = dist.get_rank(g), dist.get_world_size(g)


def _gather_backward(ctx, grad):
    # this rank's rows, which the op's backward summed over the group (sum_into_own_rows); a
    # copy, so that the slice's gradient does not hold the whole [world * n, ...] buffer
    n = grad.size(0) // ctx.world
    return (grad.narrow(0, ctx.rank * n, n).clone(),) + (None,) * 6


gather_token_slices.register_autograd(_gather_backward, setup_context=_setup)


def own_rows_buffer(grad: Tensor, group) -> Tensor:
    """What sum_into_own_rows receives into: [n, ...] beside grad [world * n, ...]. Allocated
    before the backward's kernels, where a failure still joins the collective."""
    return grad.new_empty((grad.size(0) // dist.get_world_size(group), *grad.shape[1:]))


def sum_into_own_rows(grad: Tensor, group, own_rows: Tensor) -> None:
    """grad [world * n, ...] (contiguous), this rank's partial sums: its own rows [rank n,
    (rank + 1) n) become their sums over the group (a reduce-scatter into own_rows, from
    own_rows_buffer, then copied there); the other rows are left as they are (the gather's
    backward reads only these)."""
    rank = dist.get_rank(group)
    n = own_rows.size(0)
    dist.reduce_scatter_tensor(own_rows, grad, group=group)
    grad.narrow(0, rank * n, n).copy_(own_rows)
