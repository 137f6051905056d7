"""fusedloss: fused, tensor-parallel-aware CUDA C++ kernels for LLM training: cross-entropy,
linear cross-entropy, SwiGLU and RMSNorm, as PyTorch ops (CPU and CUDA tensors, autograd,
torch.compile), a C++ API and a Megatron-core patch.

    fusedloss.cross_entropy(logits, target, ...)   loss without a [N, V] softmax or grad buffer
    fusedloss.linear_cross_entropy(hidden, weight, target, ...)   LM head + loss, no [N, V] logits
    fusedloss.linear_log_probs(hidden, weight, tokens, ...)   RL head: log-probs, entropy, arg-max
    fusedloss.linear_distillation_loss(student_hidden, student_weight, teacher_hidden,
                                       teacher_weight, target=None, ...)   KD without logits
    fusedloss.swiglu(y, bias=None, ...)            SwiGLU over Megatron's fused gate-up layout
    fusedloss.swiglu(gate, up, ...)                the same over separate gate and up projections
    fusedloss.rms_norm(x, weight, eps=1e-5, ...)   RMSNorm (+ fused residual add), deterministic dw
    fusedloss.rms_norm(x, normalized_shape, weight=None, eps=None)   F.rms_norm's call
    fusedloss.huggingface.apply_fusedloss(model)   transformers' Llama, Qwen, Mistral, Gemma
    fusedloss.megatron.apply_fusedloss_to_megatron(...)   the one-line Megatron-core patch

    python -m fusedloss --info                     what this build has (backends, communicators)
"""
import sys as _sys
import types as _types
from os import path as _path

from . import _C

# One version for the package and its C++ SDK: CMake's project() version, compiled into _C
# (FUSEDLOSS_VERSION), the same as the distribution's and as find_package's fusedloss_VERSION.
__version__ = _C.__version__
# The C++ SDK shipped inside this package: this directory is its install prefix (include/,
# lib/libfusedloss.a, lib/cmake/fusedloss/). Two ways to point CMake at it, both followed by
# find_package(fusedloss):
#   cmake_prefix_path  the prefix, for -DCMAKE_PREFIX_PATH=...   (python -m fusedloss --cmake-prefix-path)
#   cmake_dir          the folder of fusedlossConfig.cmake, for -Dfusedloss_DIR=...
#                                                                 (python -m fusedloss --cmake-dir)
cmake_prefix_path = _path.dirname(_path.abspath(__file__))
cmake_dir = _path.join(cmake_prefix_path, "lib", "cmake", "fusedloss")
__all__ = ["cross_entropy", "CrossEntropyLoss", "CrossEntropyOutput", "linear_cross_entropy", "swiglu", "SwiGLU", "rms_norm", "RMSNorm",
           "linear_log_probs", "LogProbs", "linear_distillation_loss",
           "check_device_errors", "set_scratch_allocator", "build_info"]


def build_info() -> dict:
    """What this build of the package has, as written by CMake when it was built: "version",
    "backends" ({"CPU": True, "CUDA": bool}), "cuda_version", "cuda_architectures" (the
    CMAKE_CUDA_ARCHITECTURES the kernels were compiled for), "openmp", "cpu_blas" (whether the
    CPU backend's GEMMs run through a BLAS, else plain loops) and "blas_libraries" (the BLAS
    linked, as CMake found it), "cpu_bf16_dnnl" and "dnnl_version" (whether its bf16 GEMMs run
    through oneDNN where the CPU has bf16 dot products, and which), "communicators" ({"NCCL":
    bool, "MPI": bool}: the C++ SDK's; the PyTorch ops run vocab-parallel over torch.distributed
    either way), "cpu_library" (whether the SDK has fusedloss::cpu, the CPU backend alone for
    consumers without the CUDA toolkit). `python -m fusedloss --info` prints it."""
    from .__main__ import read_build_info
    return read_build_info()


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
    FUSEDLOSS_SCRATCH=torch|cuda sets it when the ops first load. "torch" needs the C++ nodes
    (fusedloss._native.status; FUSEDLOSS_NATIVE_NODES=0 leaves the scratch in cudaMallocAsync)."""
    from . import _native
    _native.set_scratch(source)


def check_device_errors(device=None):
    """Synchronises the current CUDA stream and raises ValueError naming the first error the
    kernels met since the last call (CUDA defers these reports to avoid host syncs): an
    out-of-range target, or an upstream gradient that is not c * loss_mask for a
    linear_cross_entropy whose forward computed the masked gradients."""
    import torch
    if torch.cuda.is_available():
        _C.check_device_errors(torch.cuda.current_stream(device).cuda_stream)


# The PyTorch ops load with torch on the first use of one of the package's names (PEP 562), so
# that `import fusedloss` and fusedloss.jax do not import torch. The op modules load the C++
# nodes and set the scratch allocator (_native.py) on their import, whichever route imports them.
_TORCH_API = {"cross_entropy": ("CrossEntropyLoss", "CrossEntropyOutput", "cross_entropy"),
              "linear_cross_entropy": ("linear_cross_entropy",),
              "linear_log_probs": ("LogProbs", "linear_log_probs"),
              "linear_distillation": ("linear_distillation_loss",),
              "rms_norm": ("RMSNorm", "rms_norm"),
              "swiglu": ("SwiGLU", "swiglu")}
_NOT_TORCH = frozenset(("jax",))  # subpackages that must not pull torch in when asked for


def _load_torch_api():
    import importlib
    for module, names in _TORCH_API.items():
        loaded = importlib.import_module(f".{module}", __name__)
        for name in names:
            globals()[name] = getattr(loaded, name)


def __getattr__(name):
    if name.startswith("__") or name in _NOT_TORCH:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _load_torch_api()
    try:
        return globals()[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


class _Package(_types.ModuleType):
    """The import system binds a submodule to its package's attribute: the op modules share
    their names with their ops, and the ops keep those names (fusedloss.cross_entropy is the
    function whichever module was imported first)."""

    def __setattr__(self, name, value):
        if name in _TORCH_API and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
# A process that has torch already gets the ops at import, as before (their torch.ops
# registrations included, which code may look up without naming fusedloss's functions).
if "torch" in _sys.modules:
    _load_torch_api()
