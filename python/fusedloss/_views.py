"""Tensor -> fusedloss._C view conversion, shared by the ops."""
import torch

from . import _C

_DTYPES = {
    torch.float32: _C.DType.F32,
    torch.float16: _C.DType.F16,
    torch.bfloat16: _C.DType.BF16,
    torch.float8_e4m3fn: _C.DType.FP8_E4M3,
}
_INDEX = {torch.int32: _C.IndexType.I32, torch.int64: _C.IndexType.I64}


_CPU, _CUDA = _C.Device.CPU, _C.Device.CUDA


def device_of(t):
    if t.is_cuda:
        return _CUDA
    if t.is_cpu:
        return _CPU
    raise ValueError(f"{t.device}: expected a cpu or cuda tensor")


def stream_of(t):
    """The current stream of t's device as an integer handle (0 for CPU)."""
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def check_float(t, name):
    """The dtypes a caller may pass as values (the e4m3 copy is internal)."""
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name}.dtype: got {t.dtype}, expected float32, float16 or bfloat16")


def check_index(t, name):
    if t.dtype not in _INDEX:
        raise ValueError(f"{name}.dtype: got {t.dtype}, expected torch.int32 or torch.int64")


def dtype_of(t, name):
    dt = _DTYPES.get(t.dtype)
    if dt is None:
        check_float(t, name)  # raises
    return dt


def matrix(t, name):
    """A [rows, cols] view of a 2-D tensor whose last dim is contiguous."""
    (rows, cols), (row_stride, col_stride) = t.shape, t.stride()
    assert col_stride == 1 or cols <= 1, name
    return _C.MatrixView(t.data_ptr(), rows, cols, max(row_stride, cols), dtype_of(t, name),
                         device_of(t))


def index(t, name):
    check_index(t, name)
    return _C.IndexView(t.data_ptr(), t.numel(), _INDEX[t.dtype], device_of(t))


def vector(t, name):
    if t is None:
        return _C.VectorView()
    return _C.VectorView(t.data_ptr(), t.numel(), dtype_of(t, name), device_of(t))


def as_rows(t, name):
    """Flatten leading dims to rows without copying when the layout allows it; copy when the
    last dim is strided (the kernels need contiguous columns)."""
    if t.dim() == 2 and (t.stride(1) == 1 or t.size(1) <= 1):
        return t
    if t.stride(-1) != 1 and t.size(-1) > 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.size(-1))
    except RuntimeError:
        return t.reshape(-1, t.size(-1))
