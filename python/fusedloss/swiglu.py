"""fusedloss.swiglu: SwiGLU over Megatron's fused gate-up buffer y [..., 2n] (gate | up).

Megatron semantics (megatron.core.fusions.fused_bias_swiglu): optional bias [2n] added before
the activation, optional per-token scale [T, 1] (MoE), optional clamp, and an fp8 (e4m3) copy of
the input saved for backward. The math runs in fp32 inside one kernel per pass.
"""
import functools
import warnings
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _C, _native
from ._op import FusedOp, through_custom_ops
from ._views import (EAGER_CALL, apart_from, as_bool, as_dtype, as_float, inplace_refused, matrix, require_float_aux, require_same_device,
                     require_values, rows_of, stream_of, validated, values_in, vector)

_OP = "fusedloss.swiglu"
_NO_E4M3 = _C.MatrixView(0, 0, 1, 1, _C.DType.FP8_E4M3, _C.Device.CPU)  # no e4m3 copy kept


@functools.lru_cache(maxsize=None)
def _torch_e4m3_saturates() -> bool:
    """Megatron's fp8 input store is torch's float8_e4m3fn cast, whose values past 448 are
    +-448 in newer torch and NaN in older: the e4m3 copy follows the torch in use."""
    return bool(torch.tensor([1e4]).to(torch.float8_e4m3fn).float().isfinite())


@functools.lru_cache(maxsize=None)
def _torch_clamp_passes_at_bound() -> Tuple[bool, bool]:
    """Whether the running torch's clamp passes the gradient where the value equals the bound,
    for the gate's one-sided clamp(max=c) and the up half's clamp(min=-c, max=c) (Megatron's
    unfused clamped SwiGLU). The rule has changed between torch releases; bf16 values land on
    the bound often, so the kernels follow whichever rule is running. Probed on first use, not
    at import: a backward starts autograd's device threads, which counts the GPUs."""
    with torch.inference_mode(False), torch.enable_grad():  # whatever mode the first call runs in
        x = torch.tensor([1.0, 1.0, -1.0], requires_grad=True)
        grad, = torch.autograd.grad(x[:1].clamp(max=1.0).sum() + x[1:].clamp(min=-1.0, max=1.0).sum(), x)
    gate, up_hi, up_lo = (bool(v == 1) for v in grad)
    if up_hi != up_lo:
        warnings.warn("fusedloss.swiglu: this torch's clamp treats its two bounds differently; the "
                      "up half follows the upper bound's rule")
    return gate, up_hi


@functools.lru_cache(maxsize=64)
def _check_clamp(clamp_value: float) -> None:
    """The C++ range check alone (finite, > 0), without _options' probes of torch's behaviour
    (they run a backward: on first use, not while a module is built)."""
    o = _C.SwigluOptions()
    o.clamp, o.clamp_value = True, float(clamp_value)
    validated(_C.validate_swiglu_options, o)


@functools.lru_cache(maxsize=64)
def _options(clamp_value: Optional[float]):
    o = _C.SwigluOptions()  # read only by the C++ side: one per clamp value
    o.fp8_saturate = _torch_e4m3_saturates()
    if clamp_value is not None:
        o.clamp, o.clamp_value = True, float(clamp_value)
        o.clamp_gate_grad_at_bound, o.clamp_up_grad_at_bound = _torch_clamp_passes_at_bound()
    validated(_C.validate_swiglu_options, o)
    return o


@functools.lru_cache(maxsize=64)
def _eager_options(clamp_value: Optional[float]) -> Tuple[bool, float, bool, bool]:
    """_options' fields as the C++ node takes them."""
    o = _options(clamp_value)
    return o.clamp, o.clamp_value, o.clamp_gate_grad_at_bound, o.clamp_up_grad_at_bound


