"""fusedloss.jax.swiglu: SwiGLU as jax.custom_vjps over XLA FFI calls, in the PyTorch op's two
forms through the same kernels: Megatron's fused gate-up layout y [..., 2n] = [gate | up], or the
separate gate and up projections (Hugging Face's and Liger's gate_proj(x), up_proj(x)).

    out = silu(m (gate + b_g)) * (up + b_u) * s * d

math in fp32, one handler call per pass; m and d are Falcon-H1's gate and down multipliers."""
import functools
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi
from ._args import as_bool, as_float, require_float_aux, require_values
from .._args import swiglu_form

_F32 = jnp.float32
_E4M3 = jnp.float8_e4m3fn
_OP = "fusedloss.swiglu"


class SwOptions(NamedTuple):
    """The static options (custom_vjp's nondiff argument)."""
    clamp_value: float  # 0: no clamp
    gate_multiplier: float
    down_multiplier: float
    fp8_store: bool  # the backward reads an e4m3 copy of the input, kept instead of it


@functools.lru_cache(maxsize=None)
def _jax_e4m3_saturates() -> bool:
    """Whether the running JAX's float8_e4m3fn cast gives +-448 past e4m3's range (else NaN):
    the fp8 input store rounds as the framework's own cast, as the PyTorch op follows torch's."""
    with jax.ensure_compile_time_eval():  # (asked while a caller's function is traced)
        cast = jnp.asarray(1e4, _F32).astype(_E4M3).astype(_F32)
    return bool(np.isfinite(np.asarray(cast)))


def _extras(bias, scale):
    return tuple(a for a in (bias, scale) if a is not None)


def _attributes(o: SwOptions, bias, scale, stored: bool = False):
    """stored: the call writes (forward) or reads (backward) the e4m3 copy."""
    return dict(clamp_value=o.clamp_value, gate_multiplier=o.gate_multiplier,
                down_multiplier=o.down_multiplier, has_bias=bias is not None,
                has_scale=scale is not None, fp8_store=stored,
                fp8_saturate=_jax_e4m3_saturates() if stored else True)


def _stored(o: SwOptions, rows, two_n):
    """The forward's e4m3 result where the input is stored so."""
    return [((rows, two_n), _E4M3)] if o.fp8_store else []


def _aux_results(rows, two_n, bias, scale):
    """The scale's and the bias' fp32 gradients, after the inputs' (the handlers' order)."""
    return ([((rows,), _F32)] if scale is not None else []) + \
        ([((two_n,), _F32)] if bias is not None else [])


def _aux_grads(rest, bias, scale):
    dscale = rest.pop(0) if scale is not None else None
    dbias = rest.pop(0).astype(bias.dtype) if bias is not None else None
    return dbias, dscale


# ---- the fused form: y [T, 2n] ----

