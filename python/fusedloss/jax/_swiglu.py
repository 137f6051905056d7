"""fusedloss.jax.swiglu: SwiGLU over the fused gate-up layout y [..., 2n] = [gate | up]
(Megatron's), as a jax.custom_vjp over XLA FFI calls: out = silu(gate + b_g) * (up + b_u) * s,
math in fp32, one handler call per pass."""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi
from ._args import as_float, require_float_aux, require_values

_F32 = jnp.float32


def _extras(bias, scale):
    return tuple(a for a in (bias, scale) if a is not None)


def _attributes(clamp_value, bias, scale):
    return dict(clamp_value=clamp_value, has_bias=bias is not None, has_scale=scale is not None)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _swiglu(clamp_value, y, bias, scale):
    rows, cols = y.shape
    (out,) = _ffi.call("swiglu_forward", [((rows, cols // 2), y.dtype)], y, *_extras(bias, scale),
                       **_attributes(clamp_value, bias, scale))
    return out


def _swiglu_fwd(clamp_value, y, bias, scale):
    return _swiglu(clamp_value, y, bias, scale), (y, bias, scale)


def _swiglu_bwd(clamp_value, saved, g):
    y, bias, scale = saved
    rows, cols = y.shape
    results = [(y.shape, y.dtype)]
    results += [((rows,), _F32)] if scale is not None else []
    results += [((cols,), _F32)] if bias is not None else []
    dy, *rest = _ffi.call("swiglu_backward", results, g.astype(y.dtype), y, *_extras(bias, scale),
                          **_attributes(clamp_value, bias, scale))
    dscale = rest.pop(0) if scale is not None else None
    dbias = rest.pop(0).astype(bias.dtype) if bias is not None else None
    return dy, dbias, dscale


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def swiglu(y, bias=None, *, per_token_scale=None, clamp_value=None):
    """silu(gate) * up over y [..., 2n] = [gate | up] (float32/float16/bfloat16); returns
    [..., n] in y's dtype, as fusedloss.swiglu computes it.

    bias [2n] (any float dtype) is added before the activation; per_token_scale, one scale per
    row of y ([T, 1], or y's shape with a last dim of 1; any float dtype), scales each row's
    output (MoE). Gradients come back in each array's own dtype and shape. clamp_value c applies
    Megatron's clamped SwiGLU (gate <= c, -c <= up <= c); the gradient is zero where a clamp is
    active, on the bound too (torch 2.15's rule; jnp.clip's gradient on the bound differs).
    """
    require_values(y, "y")
    if y.ndim < 2 or y.shape[-1] == 0 or y.shape[-1] % 2:
        raise ValueError(f"y: got shape {tuple(y.shape)}, expected [..., 2n] with n >= 1 (gate "
                         "columns [0, n), up columns [n, 2n))")
    cols = y.shape[-1]
    rows = int(np.prod(y.shape[:-1]))
    b = s = None
    if bias is not None:
        require_float_aux(bias, "bias")
        if tuple(bias.shape) != (cols,):
            raise ValueError(f"bias: got shape {tuple(bias.shape)}, expected ({cols},) = [2n]")
        b = bias if bias.dtype == y.dtype else bias.astype(_F32)  # as the kernels read it
    if per_token_scale is not None:
        require_float_aux(per_token_scale, "per_token_scale")
        # [T, 1] or y's shape with a last dim of 1: the shapes whose flattening is y's row order
        if tuple(per_token_scale.shape) not in ((rows, 1), (*y.shape[:-1], 1)):
            raise ValueError(f"per_token_scale: got shape {tuple(per_token_scale.shape)}, expected "
                             f"({rows}, 1) = [T, 1] or {(*y.shape[:-1], 1)} (y's shape with a last "
                             "dim of 1), one scale per row of y")
        s = per_token_scale.reshape(-1).astype(_F32)
    c = 0.0
    if clamp_value is not None:
        c = as_float(clamp_value, "clamp_value")
        _ffi.validate_swiglu_clamp(c)
    out = _swiglu(c, y.reshape(rows, cols), b, s)
    return out.reshape(*y.shape[:-1], cols // 2)
