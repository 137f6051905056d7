"""The backward passes are kernels, not differentiable torch ops. Under create_graph=True the
gradients they return would otherwise act as constants, so a second-order gradient through
them would be silently wrong; instead they carry a node that raises if anything differentiates
through them (using their values stays free)."""
import functools

import torch
from torch import Tensor


class _NoSecondOrder(torch.autograd.Function):
    @staticmethod
    def forward(ctx, grad, op):
        ctx.op = op
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, _):
        raise RuntimeError(f"{ctx.op}: differentiating its gradient (a double backward, e.g. "
                           "through create_graph=True) is not supported; its backward is a fused "
                           "kernel, not a differentiable op")


def first_order_only(op: str):
    """Decorates an autograd.Function.backward whose computation is not differentiable."""
    def wrap(backward):
        @functools.wraps(backward)
        def run(ctx, *grads):
            if not torch.is_grad_enabled():  # a plain backward: nothing to guard
                return backward(ctx, *grads)
            with torch.no_grad():
                outs = backward(ctx, *grads)
            return tuple(_guard(o, op) if isinstance(o, Tensor) else o for o in outs)
        return run
    return wrap


def _guard(grad, op):
    if not grad.requires_grad:
        grad = grad.detach().requires_grad_()
    return _NoSecondOrder.apply(grad, op)