def _fused_forward(o, y, bias, scale, stored):
    rows, cols = y.shape
    results = [((rows, cols // 2), y.dtype)] + (_stored(o, rows, cols) if stored else [])
    return _ffi.call("swiglu_forward", results, y, *_extras(bias, scale),
                     **_attributes(o, bias, scale, stored))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _swiglu(o, y, bias, scale):
    return _fused_forward(o, y, bias, scale, False)[0]


def _swiglu_fwd(o, y, bias, scale):
    out, *y8 = _fused_forward(o, y, bias, scale, o.fp8_store)
    return out, ((y8[0] if y8 else y), bias, scale)


def _swiglu_bwd(o, saved, g):
    y, bias, scale = saved  # y: the input, or its e4m3 copy (the fp8 store)
    rows, cols = y.shape
    dy, *rest = _ffi.call("swiglu_backward", [(y.shape, g.dtype)] +
                          _aux_results(rows, cols, bias, scale), g, y, *_extras(bias, scale),
                          **_attributes(o, bias, scale, o.fp8_store))
    return (dy, *_aux_grads(rest, bias, scale))


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


# ---- the two-tensor form: gate [T, n] and up [T, n] ----

def _gate_up_forward(o, gate, up, bias, scale, stored):
    rows, n = gate.shape
    results = [(gate.shape, gate.dtype)] + (_stored(o, rows, 2 * n) if stored else [])
    return _ffi.call("swiglu_gate_up_forward", results, gate, up, *_extras(bias, scale),
                     **_attributes(o, bias, scale, stored))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _swiglu_gate_up(o, gate, up, bias, scale):
    return _gate_up_forward(o, gate, up, bias, scale, False)[0]


def _swiglu_gate_up_fwd(o, gate, up, bias, scale):
    out, *in8 = _gate_up_forward(o, gate, up, bias, scale, o.fp8_store)
    # the fp8 store: [gate | up] in e4m3, one array, in place of both
    return out, ((in8[0],) if in8 else (gate, up), bias, scale)


def _swiglu_gate_up_bwd(o, saved, g):
    inputs, bias, scale = saved
    rows, n = g.shape
    dgate, dup, *rest = _ffi.call(
        "swiglu_gate_up_backward", [(g.shape, g.dtype)] * 2 +
        _aux_results(rows, 2 * n, bias, scale), g, *inputs, *_extras(bias, scale),
        **_attributes(o, bias, scale, o.fp8_store))
    return (dgate, dup, *_aux_grads(rest, bias, scale))


_swiglu_gate_up.defvjp(_swiglu_gate_up_fwd, _swiglu_gate_up_bwd)


# ---- arguments ----

def _form(first, second, bias):
    """(up, bias) from the positional arguments: fusedloss._args.swiglu_form."""
    return swiglu_form(first, second, bias, (jax.Array, np.ndarray), "a jax.Array", _OP)


def _aux(bias, per_token_scale, ref, ref_name, two_n, rows, bias_note, dtype):
    """bias and per_token_scale checked, as the kernels read them: (bias in the inputs' dtype
    or fp32, the scale flat fp32)."""
    b = s = None
    if bias is not None:
        require_float_aux(bias, "bias")
        if tuple(bias.shape) != (two_n,):
            raise ValueError(f"bias: got shape {tuple(bias.shape)}, expected ({two_n},) = [2n]"
                             f"{bias_note}")
        b = bias if bias.dtype == dtype else bias.astype(_F32)
    if per_token_scale is not None:
        require_float_aux(per_token_scale, "per_token_scale")
        # [T, 1] or the input's shape with a last dim of 1: the shapes whose flattening is its
        # row order
        if tuple(per_token_scale.shape) not in ((rows, 1), (*ref.shape[:-1], 1)):
            raise ValueError(f"per_token_scale: got shape {tuple(per_token_scale.shape)}, expected "
                             f"({rows}, 1) = [T, 1] or {(*ref.shape[:-1], 1)} ({ref_name}'s shape "
                             f"with a last dim of 1), one scale per row of {ref_name}")
        s = per_token_scale.reshape(-1).astype(_F32)
    return b, s


def _options(clamp_value, gate_multiplier, down_multiplier, fp8_input_store) -> SwOptions:
    c = None if clamp_value is None else as_float(clamp_value, "clamp_value")
    m = as_float(gate_multiplier, "gate_multiplier")
    d = as_float(down_multiplier, "down_multiplier")
    _ffi.validate_swiglu(c, m, d)
    return SwOptions(c or 0.0, m, d, as_bool(fp8_input_store, "fp8_input_store"))


def swiglu(y_or_gate, up_or_bias=None, /, *, bias=None, per_token_scale=None, clamp_value=None,
           gate_multiplier: float = 1.0, down_multiplier: float = 1.0,
           fp8_input_store: bool = False):
    """silu(gate) * up, as fusedloss.swiglu computes it, in its two forms (float32/float16/
    bfloat16):

    - swiglu(y, bias=None): Megatron's fused buffer y [..., 2n] = [gate | up]; returns
      [..., n] in y's dtype.
    - swiglu(gate, up): the separate gate and up projections (act_fn(gate_proj(x)) *
      up_proj(x)), two arrays of one shape [..., n] and dtype; returns [..., n] with gradients
      for both. The kernels read each as it is (no [..., 2n] concatenation).

    The second positional argument is up when it has the first's shape, else the fused form's
    bias ([2n], 1-D); a swapped or mismatched pair raises naming what each form expects.

    bias [2n] (any float dtype) is added before the activation (two-tensor form: the gate's in
    [0, n), the up's in [n, 2n)); per_token_scale, one scale per row ([T, 1], or the input's
    shape with a last dim of 1; any float dtype), scales each row's output (MoE). Gradients come
    back in each array's own dtype and shape. clamp_value c applies Megatron's clamped SwiGLU
    (gate <= c, -c <= up <= c); the gradient is zero where a clamp is active, on the bound too
    (torch 2.15's rule; jnp.clip's gradient on the bound differs). gate_multiplier m and
    down_multiplier d are Falcon-H1's mlp_multipliers: silu(m (gate + b_g)) * (up + b_u) * d,
    the clamp applying to m (gate + b_g); static numbers, no gradient.

    fp8_input_store (Megatron's): the forward keeps an e4m3 copy of the input ([..., 2n]: y, or
    [gate | up]) for the backward instead of the input, which then computes from the rounded
    values; values past e4m3's range round as JAX's float8_e4m3fn cast gives them.
    """
    up, bias = _form(y_or_gate, up_or_bias, bias)
    o = _options(clamp_value, gate_multiplier, down_multiplier, fp8_input_store)
    if up is not None:
        return _two_tensors(y_or_gate, up, bias, per_token_scale, o)
    y = y_or_gate
    require_values(y, "y")
    if y.ndim < 2 or y.shape[-1] == 0 or y.shape[-1] % 2:
        raise ValueError(f"y: got shape {tuple(y.shape)}, expected [..., 2n] with n >= 1 (gate "
                         "columns [0, n), up columns [n, 2n)); for separate gate and up arrays "
                         "call swiglu(gate, up)")
    cols = y.shape[-1]
    rows = int(np.prod(y.shape[:-1]))
    b, s = _aux(bias, per_token_scale, y, "y", cols, rows, "", y.dtype)
    out = _swiglu(o, y.reshape(rows, cols), b, s)
    return out.reshape(*y.shape[:-1], cols // 2)


def _two_tensors(gate, up, bias, per_token_scale, o: SwOptions):
    require_values(gate, "gate")
    require_values(up, "up")
    if gate.ndim < 1 or gate.shape[-1] == 0:
        raise ValueError(f"gate: got shape {tuple(gate.shape)}, expected [..., n] with n >= 1")
    if up.dtype != gate.dtype:
        raise ValueError(f"up.dtype: got {np.dtype(up.dtype).name}, expected gate's "
                         f"{np.dtype(gate.dtype).name} (one dtype for both projections)")
    n = gate.shape[-1]
    rows = int(np.prod(gate.shape[:-1]))
    b, s = _aux(bias, per_token_scale, gate, "gate", 2 * n, rows,
                " (the gate's bias in [0, n), the up's in [n, 2n))", gate.dtype)
    out = _swiglu_gate_up(o, gate.reshape(rows, n), up.reshape(rows, n), b, s)
    return out.reshape(gate.shape)
