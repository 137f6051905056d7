"""fusedloss.rms_norm: RMSNorm over the last dimension, y = x / sqrt(mean(x^2) + eps) * gamma.

Megatron's variants: eps, zero-centred gamma (the weight stores gamma - 1), a weight dtype that
differs from the input's; and the fused residual add s = x + residual, y = rmsnorm(s) (returns
both, as TransformerEngine's fused norm does). fp32 math in one kernel per pass; the weight
gradient is deterministic (fixed-order fp32 partials, no atomics) and, under sequence
parallelism, a partial sum over this rank's tokens that the caller all-reduces.
"""
import functools
import math
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from . import _C, _native
from ._op import FusedOp, through_custom_ops
from ._views import (_DTYPES, VALUE_DTYPES, as_bool, as_dtype, as_float, as_int, device_of, matrix,
                     require_float_aux, require_same_device, require_values, rows_of, stream_of,
                     validated, values_in, vector)

_OP = "fusedloss.rms_norm"
# eps=None as torch's rms_norm takes it: the epsilon of its math type, fp32 for every input dtype
# fusedloss reads (F.rms_norm's output for bf16 x with eps=None equals eps=2^-23, not
# finfo(bfloat16).eps)
_TORCH_EPS = torch.finfo(torch.float32).eps
_ABSENT = _C.MatrixView(0, 0, 1, 1, _C.DType.F32, _C.Device.CPU)
# weight dtypes the kernels read as they are, per input dtype (the core's rule, asked once); any
# other float weight is read in fp32
_WEIGHT_AS_IS = {x: tuple(w for w in VALUE_DTYPES if _C.rms_norm_reads_weight_as_is(_DTYPES[x], _DTYPES[w]))
                 for x in VALUE_DTYPES}


@functools.lru_cache(maxsize=64)
def _options(eps: float, zero_centered_gamma: bool):
    o = _C.RmsNormOptions()  # read only by the C++ side: one per setting
    o.eps, o.zero_centered_gamma = float(eps), bool(zero_centered_gamma)
    validated(_C.validate_rms_norm_options, o)
    return o


def _weight_for(weight: Tensor, x_dtype: torch.dtype) -> Tensor:
    """The weight as the kernels read it: contiguous, in its own dtype where the kernels take it
    with x's dtype, else in fp32."""
    return values_in(weight, weight.dtype if weight.dtype in _WEIGHT_AS_IS[x_dtype] else torch.float32)


