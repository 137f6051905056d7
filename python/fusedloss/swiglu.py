"""fusedloss.swiglu: SwiGLU over Megatron's fused gate-up buffer y [..., 2n] (gate | up).

Megatron semantics (megatron.core.fusions.fused_bias_swiglu): optional bias [2n] added before
the activation, optional per-token scale [T, 1] (MoE), optional clamp, and an fp8 (e4m3) copy of
the input saved for backward. The math runs in fp32 inside one kernel per pass.
"""
import functools
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _C
from ._autograd import first_order_only
from ._views import as_rows, check_float, matrix, stream_of, vector


def _torch_e4m3_saturates() -> bool:
    """Megatron's fp8 input store is torch's float8_e4m3fn cast, whose values past 448 are
    +-448 in newer torch and NaN in older: the e4m3 copy follows the torch in use."""
    return bool(torch.tensor([1e4]).to(torch.float8_e4m3fn).float().isfinite())


_FP8_SATURATE = _torch_e4m3_saturates()


@functools.lru_cache(maxsize=64)
def _options(clamp_value: Optional[float]):
    o = _C.SwigluOptions()  # read only by the C++ side: one per clamp value
    o.fp8_saturate = _FP8_SATURATE
    if clamp_value is not None:
        o.clamp, o.clamp_value = True, float(clamp_value)
    return o


