"""Sequence parallelism for an op over hidden states: each rank of the TP group holds a slice of
the tokens along dim 0 (Megatron's sequence-parallel layout, [s/tp, b, H]), and the op works on
all of them. The slices are all-gathered in the forward; the hidden gradient, a partial sum on
each rank, is reduce-scattered back to the slices in the backward (summed over the ranks, each
keeping its own).

Both collectives are custom ops (the group travels as its name), so torch.compile traces them as
it traces the op itself, and the gather runs the shard agreement on the slices' shapes first: a
rank with another slice would otherwise pair an all-gather of another size with the others'."""
from typing import Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ._distributed import fingerprint, rank_checks, resolve_group


def gathered_shape(shape, world: int) -> Tuple[int, ...]:
    """The shape of every rank's slices of `shape` together (dim 0 times the group's size)."""
    return (world * shape[0], *shape[1:])


@torch.library.custom_op("fusedloss::gather_token_slices", mutates_args=())
def _gather(hidden: Tensor, group: str, check: bool, grad: bool, rows: int, v_local: int,
            op: str) -> Tensor:
    g = resolve_group(group)
    world = dist.get_world_size(g)
    # the op's rows and V_local, as its own agreement would compare them first; grad (whether
    # the slice requires one) too: only ranks with a hidden gradient take part in the backward's
    # reduce-scatter
    options = fingerprint(dhidden_reduction="reduce_scatter", hidden_slice_shape=tuple(hidden.shape),
                          dtype=str(hidden.dtype), hidden_requires_grad=grad)
    with rank_checks(g, check, op, rows=rows, v_local=v_local, options=options):
        out = hidden.new_empty(gathered_shape(hidden.shape, world))
        mine = hidden.contiguous()
    dist.all_gather_into_tensor(out, mine, group=g)
    return out


@_gather.register_fake
def _gather_fake(hidden, group, check, grad, rows, v_local, op):
    return hidden.new_empty(gathered_shape(hidden.shape, dist.get_world_size(resolve_group(group))))


@torch.library.custom_op("fusedloss::reduce_scatter_token_slices", mutates_args=())
def reduce_scatter(grad: Tensor, group: str) -> Tensor:
    """grad [world * n, ...] summed over the group's ranks; this rank's slice [n, ...] of it."""
    g = resolve_group(group)
    out = grad.new_empty((grad.size(0) // dist.get_world_size(g), *grad.shape[1:]))
    dist.reduce_scatter_tensor(out, grad.contiguous(), group=g)
    return out


@reduce_scatter.register_fake
def _reduce_scatter_fake(grad, group):
    world = dist.get_world_size(resolve_group(group))
    return grad.new_empty((grad.size(0) // world, *grad.shape[1:]))


def _setup(ctx, inputs, output):
    ctx.group = inputs[1]


def _gather_backward(ctx, grad):
    return (reduce_scatter(grad, ctx.group),) + (None,) * 6


_gather.register_autograd(_gather_backward, setup_context=_setup)


def gather_token_slices(hidden: Tensor, group: str, check: bool, rows: int, v_local: int,
                        op: str) -> Tensor:
    """Every rank's slice of the tokens, in rank order along dim 0 (group: a name from
    group_name(), of size > 1). check: the shard agreement on the slices first, with the op's
    rows (every slice's tokens) and V_local, which also reports a rank whose own arguments the
    op refused; without it the caller guarantees equal slices on every rank."""
    grad = torch.is_grad_enabled() and hidden.requires_grad
    return _gather(hidden, group, check, grad, rows, v_local, op)
