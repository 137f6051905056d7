"""fusedloss.jax.rms_norm: the core's RMSNorm as a jax.custom_vjp over XLA FFI calls. fp32
math in one handler call per pass, rstd (4 B/row) kept between them; the weight gradient is
deterministic (fixed-order fp32 partial sums) and rounded once."""
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi
from ._args import DTYPES, as_bool, as_float, require_float_aux, require_values

# eps=None as torch.nn.RMSNorm takes it: the float32 epsilon, for every input dtype
_FLOAT32_EPS = float(np.finfo(np.float32).eps)


class RmsOptions(NamedTuple):
    eps: float
    zero_centered_gamma: bool

    def attributes(self) -> dict:
        return dict(eps=self.eps, zero_centered_gamma=self.zero_centered_gamma)


def _forward(o, x, w, residual=None):
    rows, hidden = x.shape
    results = [(x.shape, x.dtype), ((rows,), jnp.float32)]
    if residual is None:
        return _ffi.call("rms_norm_forward", results, x, w, **o.attributes())
    return _ffi.call("rms_norm_forward", results + [(x.shape, x.dtype)], x, w, residual,
                     **o.attributes())


def _backward(o, g, src, w, rstd, grad_s=None):
    grads = [(src.shape, src.dtype), (w.shape, w.dtype)]  # the weight's: in the dtype read
    extra = () if grad_s is None else (grad_s.astype(src.dtype),)
    return _ffi.call("rms_norm_backward", grads, g.astype(src.dtype), src, w, rstd, *extra,
                     **o.attributes())


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rms_norm(o, x, w):
    return _forward(o, x, w)[0]


def _rms_norm_fwd(o, x, w):
    y, rstd = _forward(o, x, w)
    return y, (x, w, rstd)


def _rms_norm_bwd(o, saved, g):
    x, w, rstd = saved
    return tuple(_backward(o, g, x, w, rstd))


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rms_norm_residual(o, x, w, residual):
    y, _, s = _forward(o, x, w, residual)
    return y, s


def _rms_norm_residual_fwd(o, x, w, residual):
    y, rstd, s = _forward(o, x, w, residual)
    return (y, s), (s, w, rstd)


def _rms_norm_residual_bwd(o, saved, grads):
    s, w, rstd = saved
    g, grad_s = grads
    dx, dw = _backward(o, g, s, w, rstd, grad_s)
    return dx, dw, dx  # x and residual both receive the gradient of s


_rms_norm_residual.defvjp(_rms_norm_residual_fwd, _rms_norm_residual_bwd)


def _weight_for(weight, x_dtype):
    """The weight as the kernels read it: its own dtype where they take it beside x's, else fp32
    (outside the custom_vjp: JAX casts its gradient back)."""
    if np.dtype(weight.dtype) in DTYPES and _ffi.rms_norm_reads_weight_as_is(
            DTYPES[np.dtype(x_dtype)], DTYPES[np.dtype(weight.dtype)]):
        return weight
    return weight.astype(jnp.float32)


def rms_norm(x, weight, eps=1e-5, zero_centered_gamma: bool = False, residual=None):
    """RMSNorm of x [..., H] (float32/float16/bfloat16) with weight [H] (any float dtype):
    y = x / sqrt(mean(x^2, -1) + eps) * gamma, gamma = weight, or 1 + weight with
    zero_centered_gamma, as fusedloss.rms_norm computes it. Returns y in x's dtype and shape.

    eps: 1e-5 by default; None takes torch.nn.RMSNorm's default, the float32 epsilon 2^-23.
    With residual (x's shape and dtype): s = x + residual (rounded to x's dtype), y = rmsnorm(s);
    returns (y, s), both differentiable. Math in fp32; gradients in each input's dtype, the
    weight's deterministic.
    """
    require_values(x, "x")
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"x: got shape {tuple(x.shape)}, expected [..., H] with H >= 1 "
                         "([T, H] or [s, b, H])")
    hidden = x.shape[-1]
    require_float_aux(weight, "weight")
    if tuple(weight.shape) != (hidden,):
        raise ValueError(f"weight: got shape {tuple(weight.shape)}, expected ({hidden},) = [H], "
                         "one weight per column of x")
    o = RmsOptions(_FLOAT32_EPS if eps is None else as_float(eps, "eps"),
                   as_bool(zero_centered_gamma, "zero_centered_gamma"))
    _ffi.validate_rms_norm(*o)
    w = _weight_for(weight, x.dtype)
    rows = x.reshape(-1, hidden)
    if residual is None:
        return _rms_norm(o, rows, w).reshape(x.shape)
    require_values(residual, "residual")
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual: got shape {tuple(residual.shape)} "
                         f"{np.dtype(residual.dtype).name}, expected x's {tuple(x.shape)} "
                         f"{np.dtype(x.dtype).name}")
    y, s = _rms_norm_residual(o, rows, w, residual.reshape(-1, hidden))
    return y.reshape(x.shape), s.reshape(x.shape)