def _forward_impl(y: Tensor, bias: Optional[Tensor], weights: Optional[Tensor], clamp_value: Optional[float],
         fp8_input_store: bool, in_place: bool) -> Tuple[Tensor, Tensor]:
    x = as_rows(y, "y")
    out = torch.empty(x.size(0), x.size(1) // 2, dtype=x.dtype, device=x.device)
    saved = torch.empty(x.shape if fp8_input_store else (0,), dtype=torch.float8_e4m3fn, device=x.device)
    no_copy = _C.MatrixView(0, 0, 1, 1, _C.DType.FP8_E4M3, _C.Device.CPU)
    y8 = matrix(saved, "y_fp8") if fp8_input_store else no_copy
    _C.swiglu_forward(matrix(x, "y"), vector(bias, "bias"), vector(weights, "weights"),
                      _options(clamp_value), matrix(out, "out"), y8, stream_of(x))
    return out.view(*y.shape[:-1], y.size(-1) // 2), saved


_fwd = torch.library.custom_op("fusedloss::swiglu_fwd", mutates_args=())(_forward_impl)


@_fwd.register_fake
def _(y, bias, weights, clamp_value, fp8_input_store, in_place):
    out = y.new_empty(*y.shape[:-1], y.size(-1) // 2)
    saved = y.new_empty((y.numel() // y.size(-1), y.size(-1)) if fp8_input_store else (0,),
                        dtype=torch.float8_e4m3fn)
    return out, saved


def _backward_into(g, saved, bias, weights, clamp_value, grad_y, want_dw, want_db):
    gr = as_rows(g, "grad_out").contiguous()
    gw = torch.empty(gr.size(0), dtype=torch.float32, device=gr.device) if want_dw else None
    gb = torch.empty(grad_y.size(1), dtype=torch.float32, device=gr.device) if want_db else None
    yv = matrix(saved, "y")  # y itself, or its e4m3 copy
    _C.swiglu_backward(matrix(gr, "grad_out"), yv, vector(bias, "bias"), vector(weights, "weights"),
                       _options(clamp_value), matrix(grad_y, "grad_y"),
                       gw.data_ptr() if want_dw else 0, gb.data_ptr() if want_db else 0, stream_of(gr))
    return gw, gb


@torch.library.custom_op("fusedloss::swiglu_bwd", mutates_args=())
def _bwd(g: Tensor, y: Tensor, saved: Tensor, bias: Optional[Tensor], weights: Optional[Tensor],
         clamp_value: Optional[float], fp8_input_store: bool) -> List[Tensor]:
    x = as_rows(y, "y")
    grad = torch.empty(x.shape, dtype=g.dtype, device=g.device)
    src = saved if fp8_input_store else x
    gw, gb = _backward_into(g, src, bias, weights, clamp_value, grad,
                            weights is not None, bias is not None)
    def none_():  # absent gradients are distinct empty tensors (custom-op outputs may not alias)
        return grad.new_empty(0, dtype=torch.float32)
    return [grad.view(y.shape), gw if gw is not None else none_(), gb if gb is not None else none_()]


@_bwd.register_fake
def _(g, y, saved, bias, weights, clamp_value, fp8_input_store):
    rows = y.numel() // y.size(-1)
    return [torch.empty_like(y, dtype=g.dtype), y.new_empty(rows if weights is not None else 0, dtype=torch.float32),
            y.new_empty(y.size(-1) if bias is not None else 0, dtype=torch.float32)]


@torch.library.custom_op("fusedloss::swiglu_bwd_", mutates_args=("y",))
def _bwd_inplace(g: Tensor, y: Tensor, bias: Optional[Tensor], weights: Optional[Tensor],
                 clamp_value: Optional[float]) -> List[Tensor]:
    x = as_rows(y, "y")
    gw, gb = _backward_into(g, x, bias, weights, clamp_value, x, weights is not None,
                            bias is not None)
    return [gw if gw is not None else x.new_empty(0, dtype=torch.float32),
            gb if gb is not None else x.new_empty(0, dtype=torch.float32)]


@_bwd_inplace.register_fake
def _(g, y, bias, weights, clamp_value):
    rows = y.numel() // y.size(-1)
    return [y.new_empty(rows if weights is not None else 0, dtype=torch.float32),
            y.new_empty(y.size(-1) if bias is not None else 0, dtype=torch.float32)]


def _setup_context(ctx, inputs, output):
    y, bias, weights, clamp_value, fp8_input_store, in_place = inputs
    _, saved = output
    ctx.clamp_value, ctx.fp8, ctx.in_place = clamp_value, fp8_input_store, in_place
    ctx.y_shape = y.shape
    ctx.weights_dtype = None if weights is None else weights.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype
    # With the fp8 store only the e4m3 copy is kept, as in Megatron.
    ctx.save_for_backward(y if not fp8_input_store else None, saved, bias, weights)


def _run_backward(ctx, grad_out, eager):
    """The backward of both paths: eager calls the core directly, traced code the custom ops."""
    if getattr(ctx, "consumed", False):
        raise RuntimeError(
            "fusedloss.swiglu: second backward through an activation computed with in_place=True; "
            "the first backward overwrote the input with its gradient. Use in_place=False to "
            "backward twice (retain_graph=True).")
    y, saved, bias, weights = ctx.saved_tensors
    w32 = None if weights is None else weights.reshape(-1).to(torch.float32).contiguous()
    g = grad_out.contiguous()
    want_dw, want_db = weights is not None, bias is not None
    if ctx.in_place and y.stride(-1) == 1 and not y.is_leaf:  # a leaf is never overwritten
        ctx.consumed = True
        if eager:
            x = as_rows(y, "y")
            gw, gb = _backward_into(g, x, bias, w32, ctx.clamp_value, x, want_dw, want_db)
        else:
            gw, gb = torch.ops.fusedloss.swiglu_bwd_(g, y, bias, w32, ctx.clamp_value)
        torch.autograd.graph.increment_version(y)
        dy = y
    elif eager:
        dy = torch.empty(ctx.y_shape, dtype=g.dtype, device=g.device)
        src = saved if ctx.fp8 else as_rows(y, "y")
        gw, gb = _backward_into(g, src, bias, w32, ctx.clamp_value, dy.view(-1, dy.size(-1)),
                                want_dw, want_db)
    else:
        dy, gw, gb = torch.ops.fusedloss.swiglu_bwd(g, y if y is not None else saved, saved, bias, w32,
                                                    ctx.clamp_value, ctx.fp8)
        dy = dy.view(ctx.y_shape)
    d_bias = gb.to(ctx.bias_dtype) if want_db else None
    d_w = gw.view(weights.shape).to(ctx.weights_dtype) if want_dw else None
    return dy, d_bias, d_w, None, None, None


def _backward(ctx, grad_out, _grad_saved):
    return _run_backward(ctx, grad_out, eager=False)


_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerSwiGLU(torch.autograd.Function):
    """The same passes without the custom-op dispatch, for eager mode (the custom ops are what
    torch.compile traces)."""

    @staticmethod
    def forward(ctx, y, bias, weights, clamp_value, fp8_input_store, in_place):
        out, saved = _forward_impl(y, bias, weights, clamp_value, fp8_input_store, in_place)
        _setup_context(ctx, (y, bias, weights, clamp_value, fp8_input_store, in_place), (out, saved))
        return out

    @staticmethod
    @first_order_only("fusedloss.swiglu")
    def backward(ctx, grad_out):
        return _run_backward(ctx, grad_out, eager=True)


def swiglu(y: Tensor, bias: Optional[Tensor] = None, *, per_token_scale: Optional[Tensor] = None,
           clamp_value: Optional[float] = None, fp8_input_store: bool = False,
           in_place: bool = False) -> Tensor:
    """silu(gate) * up over y [..., 2n] = [gate | up]; returns [..., n].

    bias [2n] is added before the activation; per_token_scale [T, 1] (T = rows of y) scales
    each row's output (MoE), with its gradient; clamp_value applies Megatron's clamped SwiGLU
    (gate <= c, -c <= up <= c). fp8_input_store saves an e4m3 copy of y for backward instead of
    y. in_place writes the input gradient into y's storage (no [T, 2n] gradient buffer); y is
    consumed, so a second backward raises.
    """
    if y.dim() < 2 or y.size(-1) % 2:
        raise ValueError(f"y: got shape {tuple(y.shape)}, expected [..., 2n] with an even last dim "
                         "(gate columns [0, n), up columns [n, 2n))")
    check_float(y, "y")
    rows = y.numel() // y.size(-1)
    if bias is not None:
        if tuple(bias.shape) != (y.size(-1),):
            raise ValueError(f"bias: got shape {tuple(bias.shape)}, expected ({y.size(-1)},) = [2n]")
        if bias.dtype != y.dtype or bias.device != y.device:
            raise ValueError(f"bias: got {bias.dtype} on {bias.device}, expected {y.dtype} on {y.device}")
        bias = bias.contiguous()
    if per_token_scale is not None:
        if per_token_scale.numel() != rows or (per_token_scale.dim() == 2 and per_token_scale.size(1) != 1):
            raise ValueError(f"per_token_scale: got shape {tuple(per_token_scale.shape)}, expected "
                             f"({rows}, 1) = [T, 1]")
        if per_token_scale.device != y.device:
            raise ValueError(f"per_token_scale.device: got {per_token_scale.device}, expected {y.device}")
    if fp8_input_store and in_place:
        raise ValueError("in_place=True with fp8_input_store=True: the fp8 store frees y for an "
                         "e4m3 copy, so there is no y left to write the gradient into; pick one")
    args = (y, bias, per_token_scale, clamp_value, bool(fp8_input_store), bool(in_place))
    if torch.compiler.is_compiling():
        out, _ = torch.ops.fusedloss.swiglu_fwd(*args)
        return out
    return _EagerSwiGLU.apply(*args)


class SwiGLU(torch.nn.Module):
    """nn.Module form of fusedloss.swiglu (options fixed at construction)."""

    def __init__(self, **options):
        super().__init__()
        self.options = options

    def forward(self, y: Tensor, bias: Optional[Tensor] = None,
                per_token_scale: Optional[Tensor] = None) -> Tensor:
        return swiglu(y, bias, per_token_scale=per_token_scale, **self.options)
