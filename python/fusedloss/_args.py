"""Plain-value arguments of the ops (ints, flags, choices, float options), checked with one set
of messages for every adapter: the PyTorch ops (through _views.py) and fusedloss.jax. No torch
and no jax here."""
import math
import operator
from typing import NamedTuple


def as_int(value, name):
    """An integer argument that fits int64: ints and integer-like objects (numpy, 0-d int
    tensors), never a float or bool truncated silently."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: got {value!r}, expected an int")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: got {value!r} ({type(value).__name__}), expected an int") from None
    if not -2**63 <= v < 2**63:
        raise ValueError(f"{name}: got {v}, expected an int64 value")
    return v


_F32_ZERO_BELOW = 2.0 ** -150  # magnitudes up to this round to 0 in float32
_F32_INF_FROM = 2.0 ** 128 * (1 - 2.0 ** -25)  # finite magnitudes from this round to inf


def fits_float32(value: float, name: str) -> float:
    """The options reach the kernels as float32: a value that would become 0 or inf there (a
    softcap of 1e-300 would silently switch it off) is refused with the value as passed."""
    magnitude = abs(value)
    if 0 < magnitude <= _F32_ZERO_BELOW:
        raise ValueError(f"{name}: got {value!r}, which is 0 in float32 (the kernels' precision), "
                         "expected 0 or a magnitude of at least 1.4e-45")
    if _F32_INF_FROM <= magnitude < math.inf:
        raise ValueError(f"{name}: got {value!r}, which is inf in float32 (the kernels' precision), "
                         "expected a magnitude of at most 3.4e38")
    return value


def as_bool(value, name):
    """A flag: True or False (numpy's bool too), never a string or a number taken for one."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise TypeError(f"{name}: got {value!r} ({type(value).__name__}), expected True or False")


def as_choice(value, name, allowed):
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name}: got {value!r}, expected one of {sorted(allowed)}")
    return allowed[value]


def choice_name(allowed, value):
    """as_choice's inverse: the name of `value` in `allowed` (the value itself if none)."""
    return next((k for k, v in allowed.items() if v == value), value)


class CeOptions(NamedTuple):
    """The cross-entropy's checked keyword options, as every adapter hands them to its kernels
    (the op schemas' first plain arguments, the FFI handlers' attributes); the linear
    cross-entropy's begin with them."""
    ignore_index: int
    label_smoothing: float
    formula: int
    scope: int
    z_loss: float
    reduction: int


def parse_ce_options(as_float, choices, ignore_index, label_smoothing, smoothing_formula,
                     smoothing_scope, reduction, z_loss, make=CeOptions):
    """The keyword options checked (types and choices; ranges are the core's, with the shapes):
    as_float is the adapter's (what a real number is differs between torch and jax), choices its
    (reductions, formulas, scopes) value maps, make the NamedTuple to build."""
    reductions, formulas, scopes = choices
    return make(as_int(ignore_index, "ignore_index"), as_float(label_smoothing, "label_smoothing"),
                as_choice(smoothing_formula, "smoothing_formula", formulas),
                as_choice(smoothing_scope, "smoothing_scope", scopes),
                as_float(z_loss, "z_loss"), as_choice(reduction, "reduction", reductions))


def swiglu_form(first, second, bias, arrays, array_name, op):
    """SwiGLU's positional arguments, as every adapter reads them: (up, bias), up None for the
    fused form swiglu(y, bias), an array for the two-tensor form swiglu(gate, up). The second is
    up when it has the first's shape, a bias when it is 1-D beside a first of 2 or more dims (a
    1-D y is no fused input); anything else is a mistake, named. arrays: the framework's array
    types; array_name: how its messages name one ("a torch.Tensor", "a jax.Array")."""
    if second is None:
        return None, bias
    if not isinstance(second, arrays) or not isinstance(first, arrays):
        what = second if not isinstance(second, arrays) else first
        arg = "second" if what is second else "first"
        plural = "tensors" if "Tensor" in array_name else "arrays"
        raise TypeError(f"{op}: {arg} argument: got {type(what).__name__}, expected {array_name}: "
                        "swiglu(y, bias) with y [..., 2n] = [gate | up] and bias [2n], or swiglu(gate, "
                        f"up) with two {plural} of one shape; the options go by keyword")
    a, b = tuple(first.shape), tuple(second.shape)
    if a == b:
        return second, bias
    if len(b) == 1 and len(a) >= 2:
        if bias is not None:
            raise TypeError(f"{op}: bias given twice, as the second argument {b} and as "
                            f"bias= {tuple(bias.shape)}")
        return None, second
    if len(a) == 1 and len(b) >= 2 and b[-1] == a[0]:
        raise ValueError(f"{op}: got a first argument of shape {a} and a second of shape {b}: "
                         "swapped? The fused form is swiglu(y, bias), y [..., 2n] first, then its "
                         "bias [2n]")
    hint = (" (a per-token scale [T, 1] goes by keyword: per_token_scale=)"
            if len(b) >= 2 and b[-1] == 1 and a[-1] != 1 else "")
    raise ValueError(f"up: got shape {b}, expected gate's shape {a} (swiglu(gate, up): the "
                     f"separate gate and up projections, one up value per gate value){hint}; the "
                     f"fused form's second argument is a bias of shape "
                     f"({2 * a[-1] if len(a) == 1 else a[-1]},) = [2n]")


def check_distillation_shapes(student_hidden, student_weight, teacher_hidden, teacher_weight,
                              target, slices: int = 1) -> tuple:
    """The distillation loss's shape rules, one set of messages for the PyTorch and JAX ops
    (each checks its operands' types and dtypes first): the teacher on the student's tokens and
    vocabulary, the targets (or None) in the tokens' shape; slices > 1: both hidden states are
    this rank's slice of the tokens along dim 0 and the targets cover every slice. Returns the
    shape of every token (the losses')."""
    shape = tuple(student_hidden.shape[:-1])
    if tuple(teacher_hidden.shape[:-1]) != shape:
        raise ValueError(f"teacher_hidden: got shape {tuple(teacher_hidden.shape)}, expected "
                         f"{shape} plus its hidden size (the student's tokens)")
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise ValueError(f"teacher_weight: got {teacher_weight.shape[0]} rows, expected "
                         f"{student_weight.shape[0]} (student_weight's vocabulary)")
    what = "student_hidden's shape without the hidden dim"
    if slices > 1:
        shape = (shape[0] * slices, *shape[1:]) if shape else shape
        what = f"the tokens of {slices} ranks' slices of student_hidden along dim 0"
    if target is not None and tuple(target.shape) != shape:
        raise ValueError(f"target: got shape {tuple(target.shape)}, expected {shape} ({what})")
    return shape