def _forward(x: Tensor, weight: Tensor, residual: Optional[Tensor], eps: float,
             zero_centered_gamma: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(y, s, rstd): s = x + residual (empty without a residual), rstd [T] fp32 for the backward."""
    xr = rows_of(x)
    # outputs allocated in x's shape and returned as they are: an output that is a view made
    # here could not be modified in place by the caller (autograd refuses it for custom Functions)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(xr.size(0), dtype=torch.float32, device=x.device)
    if residual is not None:
        rr = rows_of(residual)
        s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        r_view, s_view = matrix(rr), matrix(rows_of(s))
    else:
        s = x.new_empty(0)
        r_view = s_view = _ABSENT
    w = _weight_for(weight, x.dtype)
    _C.rms_norm_forward(matrix(xr), vector(w), _options(eps, zero_centered_gamma),
                        matrix(rows_of(y)), rstd.data_ptr(), r_view, s_view, stream_of(x))
    return y, s, rstd


def _forward_fake(x, weight, residual, eps, zero_centered_gamma):
    rows = x.numel() // x.size(-1)
    return (x.new_empty(x.shape), x.new_empty(x.shape if residual is not None else (0,)),
            x.new_empty(rows, dtype=torch.float32))


def _backward(g: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, grad_s: Optional[Tensor],
              eps: float, zero_centered_gamma: bool) -> List[Tensor]:
    xr = rows_of(x)
    rows, hidden = xr.shape
    gr = rows_of(as_dtype(g, x.dtype))  # may arrive expanded (the gradient of a sum) or strided
    # kept alive until the kernel has run: a view holds only the pointer
    gsr = rows_of(as_dtype(grad_s, x.dtype)) if grad_s is not None else None
    gs = matrix(gsr) if gsr is not None else _ABSENT
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # in the dtype the weight is read in (its own, or fp32): summed in fp32, rounded once there
    dw = torch.empty(hidden, dtype=weight.dtype, device=x.device)
    # the weight gradient's partials through torch's allocator (CUDA graphs, the caching pool)
    ws_bytes = _C.rms_norm_backward_workspace_bytes(rows, hidden, device_of(x))
    ws = torch.empty((ws_bytes + 3) // 4, dtype=torch.float32, device=x.device) if ws_bytes else None
    _C.rms_norm_backward(matrix(gr), matrix(xr), vector(weight), rstd.data_ptr(),
                         _options(eps, zero_centered_gamma), matrix(rows_of(dx)), dw.data_ptr(),
                         _DTYPES[dw.dtype], ws.data_ptr() if ws_bytes else 0, gs, stream_of(x))
    return [dx, dw]


def _backward_fake(g, x, weight, rstd, grad_s, eps, zero_centered_gamma):
    return [x.new_empty(x.shape), x.new_empty(x.size(-1), dtype=weight.dtype)]


def _setup(ctx, inputs, output):
    x, weight, residual, eps, zc = inputs
    _, s, rstd = output
    ctx.eps, ctx.zc, ctx.residual = eps, zc, residual is not None
    ctx.w_dtype = weight.dtype
    # the backward reads what was normalised: x, or s = x + residual
    ctx.save_for_backward(s if residual is not None else x, _weight_for(weight, x.dtype), rstd)


def _grads(ctx, grads, kernels):
    src, w, rstd = ctx.saved_tensors
    g, grad_s = grads if ctx.residual else (grads, None)
    if g is None:  # only s was used
        g = torch.zeros_like(src)
    dx, dw = kernels.bwd(g, src, w, rstd, grad_s, ctx.eps, ctx.zc)
    d_weight = as_dtype(dw, ctx.w_dtype)  # dw is [H] (the weight's shape, checked) in the dtype
                                          # read: the weight's own unless it was read in fp32
    # with the residual, x and residual both receive the gradient of s
    return (dx, d_weight, dx if ctx.residual else None, None, None), None


def _make(name, n_outputs):
    return FusedOp(name, forward=_forward, forward_fake=_forward_fake, setup=_setup,
                   backward=_grads, inplace_flag="inplace_backward", n_outputs=n_outputs,
                   kernels={"bwd": (_backward, _backward_fake, ())})


_rms_norm = _make("rms_norm", 1)
_rms_norm_residual = _make("rms_norm_residual", 2)
# eager calls: the same steps with the autograd node in C++, when it is loaded
_EAGER = _native.ops.rms_norm_eager.default if _native.ops is not None else None
_EAGER_RESIDUAL = _native.ops.rms_norm_residual_eager.default if _native.ops is not None else None


def _check(x, weight, eps, zero_centered_gamma, residual):
    require_values(x, "x")
    if x.dim() < 1 or x.size(-1) == 0:
        raise ValueError(f"x: got shape {tuple(x.shape)}, expected [..., H] with H >= 1 "
                         "([T, H] or [s, b, H])")
    hidden = x.size(-1)
    require_float_aux(weight, "weight")
    if weight.shape != (hidden,):
        raise ValueError(f"weight: got shape {tuple(weight.shape)}, expected ({hidden},) = [H], "
                         "one weight per column of x")
    require_same_device(weight, "weight", x, "x")
    eps = _TORCH_EPS if eps is None else as_float(eps, "eps")
    zero_centered_gamma = as_bool(zero_centered_gamma, "zero_centered_gamma")
    if not torch.compiler.is_compiling():  # traced calls are checked when the op runs
        _options(eps, zero_centered_gamma)  # the C++ check (finite, > 0), once per value
    if residual is not None:
        require_values(residual, "residual")
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual: got shape {tuple(residual.shape)} {residual.dtype}, expected "
                             f"x's {tuple(x.shape)} {x.dtype}")
        require_same_device(residual, "residual", x, "x")
    return eps


_UNSET = object()  # an argument not passed
_LEGACY_EPS = 1e-5  # the weight-first form's default (Megatron's layernorm_epsilon, TE's)
_SHAPE_TYPES = (int, tuple, list, torch.Size)


def _shape_like(v) -> bool:
    return isinstance(v, _SHAPE_TYPES) and not isinstance(v, bool)


def _describe(v) -> str:
    if isinstance(v, Tensor):
        return f"a tensor of shape {tuple(v.shape)} ({v.dtype})"
    return f"{v!r} ({type(v).__name__})"


_FORMS = ("rms_norm(x, normalized_shape, weight=None, eps=None) (F.rms_norm's order) or "
          "rms_norm(x, weight, eps=1e-5, zero_centered_gamma=False, residual=None)")


def _parse(args, kwargs):
    """(normalized_shape or None, weight or None, eps, zero_centered_gamma, residual) from either
    call form, or an error naming the argument that does not fit either."""
    known = ("normalized_shape", "weight", "eps", "zero_centered_gamma", "residual")
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise TypeError(f"{_OP}: unknown keyword arguments {unknown}; expected some of {list(known)}")
    torch_form = (_shape_like(args[0]) if args else "normalized_shape" in kwargs)
    if args and not torch_form and not isinstance(args[0], Tensor):
        raise TypeError(f"normalized_shape: got {_describe(args[0])}, expected ints (the normalised "
                        f"trailing dims of x) or, in the weight-first form, a weight tensor: {_FORMS}")
    names = (("normalized_shape", "weight", "eps") if torch_form
             else ("weight", "eps", "zero_centered_gamma", "residual"))
    if len(args) > len(names):
        raise TypeError(f"{_OP}: got {len(args) + 1} positional arguments, expected at most "
                        f"{len(names) + 1} in this form ({', '.join(('x',) + names)})"
                        + ("; zero_centered_gamma and residual go by keyword" if torch_form else ""))
    values = dict(zip(names, args))
    for name in values:
        if name in kwargs:
            raise TypeError(f"{_OP}: {name} given twice, by position and by keyword")
    values.update(kwargs)
    eps = values.get("eps", _UNSET)
    weight = values.get("weight")
    if torch_form:
        shape = values["normalized_shape"]
        if isinstance(shape, Tensor):
            raise TypeError(f"normalized_shape: got {_describe(shape)}, expected ints (the normalised "
                            "trailing dims of x, as F.rms_norm takes them); a weight goes after it, "
                            "rms_norm(x, normalized_shape, weight), or first in the weight-first form, "
                            "rms_norm(x, weight)")
        if weight is not None and not isinstance(weight, Tensor):
            hint = (" (eps is the fourth argument in F.rms_norm's order)"
                    if isinstance(weight, float) else "")
            raise TypeError(f"weight: got {_describe(weight)}, expected a tensor of shape "
                            f"normalized_shape or None{hint}: {_FORMS}")
        eps = None if eps is _UNSET else eps
    else:
        if weight is None or not isinstance(weight, Tensor):
            raise TypeError(f"weight: got {_describe(weight)}, expected a tensor [H]; or give "
                            f"normalized_shape: {_FORMS}")
        if not weight.dtype.is_floating_point:
            raise ValueError(f"weight.dtype: got {weight.dtype}, expected a floating-point dtype (a "
                             "weight [H]; normalized_shape, F.rms_norm's second argument, takes ints as "
                             f"a tuple, not a tensor): {_FORMS}")
        if (isinstance(eps, Tensor) and eps.dim() > 0) or (_shape_like(eps) and not isinstance(eps, int)):
            raise TypeError(f"eps: got {_describe(eps)}, expected a float; the weight-first form is "
                            "rms_norm(x, weight, eps): in F.rms_norm's order the shape comes before "
                            "the weight, rms_norm(x, normalized_shape, weight, eps)")
        shape = None
        eps = _LEGACY_EPS if eps is _UNSET else eps
    return shape, weight, eps, values.get("zero_centered_gamma", False), values.get("residual")


def _normalized_shape(shape, x: Tensor) -> Tuple[int, ...]:
    """normalized_shape as a tuple of ints that are x's trailing dims."""
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        shown = repr(shape) if len(dims) <= 4 else f"{repr(shape)[:40]}... ({len(dims)} items)"
        raise TypeError(f"normalized_shape: got {shown} ({type(shape).__name__}), expected ints (x's "
                        "trailing dims to normalise over); a weight is a tensor, not a list: "
                        f"{_FORMS}")
    if not dims or x.dim() < len(dims) or tuple(x.shape[x.dim() - len(dims):]) != dims:
        raise ValueError(f"normalized_shape: got {dims}, expected x's trailing dims (x has shape "
                         f"{tuple(x.shape)}): rms_norm normalises over the last len(normalized_shape) "
                         "dims")
    return dims


def rms_norm(x: Tensor, *args, **kwargs) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """RMSNorm of x (fp32/fp16/bf16, any strides; [T, H] or Megatron's [s, b, H]):
    y = x / sqrt(mean(x^2) + eps) * gamma over the normalised trailing dims, in two call forms:

    - rms_norm(x, normalized_shape, weight=None, eps=None): torch.nn.functional.rms_norm's
      signature and defaults. normalized_shape (an int or ints) is x's trailing dims to
      normalise over (any number of them); weight has that shape, or is None (gamma = 1);
      eps=None is torch's default.
    - rms_norm(x, weight, eps=1e-5, zero_centered_gamma=False, residual=None): the weight-first
      form (a tensor second), normalising over the last dim, weight [H]; eps defaults to 1e-5
      (Megatron's layernorm_epsilon and TransformerEngine's), as it always has.

    Both forms take zero_centered_gamma and residual (by keyword in the first form). eps: a finite
    value > 0, or None for torch's default, the fp32 epsilon 2^-23 (what F.rms_norm(eps=None) adds
    for every dtype fusedloss reads). Hugging Face's Llama-family norms and Liger's default to 1e-6
    but always carry the model's rms_norm_eps: pass it when swapping one in. weight: any float
    dtype; gamma = weight, or 1 + weight with zero_centered_gamma (the weight stores gamma - 1).

    With residual (x's shape and dtype): s = x + residual (rounded to x's dtype, as the unfused
    sum is), y = rmsnorm(s); returns (y, s), both differentiable. Returns y in x's dtype and shape.
    Gradients come back in each input's dtype and shape; the weight's is deterministic (the same
    bits on every call on a given device). Math in fp32; no host synchronisation.

    A call that fits neither form raises naming the argument and both forms: a tensor where
    normalized_shape goes, a float where the weight goes, a shape where eps goes.

    Changed: the F.rms_norm form is new (the second argument selects the form: ints or a
    tensor); the weight-first form and its 1e-5 default are unchanged.
    """
    if not kwargs and 1 <= len(args) <= 2 and isinstance(args[0], Tensor) and args[0].dtype.is_floating_point:
        # the weight-first form's common call, rms_norm(x, weight[, eps]), without the parsing
        eps = args[1] if len(args) == 2 else _LEGACY_EPS
        if eps is None or type(eps) is float:
            return _rms_norm_last_dim(x, args[0], eps, False, None)
    shape, weight, eps, zero_centered_gamma, residual = _parse(args, kwargs)
    if shape is None:
        return _rms_norm_last_dim(x, weight, eps, zero_centered_gamma, residual)
    require_values(x, "x")
    dims = _normalized_shape(shape, x)
    if weight is not None and tuple(weight.shape) != dims:
        require_float_aux(weight, "weight")
        raise ValueError(f"weight: got shape {tuple(weight.shape)}, expected normalized_shape {dims}")
    if weight is None:  # no weight: gamma = 1 (the ones below), zero-centred or not
        as_bool(zero_centered_gamma, "zero_centered_gamma")
        zero_centered_gamma = False
    if len(dims) == 1:
        w = weight if weight is not None else _ones(x, dims[0])
        return _rms_norm_last_dim(x, w, eps, zero_centered_gamma, residual)
    # several trailing dims: one row of their product (reshape copies only a layout that needs it)
    hidden = math.prod(dims)
    flat = (*x.shape[:x.dim() - len(dims)], hidden)
    w = weight.reshape(hidden) if weight is not None else _ones(x, hidden)
    if residual is not None:
        if not isinstance(residual, Tensor) or residual.shape != x.shape:
            raise ValueError(f"residual: got {_describe(residual)}, expected x's shape {tuple(x.shape)}")
        y, s = _rms_norm_last_dim(x.reshape(flat), w, eps, zero_centered_gamma, residual.reshape(flat))
        return y.view(x.shape), s.view(x.shape)
    return _rms_norm_last_dim(x.reshape(flat), w, eps, zero_centered_gamma, None).view(x.shape)


def _ones(x: Tensor, hidden: int) -> Tensor:
    """gamma = 1 (F.rms_norm's weight=None), in x's dtype (read as it is; 1 is exact in every
    dtype): the same kernels, a weight gradient nobody asked for left to autograd to drop."""
    if not isinstance(x, Tensor) or x.dtype not in _WEIGHT_AS_IS:
        require_values(x, "x")
    return torch.ones(hidden, dtype=x.dtype, device=x.device)


def _rms_norm_last_dim(x, weight, eps, zero_centered_gamma, residual):
    eps = _check(x, weight, eps, zero_centered_gamma, residual)
    if _EAGER is not None and not through_custom_ops():  # the C++ nodes (_native.py)
        if residual is not None:
            return _EAGER_RESIDUAL(x, weight, residual, eps, zero_centered_gamma)
        return _EAGER(x, weight, eps, zero_centered_gamma)
    if residual is not None:
        return _rms_norm_residual(x, weight, residual, eps, zero_centered_gamma)
    return _rms_norm(x, weight, None, eps, zero_centered_gamma)


class RMSNorm(torch.nn.Module):
    """nn.Module form of fusedloss.rms_norm with a learnable weight [hidden_size], initialised
    like torch.nn.RMSNorm's (ones), or zeros with zero_centered_gamma (gamma = 1 + weight).

    eps defaults to None, torch.nn.RMSNorm's default (the fp32 epsilon, 2^-23), so a
    torch.nn.RMSNorm swapped out keeps its values. Hugging Face's Llama-family norms and Liger's
    LigerRMSNorm default to 1e-6 and Megatron to 1e-5, but their models always set it from the
    config (rms_norm_eps, layernorm_epsilon): pass that eps when swapping one in.

    Changed: the default eps was 1e-5; pass eps=1e-5 for the former default.
    """

    def __init__(self, hidden_size: int, eps: Optional[float] = None,
                 zero_centered_gamma: bool = False, device=None, dtype=None):
        super().__init__()
        hidden_size = as_int(hidden_size, "hidden_size")
        if hidden_size < 1:
            raise ValueError(f"hidden_size: got {hidden_size}, expected >= 1")
        eps = None if eps is None else as_float(eps, "eps")  # None: torch's default (rms_norm)
        self.zero_centered_gamma = as_bool(zero_centered_gamma, "zero_centered_gamma")
        _options(_TORCH_EPS if eps is None else eps, self.zero_centered_gamma)  # the C++ check
        self.hidden_size, self.eps = hidden_size, eps
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype: got {dtype!r} ({type(dtype).__name__}), expected a torch.dtype")
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"dtype: got {dtype}, expected a floating-point dtype for the weight")
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            (self.weight.zero_() if self.zero_centered_gamma else self.weight.fill_(1.0))

    def forward(self, x: Tensor, residual: Optional[Tensor] = None):
        return rms_norm(x, self.weight, self.eps, self.zero_centered_gamma, residual)

    def extra_repr(self):
        return (f"{self.hidden_size}, eps={self.eps}"
                + (", zero_centered_gamma=True" if self.zero_centered_gamma else ""))
