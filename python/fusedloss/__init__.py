"""fusedloss: fused, tensor-parallel-aware cross-entropy and SwiGLU kernels (CUDA C++).

    fusedloss.cross_entropy(logits, target, ...)   loss without a [N, V] softmax or grad buffer
    fusedloss.linear_cross_entropy(hidden, weight, target, ...)   LM head + loss, no [N, V] logits
    fusedloss.swiglu(y, bias=None, ...)            SwiGLU over Megatron's fused gate-up layout
    fusedloss.rms_norm(x, weight, eps=1e-5, ...)   RMSNorm (+ fused residual add), deterministic dw
    fusedloss.megatron.apply_fusedloss_to_megatron(...)   the one-line Megatron-core patch
"""
from os import path as _path

import torch

from . import _C
from .cross_entropy import CrossEntropyLoss, cross_entropy
from .linear_cross_entropy import linear_cross_entropy
from .rms_norm import RMSNorm, rms_norm
from .swiglu import SwiGLU, swiglu

__version__ = _C.__version__
# The C++ SDK shipped inside this package (include/, lib/libfusedloss.a, lib/cmake/fusedloss):
# cmake -DCMAKE_PREFIX_PATH=<this> finds it with find_package(fusedloss).
cmake_prefix_path = _path.join(_path.dirname(_path.abspath(__file__)), "lib", "cmake")
__all__ = ["cross_entropy", "CrossEntropyLoss", "linear_cross_entropy", "swiglu", "SwiGLU", "rms_norm", "RMSNorm",
           "check_device_errors", "set_scratch_allocator"]


def set_scratch_allocator(source: str) -> None:
    """Where the CUDA kernels take the memory they need only while a call runs (the linear
    cross-entropy's logits chunk buffer and cuBLASLt workspace: workspace_bytes together;
    per-row and per-block partial sums). "torch" (the default where the C++ nodes load) takes it
    from torch's caching allocator on the current stream: cached, and counted in
    torch.cuda.memory_allocated() and memory snapshots with the rest of torch's memory. "cuda"
    takes it from cudaMallocAsync's default pool, outside torch's statistics; that pool hands its
    free memory back at every synchronisation, so a large scratch is mapped again on the next
    call (about 0.3 ms of host time for the linear cross-entropy's 256 MiB on an H200). Under
    CUDA-graph capture the scratch comes from cudaMallocAsync either way, as does scratch for a
    stream other than the current one (the linear cross-entropy's side stream with
    FUSEDLOSS_LCE_BUFFERS=2). A block torch's cache has no memory for raises
    torch.OutOfMemoryError, as torch's own allocation would (within its memory fraction). torch keeps a freed block
    for the stream it was allocated on: each stream that runs the linear cross-entropy keeps its
    chunk buffer (workspace_bytes) cached until torch.cuda.empty_cache(). For the whole process;
    FUSEDLOSS_SCRATCH=torch|cuda sets it at import. "torch" needs the C++ nodes
    (fusedloss._native.status; FUSEDLOSS_NATIVE_NODES=0 leaves the scratch in cudaMallocAsync)."""
    from . import _native
    _native.set_scratch(source)


def _scratch_from_environment():
    """FUSEDLOSS_SCRATCH, else "torch" where the C++ nodes load. A name set_scratch_allocator
    does not know fails the import; FUSEDLOSS_SCRATCH=torch where the C++ nodes cannot load
    warns and keeps cudaMallocAsync (the ops still work)."""
    import os
    import warnings
    from . import _native
    source = os.environ.get("FUSEDLOSS_SCRATCH")
    if not source:
        if _native.ops is not None:
            try:
                set_scratch_allocator("torch")
            except RuntimeError as error:  # the ops work on, their scratch from cudaMallocAsync
                warnings.warn(f"fusedloss: {error}; the scratch comes from cudaMallocAsync")
        return
    try:
        set_scratch_allocator(source)
    except ValueError as error:
        raise ValueError(f"FUSEDLOSS_SCRATCH: {error}") from None
    except RuntimeError as error:
        warnings.warn(f"FUSEDLOSS_SCRATCH={source}: {error}; the scratch comes from cudaMallocAsync")


_scratch_from_environment()


def check_device_errors(device=None):
    """Synchronises the current CUDA stream and raises ValueError naming the first error the
    kernels met since the last call (CUDA defers these reports to avoid host syncs): an
    out-of-range target, or an upstream gradient that is not c * loss_mask for a
    linear_cross_entropy whose forward computed the masked gradients."""
    if torch.cuda.is_available():
        _C.check_device_errors(torch.cuda.current_stream(device).cuda_stream)