def _eager(y, bias, weights, clamp_value, inplace):
    """An eager call through the C++ autograd node (no fp8 input store): the same decisions as
    the Python node's setup (an in-place gradient only into memory that is ours, warned
    otherwise; decided when a node is recorded)."""
    if inplace and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (y, bias, weights)):
        inplace = not inplace_refused(EAGER_CALL, y, _OP, "y", "inplace_backward")
    else:
        inplace = False
    return _EAGER(y, bias, weights, *_eager_options(clamp_value), inplace)


def _bias_for(bias: Optional[Tensor], y: Tensor) -> Optional[Tensor]:
    """The bias as the kernels read it: y's dtype as is, any other float dtype in fp32."""
    if bias is None:
        return None
    return values_in(bias, y.dtype if bias.dtype == y.dtype else torch.float32)


def _scale_for(weights: Optional[Tensor]) -> Optional[Tensor]:
    return None if weights is None else values_in(weights.reshape(-1), torch.float32)


def _forward(y: Tensor, bias: Optional[Tensor], weights: Optional[Tensor], clamp_value: Optional[float],
             fp8_input_store: bool, inplace_backward: bool) -> Tuple[Tensor, Tensor]:
    x = rows_of(y)
    # allocated in the caller's shape and returned as is: an output that is a view made here
    # could not be modified in place by the caller (autograd refuses it for custom Functions)
    out = torch.empty(*y.shape[:-1], y.size(-1) // 2, dtype=x.dtype, device=x.device)
    saved = torch.empty(x.shape if fp8_input_store else (0,), dtype=torch.float8_e4m3fn, device=x.device)
    y8 = matrix(saved) if fp8_input_store else _NO_E4M3
    b, w = _bias_for(bias, x), _scale_for(weights)
    _C.swiglu_forward(matrix(x), vector(b), vector(w), _options(clamp_value),
                      matrix(rows_of(out)), y8, stream_of(x))
    return out, saved


def _forward_fake(y, bias, weights, clamp_value, fp8_input_store, inplace_backward):
    out = y.new_empty(*y.shape[:-1], y.size(-1) // 2)
    saved = y.new_empty((y.numel() // y.size(-1), y.size(-1)) if fp8_input_store else (0,),
                        dtype=torch.float8_e4m3fn)
    return out, saved


def _backward_into(grad_out, x, bias, weights, clamp_value, grad_y):
    """Kernel backward from rows x (y's rows, or its e4m3 copy) into rows grad_y; returns the
    fp32 per-row scale gradient and bias gradient (empty when absent)."""
    g = rows_of(values_in(grad_out, grad_y.dtype))  # may arrive expanded
    b, w = _bias_for(bias, grad_y), _scale_for(weights)
    gw = torch.empty(g.size(0) if w is not None else 0, dtype=torch.float32, device=g.device)
    gb = torch.empty(grad_y.size(1) if b is not None else 0, dtype=torch.float32, device=g.device)
    _C.swiglu_backward(matrix(g), matrix(x), vector(b), vector(w), _options(clamp_value), matrix(grad_y),
                       gw.data_ptr() if w is not None else 0, gb.data_ptr() if b is not None else 0,
                       stream_of(g))
    return [gw, gb]


def _backward(g: Tensor, y: Tensor, saved: Tensor, bias: Optional[Tensor], weights: Optional[Tensor],
              clamp_value: Optional[float], fp8_input_store: bool) -> List[Tensor]:
    grad = torch.empty(y.shape, dtype=g.dtype, device=g.device)
    src = saved if fp8_input_store else rows_of(y)
    return [grad, *_backward_into(g, src, bias, weights, clamp_value, rows_of(grad))]


def _backward_fake(g, y, saved, bias, weights, clamp_value, fp8_input_store):
    rows = y.numel() // y.size(-1)
    return [torch.empty(y.shape, dtype=g.dtype, device=g.device),
            y.new_empty(rows if weights is not None else 0, dtype=torch.float32),
            y.new_empty(y.size(-1) if bias is not None else 0, dtype=torch.float32)]


def _backward_inplace(g: Tensor, y: Tensor, bias: Optional[Tensor], weights: Optional[Tensor],
                      clamp_value: Optional[float]) -> List[Tensor]:
    x = rows_of(y)  # a view: setup() checked storage_is_ours
    # the kernel overwrites y while it reads these: none may be a view of y's memory
    return _backward_into(apart_from(g, y), x, apart_from(bias, y), apart_from(weights, y),
                          clamp_value, x)


def _setup(ctx, inputs, output):
    y, bias, weights, clamp_value, fp8_input_store, inplace = inputs
    _, saved = output
    ctx.clamp_value, ctx.fp8, ctx.y_shape = clamp_value, fp8_input_store, y.shape
    ctx.inplace = inplace and not inplace_refused(ctx, y, _OP, "y", "inplace_backward")
    ctx.aux = [(None if t is None else (t.shape, t.dtype)) for t in (bias, weights)]
    # With the fp8 store only the e4m3 copy is kept, as in Megatron.
    ctx.save_for_backward(y if not fp8_input_store else None, saved, bias, weights)


def _grads(ctx, grad_out, kernels):
    y, saved, bias, weights = ctx.saved_tensors
    if ctx.inplace:
        gw, gb = kernels.bwd_(grad_out, y, bias, weights, ctx.clamp_value)
        dy, overwritten = y, y
    else:
        dy, gw, gb = kernels.bwd(grad_out, y if y is not None else saved, saved, bias, weights,
                                 ctx.clamp_value, ctx.fp8)
        if ctx.fp8:  # the gradient has the e4m3 copy's [rows, 2n] shape: y's, not the copy's
            dy = dy.view(ctx.y_shape)
        overwritten = None
    (bias_meta, w_meta) = ctx.aux
    d_bias = as_dtype(gb.view(bias_meta[0]), bias_meta[1]) if bias_meta else None
    d_w = as_dtype(gw.view(w_meta[0]), w_meta[1]) if w_meta else None
    return (dy, d_bias, d_w, None, None, None), overwritten


_swiglu = FusedOp(
    "swiglu", forward=_forward, forward_fake=_forward_fake, setup=_setup, backward=_grads,
    inplace_flag="inplace_backward",
    kernels={"bwd": (_backward, _backward_fake, ()),
             "bwd_": (_backward_inplace, None, ("y",))})  # eager only
# eager calls without the fp8 input store: the same steps with the autograd node in C++
_EAGER = _native.ops.swiglu_eager.default if _native.ops is not None else None


def _check_fp8_store(fp8_input_store, inplace: bool) -> bool:
    """fp8_input_store as a bool, checked against inplace_backward."""
    fp8_input_store = as_bool(fp8_input_store, "fp8_input_store")
    if fp8_input_store and inplace:
        raise ValueError("inplace_backward=True with fp8_input_store=True: the fp8 store frees y for "
                         "an e4m3 copy, so there is no y left to write the gradient into; pick one")
    return fp8_input_store


def _inplace_flag(inplace_backward, in_place):
    if in_place is None:
        return as_bool(inplace_backward, "inplace_backward")
    warnings.warn("fusedloss.swiglu: in_place= is deprecated; use inplace_backward= (one spelling "
                  "for every op)", DeprecationWarning, stacklevel=3)
    return as_bool(in_place, "in_place")


def swiglu(y: Tensor, bias: Optional[Tensor] = None, *, per_token_scale: Optional[Tensor] = None,
           clamp_value: Optional[float] = None, fp8_input_store: bool = False,
           inplace_backward: bool = False, in_place: Optional[bool] = None) -> Tensor:
    """silu(gate) * up over y [..., 2n] = [gate | up] (fp32/fp16/bf16, any strides); returns
    [..., n] in y's dtype.

    bias [2n] (any float dtype) is added before the activation; per_token_scale, one scale per
    row of y ([T, 1], or y's shape with a last dim of 1; any float dtype and strides), scales
    each row's output (MoE), with its
    gradient; gradients come back in each tensor's own dtype and shape. clamp_value applies
    Megatron's clamped SwiGLU (gate <= c, -c <= up <= c) with the running torch's clamp rule at
    the bound. fp8_input_store saves an e4m3 copy of y for backward instead of y.
    inplace_backward writes the input gradient into y's memory (no [T, 2n] gradient buffer); y is
    consumed, so a second backward raises. Memory the caller owns is never written: for a leaf,
    a view of a leaf, or a layout the kernels must copy, the gradient goes to a new buffer
    (warned once). `in_place` is the deprecated spelling of inplace_backward.
    """
    inplace = _inplace_flag(inplace_backward, in_place)
    require_values(y, "y")
    if y.dim() < 2 or y.size(-1) == 0 or y.size(-1) % 2:
        raise ValueError(f"y: got shape {tuple(y.shape)}, expected [..., 2n] with n >= 1 (gate "
                         "columns [0, n), up columns [n, 2n))")
    rows = y.numel() // y.size(-1)
    if bias is not None:
        require_float_aux(bias, "bias")
        if tuple(bias.shape) != (y.size(-1),):
            raise ValueError(f"bias: got shape {tuple(bias.shape)}, expected ({y.size(-1)},) = [2n]")
        require_same_device(bias, "bias", y, "y")
    if per_token_scale is not None:
        require_float_aux(per_token_scale, "per_token_scale")
        # [T, 1] or y's shape with a last dim of 1: the shapes whose flattening is y's row order
        # (a [b, s, 1] scale of an [s, b, 2n] y has T elements too, in another order)
        if tuple(per_token_scale.shape) not in ((rows, 1), (*y.shape[:-1], 1)):
            raise ValueError(f"per_token_scale: got shape {tuple(per_token_scale.shape)}, expected "
                             f"({rows}, 1) = [T, 1] or {(*y.shape[:-1], 1)} (y's shape with a last "
                             "dim of 1), one scale per row of y")
        require_same_device(per_token_scale, "per_token_scale", y, "y")
    if clamp_value is not None:
        clamp_value = as_float(clamp_value, "clamp_value")
        if not torch.compiler.is_compiling():  # traced calls are checked when the op runs
            _check_clamp(clamp_value)
    fp8_input_store = _check_fp8_store(fp8_input_store, inplace)
    if _EAGER is not None and not fp8_input_store and not through_custom_ops():
        return _eager(y, bias, per_token_scale, clamp_value, inplace)  # the C++ node (_native.py)
    return _swiglu(y, bias, per_token_scale, clamp_value, fp8_input_store, inplace)


class SwiGLU(torch.nn.Module):
    """nn.Module form of fusedloss.swiglu (keyword options fixed and checked at construction)."""

    _OPTIONS = ("clamp_value", "fp8_input_store", "inplace_backward", "in_place")

    def __init__(self, **options):
        super().__init__()
        unknown = set(options) - set(self._OPTIONS)
        if unknown:
            raise TypeError(f"SwiGLU: unknown options {sorted(unknown)}; expected some of "
                            f"{sorted(self._OPTIONS)}")
        if options.get("clamp_value") is not None:
            _check_clamp(as_float(options["clamp_value"], "clamp_value"))
        defaults = swiglu.__kwdefaults__
        inplace = _inplace_flag(options.get("inplace_backward", defaults["inplace_backward"]),
                                options.get("in_place"))
        _check_fp8_store(options.get("fp8_input_store", defaults["fp8_input_store"]), inplace)
        self.options = options

    def forward(self, y: Tensor, bias: Optional[Tensor] = None,
                per_token_scale: Optional[Tensor] = None) -> Tensor:
        return swiglu(y, bias, per_token_scale=per_token_scale, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())
