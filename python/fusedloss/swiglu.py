"""fusedloss.swiglu: SwiGLU over Megatron's fused gate-up buffer y [..., 2n] (gate | up), or over
separate gate and up tensors (Hugging Face's and Liger's gate_proj(x), up_proj(x)).

Megatron semantics (megatron.core.fusions.fused_bias_swiglu): optional bias [2n] added before
the activation, optional per-token scale [T, 1] (MoE), optional clamp, and an fp8 (e4m3) copy of
the input saved for backward; Falcon-H1's gate and down multipliers. Both forms run the same
kernels, which read gate and up through a pointer and a row stride each (the fused buffer's
halves, or two tensors as they are: no copy). The math runs in fp32 inside one kernel per pass.
"""
import functools
import warnings
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _C, _native
from ._args import swiglu_form
from ._op import FusedOp, through_custom_ops
from ._views import (EAGER_CALL, _caller_stacklevel, _rows_view, apart_from, as_bool, as_dtype, as_float,
                     inplace_refused, matrix, require_float_aux, require_same_device, require_values, rows_of,
                     shares_memory, stream_of, validated, values_in, vector)

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
def _check_scalars(clamp_value: Optional[float], gate_multiplier: float, down_multiplier: float) -> None:
    """The C++ range checks alone (clamp_value finite and > 0, the multipliers finite), without
    _options' probes of torch's behaviour (they run a backward: on first use, not while a module
    is built)."""
    o = _C.SwigluOptions()
    if clamp_value is not None:
        o.clamp, o.clamp_value = True, float(clamp_value)
    o.gate_multiplier, o.down_multiplier = float(gate_multiplier), float(down_multiplier)
    validated(_C.validate_swiglu_options, o)


@functools.lru_cache(maxsize=64)
def _options(clamp_value: Optional[float], gate_multiplier: float = 1.0, down_multiplier: float = 1.0):
    o = _C.SwigluOptions()  # read only by the C++ side: one per setting
    o.fp8_saturate = _torch_e4m3_saturates()
    if clamp_value is not None:
        o.clamp, o.clamp_value = True, float(clamp_value)
        o.clamp_gate_grad_at_bound, o.clamp_up_grad_at_bound = _torch_clamp_passes_at_bound()
    o.gate_multiplier, o.down_multiplier = float(gate_multiplier), float(down_multiplier)
    validated(_C.validate_swiglu_options, o)
    return o


@functools.lru_cache(maxsize=64)
def _eager_options(clamp_value: Optional[float], gate_multiplier: float,
                   down_multiplier: float) -> Tuple[bool, float, bool, bool, float, float]:
    """_options' fields as the C++ node takes them."""
    o = _options(clamp_value, gate_multiplier, down_multiplier)
    return (o.clamp, o.clamp_value, o.clamp_gate_grad_at_bound, o.clamp_up_grad_at_bound,
            o.gate_multiplier, o.down_multiplier)


def _eager(y, bias, weights, clamp_value, gate_multiplier, down_multiplier, inplace):
    """An eager call through the C++ autograd node (no fp8 input store): the same decisions as
    the Python node's setup (an in-place gradient only into memory that is ours, warned
    otherwise; decided when a node is recorded)."""
    if inplace and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (y, bias, weights)):
        inplace = not inplace_refused(EAGER_CALL, y, _OP, "y", "inplace_backward")
    else:
        inplace = False
    return _EAGER(y, bias, weights, *_eager_options(clamp_value, gate_multiplier, down_multiplier), inplace)


def _bias_for(bias: Optional[Tensor], y: Tensor) -> Optional[Tensor]:
    """The bias as the kernels read it: y's dtype as is, any other float dtype in fp32."""
    if bias is None:
        return None
    return values_in(bias, y.dtype if bias.dtype == y.dtype else torch.float32)


def _scale_for(weights: Optional[Tensor]) -> Optional[Tensor]:
    return None if weights is None else values_in(weights.reshape(-1), torch.float32)


