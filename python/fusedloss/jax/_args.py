"""The arguments of fusedloss.jax's ops, checked at trace time with the PyTorch ops' messages
(the argument, the value, what was expected): arrays by shape and dtype here, plain options by
fusedloss/_args.py, ranges by the core's validators (_ffi.py)."""
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from .._args import CeOptions as _CeOptions
from .._args import parse_ce_options as _parse_ce_options
from .._args import as_bool, as_choice, as_int, fits_float32  # noqa: F401 (re-exported)

# The C++ enums (include/fusedloss/options.h, types.h) as the handlers take them.
REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}
FORMULAS = {"pytorch": 0, "megatron": 1}
SCOPES = {"global": 0, "partition": 1}
DTYPES = {np.dtype(jnp.float32): 0, np.dtype(jnp.float16): 1, np.dtype(jnp.bfloat16): 2}
NONE = REDUCTIONS["none"]


class CeOptions(_CeOptions):
    """The cross-entropy's options as the handlers take them (hashable: custom_vjp's static
    argument); the linear cross-entropy's begin with them."""
    __slots__ = ()

    def attributes(self, vocab_global: int = -1) -> dict:
        """The handlers' attributes; vocab_global > 0: a vocab-parallel call (targets renumbered)."""
        return dict(ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
                    smoothing_formula=self.formula, smoothing_scope=self.scope,
                    z_loss=self.z_loss, reduction=self.reduction, vocab_global=vocab_global)


def as_float(value, name):
    """A real number (int, float, numpy scalar, concrete 0-d array) that float32 represents as
    nonzero and finite when it is; a traced value is refused: options are static."""
    if type(value) is float:
        return fits_float32(value, name)
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"{name}: got a traced value, expected a real number (options are static: "
                        "pass a Python float, not an array computed under jit or grad)")
    complex_like = isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real)
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        complex_like = complex_like or np.issubdtype(value.dtype, np.complexfloating) or value.shape != ()
    if isinstance(value, (bool, str)) or complex_like or not hasattr(value, "__float__"):
        raise TypeError(f"{name}: got {value!r} ({type(value).__name__}), expected a real number")
    return fits_float32(float(value), name)


@functools.lru_cache(maxsize=256)
def _parse_ce(ignore_index, label_smoothing, smoothing_formula, smoothing_scope, reduction, z_loss):
    return _parse_ce_options(as_float, (REDUCTIONS, FORMULAS, SCOPES), ignore_index,
                             label_smoothing, smoothing_formula, smoothing_scope, reduction, z_loss,
                             make=CeOptions)


def parse_ce_options(ignore_index, label_smoothing, smoothing_formula, smoothing_scope, reduction,
                     z_loss) -> CeOptions:
    """The cross-entropy's keyword options, types and choices checked here (ranges by the core,
    with the shapes)."""
    options = (ignore_index, label_smoothing, smoothing_formula, smoothing_scope, reduction, z_loss)
    try:
        return _parse_ce(*options)
    except TypeError as error:
        if "unhashable" not in str(error):
            raise
    return _parse_ce.__wrapped__(*options)


def require_array(x, name):
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise TypeError(f"{name}: got {type(x).__name__}, expected a jax.Array")
    return x


def require_values(x, name):
    """An array the kernels read as values: float32, float16 or bfloat16."""
    require_array(x, name)
    if np.dtype(x.dtype) not in DTYPES:
        raise ValueError(f"{name}.dtype: got {np.dtype(x.dtype).name}, expected float32, float16 "
                         "or bfloat16")
    return x


def require_float_aux(x, name):
    """An auxiliary float array (bias, scale): any floating dtype, computed with in fp32."""
    require_array(x, name)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}.dtype: got {np.dtype(x.dtype).name}, expected a floating-point dtype")
    return x


_INDEX_DTYPES = frozenset(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8,
                                                  np.uint16, np.uint32))


def require_targets(target, ref, shape_note, shape=None):
    """Class-index targets beside `ref` (logits or hidden states): one per row, in ref's shape
    without its last dim (or `shape`), an index dtype."""
    require_array(target, "target")
    expected = tuple(ref.shape[:-1]) if shape is None else tuple(shape)
    if tuple(target.shape) != expected:
        raise ValueError(f"target: got shape {tuple(target.shape)}, expected {expected} "
                         f"({shape_note})")
    if np.dtype(target.dtype) not in _INDEX_DTYPES:
        raise ValueError(f"target.dtype: got {np.dtype(target.dtype).name}, expected an integer "
                         "dtype (class indices; signed, or uint8/uint16/uint32)")


def index(target):
    """Class indices as the kernels read them: flat int32 (int64 kept where x64 is on)."""
    t = target.reshape(-1)
    return t if t.dtype in (jnp.int32, jnp.int64) else t.astype(jnp.int32)


def loss_results(rows: int, reduction: int):
    """A forward's results: the loss ([rows] or a scalar), lse [rows] and the valid count, fp32."""
    return [((rows,) if reduction == NONE else (), jnp.float32), ((rows,), jnp.float32),
            ((), jnp.float32)]


def validate_head_operands(hidden, weight, names=("hidden", "weight")):
    """An LM head's operands, as the JAX heads take them: hidden [N, H] or [s, b, H] and weight
    [V_local, H] in one float dtype; `names`: the arguments' names in the messages."""
    h, w = names
    require_values(hidden, h)
    require_values(weight, w)
    if hidden.ndim not in (2, 3) or hidden.shape[-1] == 0:
        raise ValueError(f"{h}: got shape {tuple(hidden.shape)}, expected a 2-D [N, H] or 3-D "
                         "[s, b, H] tensor with H >= 1")
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"{w}: got shape {tuple(weight.shape)}, expected [V_local, "
                         f"{hidden.shape[-1]}] (V_local >= 1, H = {h}.shape[-1])")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"{w}.dtype: got {np.dtype(weight.dtype).name}, expected "
                         f"{np.dtype(hidden.dtype).name} ({h}'s dtype)")


def allows_tf32() -> bool:
    """fp32 GEMMs on TF32 tensor cores where JAX's own matmuls may use them (its default
    precision), not under jax.default_matmul_precision('highest' / 'float32')."""
    precision = jax.config.jax_default_matmul_precision
    return str(precision).lower() not in ("highest", "float32", "precision.highest")
