"""Tensors -> fusedloss._C views: the one place that knows what the kernels can read as is,
what must be copied, and when a gradient may be written into an input's storage.

The kernels read a matrix as `rows` rows of `cols` contiguous elements, `row_stride` apart, with
row_stride >= cols (rows never overlap), and vectors as contiguous runs. Any other layout torch
allows (expanded/stride-0 rows, transposes, step slices, overlapping `as_strided` views) is
copied here first; auxiliary tensors (bias, scales, grad_output, targets) are small and always
made contiguous in the dtype the kernel computes with.
"""
import functools
import numbers
import os
import sys
import types
import warnings

import torch
from torch import Tensor

from . import _C
from ._args import as_bool, as_choice, as_int, choice_name
from ._args import fits_float32 as _fits_float32

_DTYPES = {
    torch.float32: _C.DType.F32,
    torch.float16: _C.DType.F16,
    torch.bfloat16: _C.DType.BF16,
    torch.float8_e4m3fn: _C.DType.FP8_E4M3,
}
VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX = {torch.int32: _C.IndexType.I32, torch.int64: _C.IndexType.I64}
_CPU, _CUDA = _C.Device.CPU, _C.Device.CUDA


# ---- arguments ----

def require_tensor(t, name):
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    if type(t) is not Tensor and hasattr(t, "to_local") and hasattr(t, "device_mesh"):
        # a DTensor's own storage is empty: its data is the local shard
        raise TypeError(f"{name}: got a {type(t).__name__}, expected a plain torch.Tensor: pass "
                        f"{name}.to_local(), this rank's shard (a vocabulary split over ranks "
                        "goes with tp_group=, the ranks' process group)")
    if not (t.is_cpu or t.is_cuda):
        raise ValueError(f"{name}.device: got {t.device}, expected a cpu or cuda tensor")
    if t.layout != torch.strided:
        raise ValueError(f"{name}.layout: got {t.layout}, expected torch.strided (a dense tensor)")
    return t


def agreement_flag(value):
    """(check_shard_agreement as a bool, or True; the TypeError to raise inside the agreement or
    None): a bad flag on one rank must not leave that rank to raise alone before the others
    reach the agreement."""
    try:
        return as_bool(value, "check_shard_agreement"), None
    except TypeError as error:
        return True, error


def require_values(t, name):
    """A tensor the kernels read as values: fp32, fp16 or bf16."""
    require_tensor(t, name)
    if t.dtype not in VALUE_DTYPES:
        raise ValueError(f"{name}.dtype: got {t.dtype}, expected torch.float32, torch.float16 or "
                         "torch.bfloat16")
    return t


def require_float_aux(t, name):
    """An auxiliary float tensor (bias, scale): any floating dtype, computed with in fp32."""
    require_tensor(t, name)
    if not t.dtype.is_floating_point:
        raise ValueError(f"{name}.dtype: got {t.dtype}, expected a floating-point dtype")
    return t


# Class-index dtypes: those whose every value fits int64 and that index() can widen to it. An
# allow-list: torch has integer-like dtypes that cannot be converted (bits8, int4, qint8, ...),
# and a refusal later, in index(), would come after the TP agreement.
_INDEX_DTYPES = frozenset((torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                           getattr(torch, "uint16", torch.int64), getattr(torch, "uint32", torch.int64)))


def require_index_dtype(t, name):
    """Class indices: signed integers, or uint8/uint16/uint32 (uint64's may not fit int64)."""
    if t.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name}.dtype: got {t.dtype}, expected an integer dtype (class indices; "
                         "signed, or uint8/uint16/uint32)")
    return t


def require_same_device(t, name, ref, ref_name):
    if t.device != ref.device:
        raise ValueError(f"{name}.device: got {t.device}, expected {ref.device} ({ref_name}'s device)")


def require_targets(target, ref, ref_name, shape_note, shape=None):
    """Class-index targets beside `ref` (logits or hidden states): one per row, in ref's shape
    without its last dim (or `shape`), an index dtype, ref's device. shape_note says what that
    shape is."""
    expected = tuple(ref.shape[:-1]) if shape is None else tuple(shape)
    if tuple(target.shape) != expected:
        raise ValueError(f"target: got shape {tuple(target.shape)}, expected {expected} "
                         f"({shape_note})")
    require_index_dtype(target, "target")
    require_same_device(target, "target", ref, ref_name)


def validated(validate, *args) -> None:
    """Runs a C++ options validator; its message names the field without the C++ struct's
    "options." prefix (Python callers know the keyword), as the C++ nodes' core_call does."""
    try:
        validate(*args)
    except _C.Error as e:
        message = str(e)
        raise _C.Error(message.removeprefix("options.")) from None


