"""One scaffold for every fused op: torch custom ops (forward, backward) with fake
implementations, autograd for the traced path and a lighter autograd.Function for eager calls,
the in-place consumption rules and the double-backward guard on both paths.

An op supplies its kernels and two functions:
  setup(ctx, inputs, outputs)        saves what the backward needs (both paths)
  backward(ctx, grad, kernels)       -> (input grads, the input it overwrote or None); `kernels`
                                     holds the backward kernels as plain functions (eager) or
                                     as the custom ops (traced), under the same names

In-place backward kernels (given with fake None) run on the eager path only: a traced graph
cannot tell whether an input's memory belongs to the caller (under AOTAutograd a graph input is
written back to the caller's tensor, a parameter included), so setup sees ctx.traced = True
there and ops take their out-of-place kernel (_views.inplace_refused decides).
"""
import functools
from types import SimpleNamespace

import torch
from torch import Tensor


class _NoSecondOrder(torch.autograd.Function):
    """The backward passes are kernels, not differentiable torch ops: under create_graph=True
    the gradients they return would act as constants and a second-order gradient through them
    would be silently wrong (or silently dropped). This node joins each gradient to the op's
    differentiable inputs ("anchors") and raises if anything differentiates through it; using
    the gradients' values stays free."""

    @staticmethod
    def forward(ctx, grad, op, *anchors):
        ctx.op = op
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, _):
        raise RuntimeError(f"{ctx.op}: differentiating its gradient (a double backward, e.g. "
                           "through create_graph=True) is not supported; its backward is a fused "
                           "kernel, not a differentiable op")


def _guard(grad, op, anchors):
    if not anchors and not grad.requires_grad:
        grad = grad.detach().requires_grad_()
    return _NoSecondOrder.apply(grad, op, *anchors)