def _forward(y: Tensor, bias: Optional[Tensor], weights: Optional[Tensor], clamp_value: Optional[float],
             gate_multiplier: float, down_multiplier: float, fp8_input_store: bool,
             inplace_backward: bool) -> Tuple[Tensor, Tensor]:
    x = rows_of(y)
    # allocated in the caller's shape and returned as is: an output that is a view made here
    # could not be modified in place by the caller (autograd refuses it for custom Functions)
    out = torch.empty(*y.shape[:-1], y.size(-1) // 2, dtype=x.dtype, device=x.device)
    saved = torch.empty(x.shape if fp8_input_store else (0,), dtype=torch.float8_e4m3fn, device=x.device)
    y8 = matrix(saved) if fp8_input_store else _NO_E4M3
    b, w = _bias_for(bias, x), _scale_for(weights)
    _C.swiglu_forward(matrix(x), vector(b), vector(w), _options(clamp_value, gate_multiplier, down_multiplier),
                      matrix(rows_of(out)), y8, stream_of(x))
    return out, saved


def _forward_fake(y, bias, weights, clamp_value, gate_multiplier, down_multiplier, fp8_input_store,
                  inplace_backward):
    out = y.new_empty(*y.shape[:-1], y.size(-1) // 2)
    saved = y.new_empty((y.numel() // y.size(-1), y.size(-1)) if fp8_input_store else (0,),
                        dtype=torch.float8_e4m3fn)
    return out, saved


def _backward_into(grad_out, x, bias, weights, clamp_value, gate_multiplier, down_multiplier, grad_y):
    """Kernel backward from rows x (y's rows, or its e4m3 copy) into rows grad_y; returns the
    fp32 per-row scale gradient and bias gradient (empty when absent)."""
    g = rows_of(values_in(grad_out, grad_y.dtype))  # may arrive expanded
    b, w = _bias_for(bias, grad_y), _scale_for(weights)
    gw = torch.empty(g.size(0) if w is not None else 0, dtype=torch.float32, device=g.device)
    gb = torch.empty(grad_y.size(1) if b is not None else 0, dtype=torch.float32, device=g.device)
    _C.swiglu_backward(matrix(g), matrix(x), vector(b), vector(w),
                       _options(clamp_value, gate_multiplier, down_multiplier), matrix(grad_y),
                       gw.data_ptr() if w is not None else 0, gb.data_ptr() if b is not None else 0,
                       stream_of(g))
    return [gw, gb]


def _backward(g: Tensor, y: Tensor, saved: Tensor, bias: Optional[Tensor], weights: Optional[Tensor],
              clamp_value: Optional[float], gate_multiplier: float, down_multiplier: float,
              fp8_input_store: bool) -> List[Tensor]:
    grad = torch.empty(y.shape, dtype=g.dtype, device=g.device)
    src = saved if fp8_input_store else rows_of(y)
    return [grad, *_backward_into(g, src, bias, weights, clamp_value, gate_multiplier, down_multiplier,
                                  rows_of(grad))]


def _backward_fake(g, y, saved, bias, weights, clamp_value, gate_multiplier, down_multiplier,
                   fp8_input_store):
    rows = y.numel() // y.size(-1)
    return [torch.empty(y.shape, dtype=g.dtype, device=g.device),
            y.new_empty(rows if weights is not None else 0, dtype=torch.float32),
            y.new_empty(y.size(-1) if bias is not None else 0, dtype=torch.float32)]


def _backward_inplace(g: Tensor, y: Tensor, bias: Optional[Tensor], weights: Optional[Tensor],
                      clamp_value: Optional[float], gate_multiplier: float,
                      down_multiplier: float) -> List[Tensor]:
    x = rows_of(y)  # a view: setup() checked storage_is_ours
    # the kernel overwrites y while it reads these: none may be a view of y's memory
    return _backward_into(apart_from(g, y), x, apart_from(bias, y), apart_from(weights, y),
                          clamp_value, gate_multiplier, down_multiplier, x)


def _setup(ctx, inputs, output):
    y, bias, weights, clamp_value, gate_multiplier, down_multiplier, fp8_input_store, inplace = inputs
    _, saved = output
    ctx.clamp_value, ctx.fp8, ctx.y_shape = clamp_value, fp8_input_store, y.shape
    ctx.multipliers = (gate_multiplier, down_multiplier)
    ctx.inplace = inplace and not inplace_refused(ctx, y, _OP, "y", "inplace_backward")
    ctx.aux = [(None if t is None else (t.shape, t.dtype)) for t in (bias, weights)]
    # With the fp8 store only the e4m3 copy is kept, as in Megatron.
    ctx.save_for_backward(y if not fp8_input_store else None, saved, bias, weights)


def _grads(ctx, grad_out, kernels):
    y, saved, bias, weights = ctx.saved_tensors
    if ctx.inplace:
        gw, gb = kernels.bwd_(grad_out, y, bias, weights, ctx.clamp_value, *ctx.multipliers)
        dy, overwritten = y, y
    else:
        dy, gw, gb = kernels.bwd(grad_out, y if y is not None else saved, saved, bias, weights,
                                 ctx.clamp_value, *ctx.multipliers, ctx.fp8)
        if ctx.fp8:  # the gradient has the e4m3 copy's [rows, 2n] shape: y's, not the copy's
            dy = dy.view(ctx.y_shape)
        overwritten = None
    d_bias, d_w = _aux_grads(ctx, gw, gb)
    return (dy, d_bias, d_w, None, None, None, None, None), overwritten


def _aux_grads(ctx, gw, gb):
    """The bias's and the per-token scale's gradients in their own shapes and dtypes."""
    (bias_meta, w_meta) = ctx.aux
    d_bias = as_dtype(gb.view(bias_meta[0]), bias_meta[1]) if bias_meta else None
    d_w = as_dtype(gw.view(w_meta[0]), w_meta[1]) if w_meta else None
    return d_bias, d_w


_swiglu = FusedOp(
    "swiglu", forward=_forward, forward_fake=_forward_fake, setup=_setup, backward=_grads,
    inplace_flag="inplace_backward",
    kernels={"bwd": (_backward, _backward_fake, ()),
             "bwd_": (_backward_inplace, None, ("y",))})  # eager only
# eager calls without the fp8 input store: the same steps with the autograd node in C++
_EAGER = _native.ops.swiglu_eager.default if _native.ops is not None else None


# ---- the two-tensor form: gate and up as separate tensors, through the same kernels ----

def _share_elements(a: Tensor, b: Tensor) -> bool:
    """Whether a and b can share an element: their address ranges meet and, for two row views of
    one row stride (the halves of one [..., 2n] buffer), a row of one meets a row of the other."""
    if not shares_memory(a, b):
        return False
    ra, rb = _rows_view(a), _rows_view(b)
    if ra is None or rb is None or ra.dtype != rb.dtype or ra.size(0) < 2 or rb.size(0) < 2:
        return True
    stride = ra.stride(0)
    if rb.stride(0) != stride:
        return True
    (first, second) = (ra, rb) if ra.data_ptr() <= rb.data_ptr() else (rb, ra)
    gap = second.data_ptr() - first.data_ptr()
    if gap % ra.element_size():
        return True
    shift = (gap // ra.element_size()) % stride
    return not (shift >= first.size(1) and shift + second.size(1) <= stride)


def _gu_forward(gate: Tensor, up: Tensor, bias: Optional[Tensor], weights: Optional[Tensor],
                clamp_value: Optional[float], gate_multiplier: float, down_multiplier: float,
                fp8_input_store: bool, inplace_backward: bool) -> Tuple[Tensor, Tensor]:
    g, u = rows_of(gate), rows_of(up)  # views of the caller's memory where the kernels can read it
    out = torch.empty(gate.shape, dtype=g.dtype, device=g.device)
    saved = torch.empty((g.size(0), 2 * g.size(1)) if fp8_input_store else (0,),
                        dtype=torch.float8_e4m3fn, device=g.device)
    in8 = matrix(saved) if fp8_input_store else _NO_E4M3
    b, w = _bias_for(bias, g), _scale_for(weights)
    _C.swiglu_gate_up_forward(matrix(g), matrix(u), vector(b), vector(w),
                              _options(clamp_value, gate_multiplier, down_multiplier),
                              matrix(rows_of(out)), in8, stream_of(g))
    return out, saved


def _gu_forward_fake(gate, up, bias, weights, clamp_value, gate_multiplier, down_multiplier,
                     fp8_input_store, inplace_backward):
    rows, n = gate.numel() // gate.size(-1), gate.size(-1)
    return (gate.new_empty(gate.shape),
            gate.new_empty((rows, 2 * n) if fp8_input_store else (0,), dtype=torch.float8_e4m3fn))


def _gu_backward_into(grad_out, gate_rows, up_rows, bias, weights, clamp_value, gate_multiplier,
                      down_multiplier, grad_gate, grad_up):
    """Kernel backward from rows gate_rows, up_rows (the inputs' rows, or the halves of their
    e4m3 copy) into rows grad_gate, grad_up; returns the fp32 per-row scale gradient and bias
    gradient (empty when absent)."""
    g = rows_of(values_in(grad_out, grad_gate.dtype))  # may arrive expanded
    b, w = _bias_for(bias, grad_gate), _scale_for(weights)
    gw = torch.empty(g.size(0) if w is not None else 0, dtype=torch.float32, device=g.device)
    gb = torch.empty(2 * grad_gate.size(1) if b is not None else 0, dtype=torch.float32, device=g.device)
    _C.swiglu_gate_up_backward(matrix(g), matrix(gate_rows), matrix(up_rows), vector(b), vector(w),
                               _options(clamp_value, gate_multiplier, down_multiplier),
                               matrix(grad_gate), matrix(grad_up),
                               gw.data_ptr() if w is not None else 0,
                               gb.data_ptr() if b is not None else 0, stream_of(g))
    return [gw, gb]


def _gu_backward(g: Tensor, gate: Tensor, up: Tensor, saved: Tensor, bias: Optional[Tensor],
                 weights: Optional[Tensor], clamp_value: Optional[float], gate_multiplier: float,
                 down_multiplier: float, fp8_input_store: bool) -> List[Tensor]:
    """With the fp8 store, gate and up are the [rows, 2n] e4m3 copy (the gradients come back
    [rows, n], viewed in the inputs' shapes by the caller)."""
    if fp8_input_store:
        n = saved.size(1) // 2
        src_g, src_u = saved[:, :n], saved[:, n:]
        shape_g = shape_u = (saved.size(0), n)
    else:
        src_g, src_u = rows_of(gate), rows_of(up)
        shape_g, shape_u = gate.shape, up.shape
    dgate = torch.empty(shape_g, dtype=g.dtype, device=g.device)
    dup = torch.empty(shape_u, dtype=g.dtype, device=g.device)
    return [dgate, dup, *_gu_backward_into(g, src_g, src_u, bias, weights, clamp_value, gate_multiplier,
                                           down_multiplier, rows_of(dgate), rows_of(dup))]


def _gu_backward_fake(g, gate, up, saved, bias, weights, clamp_value, gate_multiplier,
                      down_multiplier, fp8_input_store):
    if fp8_input_store:
        shape_g = shape_u = (saved.size(0), saved.size(1) // 2)
    else:
        shape_g, shape_u = gate.shape, up.shape
    rows = g.numel() // g.size(-1)
    return [g.new_empty(shape_g), g.new_empty(shape_u),
            g.new_empty(rows if weights is not None else 0, dtype=torch.float32),
            g.new_empty(2 * g.size(-1) if bias is not None else 0, dtype=torch.float32)]


def _gu_backward_inplace(g: Tensor, gate: Tensor, up: Tensor, bias: Optional[Tensor],
                         weights: Optional[Tensor], clamp_value: Optional[float],
                         gate_multiplier: float, down_multiplier: float) -> List[Tensor]:
    gr, ur = rows_of(gate), rows_of(up)  # views: setup() checked storage_is_ours for both

    def apart(t):  # the kernel overwrites gate and up while it reads these
        return apart_from(apart_from(t, gate), up)
    return _gu_backward_into(apart(g), gr, ur, apart(bias), apart(weights), clamp_value,
                             gate_multiplier, down_multiplier, gr, ur)


def _gu_inplace(ctx, gate: Tensor, up: Tensor) -> bool:
    """Whether the gradients may overwrite gate and up: both memory autograd owns (warned
    otherwise, as for y), and no element of one is an element of the other."""
    if inplace_refused(ctx, gate, _OP, "gate", "inplace_backward") or \
            inplace_refused(ctx, up, _OP, "up", "inplace_backward"):
        return False
    if _share_elements(gate, up):
        warnings.warn(f"{_OP}: inplace_backward=True, but gate and up share memory (one tensor "
                      "twice, or overlapping views): their gradients go to new buffers",
                      stacklevel=_caller_stacklevel())
        return False
    return True


def _gu_setup(ctx, inputs, output):
    gate, up, bias, weights, clamp_value, gate_multiplier, down_multiplier, fp8_input_store, inplace = inputs
    _, saved = output
    ctx.clamp_value, ctx.fp8 = clamp_value, fp8_input_store
    ctx.multipliers = (gate_multiplier, down_multiplier)
    ctx.shapes = (gate.shape, up.shape)
    ctx.inplace = inplace and _gu_inplace(ctx, gate, up)
    ctx.aux = [(None if t is None else (t.shape, t.dtype)) for t in (bias, weights)]
    keep = not fp8_input_store  # with the fp8 store only the e4m3 copy is kept
    ctx.save_for_backward(gate if keep else None, up if keep else None, saved, bias, weights)


def _gu_grads(ctx, grad_out, kernels):
    gate, up, saved, bias, weights = ctx.saved_tensors
    if ctx.inplace:
        gw, gb = kernels.bwd_(grad_out, gate, up, bias, weights, ctx.clamp_value, *ctx.multipliers)
        dgate, dup, overwritten = gate, up, (gate, up)
    else:
        dgate, dup, gw, gb = kernels.bwd(grad_out, gate if gate is not None else saved,
                                         up if up is not None else saved, saved, bias, weights,
                                         ctx.clamp_value, *ctx.multipliers, ctx.fp8)
        if ctx.fp8:
            dgate, dup = dgate.view(ctx.shapes[0]), dup.view(ctx.shapes[1])
        overwritten = None
    d_bias, d_w = _aux_grads(ctx, gw, gb)
    return (dgate, dup, d_bias, d_w, None, None, None, None, None), overwritten


_swiglu_gate_up = FusedOp(
    "swiglu_gate_up", forward=_gu_forward, forward_fake=_gu_forward_fake, setup=_gu_setup,
    backward=_gu_grads, inplace_flag="inplace_backward",
    consumed="overwrote gate and up with their gradients",
    kernels={"bwd": (_gu_backward, _gu_backward_fake, ()),
             "bwd_": (_gu_backward_inplace, None, ("gate", "up"))})  # eager only
# eager calls without the fp8 input store: the same steps with the autograd node in C++
_EAGER_GATE_UP = _native.ops.swiglu_gate_up_eager.default if _native.ops is not None else None


# ---- arguments ----

def _check_fp8_store(fp8_input_store, inplace: bool) -> bool:
    """fp8_input_store as a bool, checked against inplace_backward."""
    fp8_input_store = as_bool(fp8_input_store, "fp8_input_store")
    if fp8_input_store and inplace:
        raise ValueError("inplace_backward=True with fp8_input_store=True: the fp8 store frees the "
                         "input for an e4m3 copy, so there is no input left to write the gradient "
                         "into; pick one")
    return fp8_input_store


def _inplace_flag(inplace_backward, in_place):
    if in_place is None:
        return as_bool(inplace_backward, "inplace_backward")
    warnings.warn("fusedloss.swiglu: in_place= is deprecated; use inplace_backward= (one spelling "
                  "for every op)", DeprecationWarning, stacklevel=3)
    return as_bool(in_place, "in_place")


def _shape(t) -> tuple:
    return tuple(t.shape)


def _form(first, second, bias):
    """(up, bias) from the positional arguments: fusedloss._args.swiglu_form."""
    return swiglu_form(first, second, bias, (Tensor,), "a torch.Tensor", _OP)


def _check_aux(bias, per_token_scale, ref, ref_name, two_n, rows, bias_note):
    if bias is not None:
        require_float_aux(bias, "bias")
        if tuple(bias.shape) != (two_n,):
            raise ValueError(f"bias: got shape {tuple(bias.shape)}, expected ({two_n},) = [2n]{bias_note}")
        require_same_device(bias, "bias", ref, ref_name)
    if per_token_scale is not None:
        require_float_aux(per_token_scale, "per_token_scale")
        # [T, 1] or the input's shape with a last dim of 1: the shapes whose flattening is its row
        # order (a [b, s, 1] scale of an [s, b, 2n] y has T elements too, in another order)
        if tuple(per_token_scale.shape) not in ((rows, 1), (*ref.shape[:-1], 1)):
            raise ValueError(f"per_token_scale: got shape {tuple(per_token_scale.shape)}, expected "
                             f"({rows}, 1) = [T, 1] or {(*ref.shape[:-1], 1)} ({ref_name}'s shape "
                             f"with a last dim of 1), one scale per row of {ref_name}")
        require_same_device(per_token_scale, "per_token_scale", ref, ref_name)


def _scalars(clamp_value, gate_multiplier, down_multiplier):
    if clamp_value is not None:
        clamp_value = as_float(clamp_value, "clamp_value")
    gate_multiplier = as_float(gate_multiplier, "gate_multiplier")
    down_multiplier = as_float(down_multiplier, "down_multiplier")
    if not torch.compiler.is_compiling():  # traced calls are checked when the op runs
        _check_scalars(clamp_value, gate_multiplier, down_multiplier)
    return clamp_value, gate_multiplier, down_multiplier


def swiglu(y_or_gate: Tensor, up_or_bias: Optional[Tensor] = None, /, *, bias: Optional[Tensor] = None,
           per_token_scale: Optional[Tensor] = None, clamp_value: Optional[float] = None,
           gate_multiplier: float = 1.0, down_multiplier: float = 1.0, fp8_input_store: bool = False,
           inplace_backward: bool = False, in_place: Optional[bool] = None) -> Tensor:
    """silu(gate) * up, in two forms through the same kernels (fp32/fp16/bf16, any strides):

    - swiglu(y, bias=None): Megatron's fused buffer y [..., 2n] = [gate | up]; returns [..., n].
    - swiglu(gate, up): the separate gate and up projections of Hugging Face's and Liger's MLPs
      (act_fn(gate_proj(x)) * up_proj(x)), two tensors of one shape [..., n], dtype and device;
      returns [..., n] with gradients for both. The kernels read each through its own pointer
      and strides: two separate tensors, or two views of one buffer (the halves of a fused
      projection, y.chunk(2, -1)), are read as they are, never copied into a [..., 2n] buffer.

    The second positional argument is up when it has the first's shape, else the fused form's
    bias ([2n], 1-D); a swapped or mismatched pair (a bias first, an up of another shape, a
    [T, 1] scale where up goes) raises naming what each form expects. Options go by keyword.

    bias [2n] (any float dtype) is added before the activation (in the two-tensor form: the
    gate's bias in [0, n), the up's in [n, 2n)); per_token_scale, one scale per row ([T, 1], or
    the input's shape with a last dim of 1; any float dtype and strides), scales each row's
    output (MoE), with its gradient; gradients come back in each tensor's own dtype and shape.
    clamp_value applies Megatron's clamped SwiGLU (gate <= c, -c <= up <= c) with the running
    torch's clamp rule at the bound. gate_multiplier and down_multiplier are Falcon-H1's
    mlp_multipliers (FalconH1MLP: up * silu(gate * gate_multiplier), and the down projection's
    output times down_multiplier, which is the same as this output times down_multiplier, the
    projection being linear): out = silu(m * (gate + bias_gate)) * (up + bias_up) * scale * d,
    the clamp applying to m * (gate + bias_gate); plain numbers (config constants), no gradient;
    1.0 leaves the math bit for bit as without them. fp8_input_store saves an e4m3 copy of the
    input for backward instead of the input.

    inplace_backward writes the input gradient into the input's memory (no gradient buffer): y's,
    or gate's and up's; the input is consumed, so a second backward raises. Memory the caller
    owns is never written: for a leaf, a view of a leaf, a layout the kernels must copy, or a
    gate and up sharing elements, the gradient goes to a new buffer (warned once). False by
    default, by the rule every fusedloss op follows: a backward overwrites a tensor the caller
    passed in only when asked (plain code may still read y, gate or up after the backward),
    while memory only the op can reach is reused by default (the linear cross-entropy's saved
    gradients). `in_place` is the deprecated spelling of inplace_backward.

    Changed: the second positional argument, formerly always bias, is up when it has the first's
    shape (a call that passed a bias of y's shape raised before); y and it are positional-only.
    """
    inplace = _inplace_flag(inplace_backward, in_place)
    up, bias = _form(y_or_gate, up_or_bias, bias)
    clamp_value, gate_multiplier, down_multiplier = _scalars(clamp_value, gate_multiplier, down_multiplier)
    fp8_input_store = _check_fp8_store(fp8_input_store, inplace)
    if up is not None:
        return _swiglu_two(y_or_gate, up, bias, per_token_scale, clamp_value, gate_multiplier,
                           down_multiplier, fp8_input_store, inplace)
    y = y_or_gate
    require_values(y, "y")
    if y.dim() < 2 or y.size(-1) == 0 or y.size(-1) % 2:
        raise ValueError(f"y: got shape {tuple(y.shape)}, expected [..., 2n] with n >= 1 (gate "
                         "columns [0, n), up columns [n, 2n)); for separate gate and up tensors "
                         "call swiglu(gate, up)")
    _check_aux(bias, per_token_scale, y, "y", y.size(-1), y.numel() // y.size(-1), "")
    if _EAGER is not None and not fp8_input_store and not through_custom_ops():
        # the C++ node (_native.py)
        return _eager(y, bias, per_token_scale, clamp_value, gate_multiplier, down_multiplier, inplace)
    return _swiglu(y, bias, per_token_scale, clamp_value, gate_multiplier, down_multiplier,
                   fp8_input_store, inplace)


def _swiglu_two(gate, up, bias, per_token_scale, clamp_value, gate_multiplier, down_multiplier,
                fp8_input_store, inplace):
    require_values(gate, "gate")
    require_values(up, "up")
    if gate.dim() < 1 or gate.size(-1) == 0:
        raise ValueError(f"gate: got shape {tuple(gate.shape)}, expected [..., n] with n >= 1")
    if up.dtype != gate.dtype:
        raise ValueError(f"up.dtype: got {up.dtype}, expected gate's {gate.dtype} (one dtype for "
                         "both projections)")
    require_same_device(up, "up", gate, "gate")
    _check_aux(bias, per_token_scale, gate, "gate", 2 * gate.size(-1), gate.numel() // gate.size(-1),
               " (the gate's bias in [0, n), the up's in [n, 2n))")
    if _EAGER_GATE_UP is not None and not fp8_input_store and not through_custom_ops():
        # the C++ node (_native.py), with the Python node's decisions
        if inplace and torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (gate, up, bias, per_token_scale)):
            inplace = _gu_inplace(EAGER_CALL, gate, up)
        else:
            inplace = False
        return _EAGER_GATE_UP(gate, up, bias, per_token_scale,
                              *_eager_options(clamp_value, gate_multiplier, down_multiplier), inplace)
    return _swiglu_gate_up(gate, up, bias, per_token_scale, clamp_value, gate_multiplier,
                           down_multiplier, fp8_input_store, inplace)


class SwiGLU(torch.nn.Module):
    """nn.Module form of fusedloss.swiglu (keyword options fixed and checked at construction):
    SwiGLU()(y) over a fused [..., 2n] buffer, SwiGLU()(gate, up) over separate projections
    (FalconH1's: SwiGLU(gate_multiplier=m, down_multiplier=d))."""

    _OPTIONS = ("clamp_value", "gate_multiplier", "down_multiplier", "fp8_input_store",
                "inplace_backward", "in_place")

    def __init__(self, **options):
        super().__init__()
        unknown = set(options) - set(self._OPTIONS)
        if unknown:
            raise TypeError(f"SwiGLU: unknown options {sorted(unknown)}; expected some of "
                            f"{sorted(self._OPTIONS)}")
        defaults = swiglu.__kwdefaults__
        _scalars(options.get("clamp_value"), options.get("gate_multiplier", defaults["gate_multiplier"]),
                 options.get("down_multiplier", defaults["down_multiplier"]))
        inplace = _inplace_flag(options.get("inplace_backward", defaults["inplace_backward"]),
                                options.get("in_place"))
        _check_fp8_store(options.get("fp8_input_store", defaults["fp8_input_store"]), inplace)
        self.options = options

    def forward(self, y_or_gate: Tensor, up_or_bias: Optional[Tensor] = None,
                per_token_scale: Optional[Tensor] = None, *, bias: Optional[Tensor] = None) -> Tensor:
        return swiglu(y_or_gate, up_or_bias, bias=bias, per_token_scale=per_token_scale, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())