def as_float(value, name):
    """A real number (int, float, numpy scalar, 0-d real tensor) that float32 represents as
    nonzero and finite when it is; never a string, a bool or a complex value losing its
    imaginary part."""
    if type(value) is float:  # the common case, taken as is (float(value) is value)
        return _fits_float32(value, name)
    complex_like = (isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real)) or (
        isinstance(value, Tensor) and (value.is_complex() or value.numel() != 1))
    if isinstance(value, (bool, str)) or complex_like or not hasattr(value, "__float__"):
        raise TypeError(f"{name}: got {value!r} ({type(value).__name__}), expected a real number")
    if isinstance(value, Tensor) and value.requires_grad:  # read as a number: no gradient for it
        raise TypeError(f"{name}: got a tensor that requires grad, expected a real number (it is "
                        "read as a constant; pass a float, or .item() / .detach() it)")
    try:
        return _fits_float32(float(value), name)
    except OverflowError:
        raise ValueError(f"{name}: got an integer too large for a float ({str(value)[:20]}...), "
                         "expected a real number") from None


_PLAIN = frozenset((int, float, str, bool, type(None)))


def parsed_once(parse):
    """parse(*options) of an op's keyword options, run once per distinct combination of plain
    Python values (typed: True and 1 are different arguments, one of them may be refused): the
    parsing costs more host time than the rest of a small call, and adapters such as the
    Megatron patch pass the same options every step. Anything else (a tensor, a numpy scalar, a
    traced call) is parsed every time; a call that raises is never cached."""
    cached = functools.lru_cache(maxsize=64, typed=True)(parse)

    @functools.wraps(parse)
    def parsed(*options):
        if _PLAIN.issuperset(map(type, options)) and not torch.compiler.is_compiling():
            return cached(*options)
        return parse(*options)
    return parsed


# ---- layouts ----

def _rows_view(t):
    """[rows, cols] over t's own memory when the kernels can read it as is, else None."""
    shape, strides = t.shape, t.stride()
    cols = shape[-1]
    if strides[-1] != 1 and cols > 1:
        return None
    if len(shape) == 2 and cols:  # already [rows, cols]: t itself (a view costs host time)
        r, rows, row_stride = t, shape[0], strides[0]
    else:
        try:
            r = t.view(-1, cols)
        except RuntimeError:  # leading dims not flattenable without a copy
            return None
        rows, row_stride = r.shape[0], r.stride()[0]
    if rows > 1 and row_stride < cols:  # overlapping (expanded / as_strided) rows
        return None
    return r


def rows_of(t):
    """t as [rows, cols] rows the kernels can read: a view when possible, else a copy."""
    r = _rows_view(t)
    return r if r is not None else t.contiguous().view(-1, t.size(-1))


def storage_is_ours(t: Tensor) -> bool:
    """Whether a gradient may overwrite t's memory: t must be an autograd intermediate (not a
    leaf, and not a view of one: `param[:]`, `x.view(...)` of a user tensor) whose rows the
    kernels can address in place (a copy would receive the gradient instead)."""
    base = t._base if t._base is not None else t
    return not t.is_leaf and not base.is_leaf and _rows_view(t) is not None


# inplace_refused's ctx for an eager call through a C++ node (no Python ctx to read)
EAGER_CALL = types.SimpleNamespace(traced=False)


def inplace_refused(ctx, t: Tensor, op: str, arg: str, flag: str) -> bool:
    """True when the in-place gradient must go to a new buffer instead: always on the traced
    path (ctx.traced, see _op.py), else when t's memory is not ours, with a warning pointing at
    the caller's line."""
    if ctx.traced:
        return True
    if storage_is_ours(t):
        return False
    base = t._base if t._base is not None else t
    why = ("it is a leaf tensor, or a view of one, whose values the caller still owns"
           if t.is_leaf or base.is_leaf else
           "its layout cannot be addressed in place (the kernels read a copy of it)")
    warnings.warn(f"{op}: {flag}=True, but {arg} is not overwritten: {why}; its gradient goes "
                  "to a new buffer", stacklevel=_caller_stacklevel())
    return True


def _caller_stacklevel() -> int:
    """warnings.warn's stacklevel for the first frame outside fusedloss and torch, from the
    function that calls warnings.warn: the caller's line, so Python's once-per-location filter
    shows the warning once per call site."""
    level, frame = 2, sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


_INTERNAL = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__)))


def byte_range(t):
    """[first, last] byte address of t's elements (a tensor with elements)."""
    last = 0
    for n, st in zip(t.shape, t.stride()):  # (a loop: a generator costs more for so few dims)
        if n > 0:
            last += (n - 1) * st
    first = t.data_ptr()
    return first, first + (last + 1) * t.element_size() - 1


def shares_memory(a, b) -> bool:
    """Whether the address ranges of a's and b's elements meet (same device, both non-empty)."""
    if not a.numel() or not b.numel() or a.device != b.device:
        return False
    a_first, a_last = byte_range(a)
    b_first, b_last = byte_range(b)
    return a_first <= b_last and b_first <= a_last