def _on_the_tensors_device(fn):
    """fn(*args) with the current CUDA device set to that of its first argument (a tensor of the
    op) while it runs, as torch's own ops do: the core launches on the current device, and the
    stream it is given is that of the tensors' device (stream_of), which must agree."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        first = args[0]
        if first.is_cuda and first.get_device() != _current_device():
            with torch.cuda.device(first.get_device()):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return run


try:
    _FAKE = torch._C._TorchDispatchModeKey.FAKE

    def _fake_mode_active():
        return torch._C._get_dispatch_mode(_FAKE) is not None
except AttributeError:  # a torch without dispatch-mode keys
    def _fake_mode_active():
        return False


try:
    from torch._C._functorch import TransformType as _Transform
    from torch._C._functorch import get_interpreter_stack as _interpreters
    _UNDIFFERENTIATED = (_Transform.Vmap, _Transform.Functionalize)

    def _differentiating_transform():
        return any(level.key() not in _UNDIFFERENTIATED for level in _interpreters() or ())
except ImportError:  # a torch without the interpreter stack: any transform
    def _differentiating_transform():
        return torch._C._are_functorch_transforms_active()


def through_custom_ops() -> bool:
    """Whether a call must take the torch.library custom ops, not an eager autograd node: while
    torch.compile traces, under a FakeTensorMode (an eager node reads the data that fake tensors
    lack; the custom ops have fake implementations) and under torch.func transforms (vmap runs
    a custom op row by row; grad and jvp are refused by name in FusedOp.__call__)."""
    return (torch.compiler.is_compiling() or _fake_mode_active()
            or torch._C._are_functorch_transforms_active())


try:  # torch.cuda.current_device() without its lazy-init check per call
    from torch._C import _cuda_getDevice as _current_device
except ImportError:  # a torch without it
    _current_device = torch.cuda.current_device


class FusedOp:
    def __init__(self, name, *, forward, forward_fake, kernels, setup, backward, inplace_flag,
                 n_outputs=1, consumed="overwrote the input with its gradient"):
        """forward: the annotated forward implementation (its first n_outputs outputs are what
        callers get: a tensor, or a tuple when n_outputs > 1, and backward() then receives a
        tuple of their gradients, None or zeros where unused); kernels: {suffix:
        (implementation, fake, mutated argument names)}, fake None for an eager-only kernel;
        consumed: what the in-place backward does, as the second-backward error says it."""
        self.name = f"fusedloss.{name}"
        self._n = n_outputs
        self._inplace_flag = inplace_flag
        self._consumed = consumed  # what the in-place backward did, for the second-backward error
        self._setup, self._op_backward = setup, backward
        forward = _on_the_tensors_device(forward)
        kernels = {suffix: (_on_the_tensors_device(impl), fake, mutates)
                   for suffix, (impl, fake, mutates) in kernels.items()}
        self._forward = forward
        self.forward_op = torch.library.custom_op(f"fusedloss::{name}_fwd", mutates_args=())(forward)
        self.forward_op.register_fake(forward_fake)
        eager, traced = {}, {}
        for suffix, (impl, fake, mutates) in kernels.items():
            eager[suffix] = impl
            if fake is not None:
                op = torch.library.custom_op(f"fusedloss::{name}_{suffix}", mutates_args=mutates)(impl)
                op.register_fake(fake)
                traced[suffix] = op
        self._eager_kernels, self._traced_kernels = SimpleNamespace(**eager), SimpleNamespace(**traced)
        self.forward_op.register_autograd(self._traced_backward, setup_context=self._traced_setup)
        self._function = self._eager_function()

    def __call__(self, *args):
        if through_custom_ops():
            # grad would fail inside torch with its own message, jvp would silently give a zero
            # tangent (the custom op has no forward-mode rule)
            if torch._C._are_functorch_transforms_active() and _differentiating_transform():
                raise RuntimeError(
                    f"{self.name}: torch.func transforms that differentiate (grad, vjp, jvp, "
                    "jacrev, jacfwd, hessian) are not supported: its backward is a fused kernel "
                    "without a functorch rule. Differentiate with torch.autograd (loss.backward(), "
                    "torch.autograd.grad); torch.func.vmap of the forward works")
            out = self.forward_op(*args)
        elif torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args):
            return self._function.apply(*args)
        else:  # nothing to differentiate (no_grad, inference_mode, constants): no node, nothing saved
            out = self._forward(*args)
        return out[0] if self._n == 1 else tuple(out[:self._n])

    def _traced_setup(self, ctx, inputs, output):
        ctx.traced = True
        self._setup(ctx, inputs, output)

    def _eager_function(self):
        op = self

        class Eager(torch.autograd.Function):
            """The same forward and backward without the custom-op dispatch (eagerly, the
            custom ops would cost ~0.1 ms of host time per call)."""

            @staticmethod
            def forward(ctx, *inputs):
                outputs = op._forward(*inputs)
                ctx.traced = False
                op._setup(ctx, inputs, outputs)
                return outputs[0] if op._n == 1 else tuple(outputs[:op._n])

            @staticmethod
            def backward(ctx, *grads):
                return op._backward(ctx, grads[0] if op._n == 1 else grads, op._eager_kernels)

        Eager.__name__ = Eager.__qualname__ = f"{self.name}.Eager"
        return Eager

    def _traced_backward(self, ctx, grad, *other_output_grads):
        if self._n > 1:
            grad = (grad, *other_output_grads[:self._n - 1])
        return self._backward(ctx, grad, self._traced_kernels)

    def _backward(self, ctx, grad, kernels):
        if getattr(ctx, "consumed", False):
            raise RuntimeError(
                f"{self.name}: second backward through a result computed with "
                f"{self._inplace_flag}=True; the first backward {self._consumed}, so it "
                f"cannot be differentiated again. Use {self._inplace_flag}=False "
                "to backward twice (retain_graph=True).")
        if not torch.is_grad_enabled():  # a plain backward: nothing to guard
            grads, overwritten = self._op_backward(ctx, grad, kernels)
            anchors = None
        else:
            # read before the kernels run: an in-place kernel bumps the saved input's version
            anchors = [t for t in ctx.saved_tensors if isinstance(t, Tensor) and t.requires_grad]
            with torch.no_grad():
                grads, overwritten = self._op_backward(ctx, grad, kernels)
        if overwritten is not None:
            ctx.consumed = True
            # The input now holds its gradient: any later reader trips autograd's version check.
            torch.autograd.graph.increment_version(overwritten)
        if anchors is not None:
            grads = tuple(_guard(g, self.name, anchors) if isinstance(g, Tensor) else g for g in grads)
        return grads