def apart_from(t, written):
    """t, or a copy of it when it shares memory with `written`: for an auxiliary input (target,
    bias, scale, upstream gradient) that a kernel reads while it overwrites `written` in place.
    A caller may pass views of one storage as both; the copy keeps the values it passed."""
    return t.clone() if t is not None and shares_memory(t, written) else t


def as_dtype(t, dtype):
    """t.to(dtype), without the dispatch (host time) when t has that dtype: to() returns t then."""
    return t if t.dtype == dtype else t.to(dtype)


class _Cast(torch.autograd.Function):
    """t.to(dtype) whose backward hands a gradient expanded from one element (the zeros an op
    gives autograd when it adds the true gradient to an accumulator itself) back expanded, where
    Tensor.to's backward would materialise it: an fp32 [V, H] of zeros for a head's weight."""

    @staticmethod
    def forward(ctx, t, dtype):
        ctx.source = t.dtype
        return t.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        if grad.dim() and not any(grad.stride()):
            return grad[(0,) * grad.dim()].to(ctx.source).expand(grad.shape), None
        return grad.to(ctx.source), None


def autocast_operands(*tensors, expanded_grads=False):
    """The operands of a matrix product as torch.autocast hands them to F.linear: where autocast
    is on for their device type, floating tensors other than float64 in its dtype (a cast that
    autograd differentiates back to each tensor's own dtype; with expanded_grads, one that keeps
    a gradient expanded from one element so), else as they are. Anything not a tensor is
    returned as it is, for the argument checks to name."""
    first = tensors[0]
    if not isinstance(first, Tensor) or not _autocast_on(first.device.type):
        return tensors
    dtype = torch.get_autocast_dtype(first.device.type)
    cast = (lambda t: _Cast.apply(t, dtype)) if expanded_grads else (lambda t: t.to(dtype))
    return tuple(cast(t) if isinstance(t, Tensor) and autocast_dtype(t, first) != t.dtype else t
                 for t in tensors)


def _autocast_on(device_type: str) -> bool:
    """Whether torch.autocast is on for the device type; False for a type autocast does not
    know (meta), which the argument checks then name."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False


def autocast_dtype(t, first=None):
    """The dtype autocast_operands gives t, an operand beside `first` (t itself by default),
    without casting it."""
    first = t if first is None else first
    if not _autocast_on(first.device.type):
        return t.dtype
    dtype = torch.get_autocast_dtype(first.device.type)
    return (dtype if t.is_floating_point() and t.dtype != torch.float64
            and t.device.type == first.device.type else t.dtype)


def values_in(t, dtype):
    """A small auxiliary tensor (bias, scale, grad_output) contiguous in `dtype`."""
    return as_dtype(t, dtype).contiguous()


# ---- C++ views ----

def device_of(t):
    return _CUDA if t.is_cuda else _CPU


def stream_of(t):
    """The current stream of t's device as an integer handle (0 for CPU)."""
    return _current_raw_stream(t.get_device()) if t.is_cuda else 0


try:  # torch.cuda.current_stream(i).cuda_stream without building a Stream object per call
    from torch._C import _cuda_getCurrentRawStream as _current_raw_stream
except ImportError:  # a torch without it
    def _current_raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream


def matrix(t):
    """The C++ view of a [rows, cols] tensor from rows_of() (or one allocated contiguous)."""
    rows, cols = t.shape
    strides = t.stride()
    stride = strides[0] if rows > 1 else cols  # a single row's stride is never used
    if rows and ((strides[1] != 1 and cols > 1) or stride < cols):
        raise AssertionError(f"fusedloss internal: unreadable layout {tuple(t.shape)} {strides}")
    return _C.MatrixView(t.data_ptr(), rows, cols, stride, _DTYPES[t.dtype], device_of(t))


def index(t, name):
    """Class indices as the kernels read them, a vector of int32/int64 (other integer dtypes are
    widened): (a contiguous tensor of them, in t's shape or flattened, to keep alive while the
    kernel runs; its view)."""
    if t.dtype not in _INDEX:
        require_index_dtype(t, name)
        t = t.to(torch.int64)
    if not t.is_contiguous():  # (a contiguous one is its own flat vector: no reshape to pay for)
        t = t.reshape(-1).contiguous()
    return t, _C.IndexView(t.data_ptr(), t.numel(), _INDEX[t.dtype], device_of(t))


def vector(t):
    """A contiguous vector; None is "absent"."""
    if t is None:
        return _NO_VECTOR
    return _C.VectorView(t.data_ptr(), t.numel(), _DTYPES[t.dtype], device_of(t))


# "absent": one object for every call (the views are immutable from Python, read as const)
_NO_VECTOR = _C.VectorView()
