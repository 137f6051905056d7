"""The eager ops' autograd nodes in C++ (python/src/torch_nodes/, libfusedloss_torch.so).

An eager call through a Python autograd node pays for the node in the interpreter on top of
the autograd engine's own round trip; the C++ nodes run the same views, kernels and guards
without it. The library is built against the torch of the Python that built the package and
loaded only under that same torch version; otherwise (a torch upgraded since, a build without
torch, or FUSEDLOSS_NATIVE_NODES=0) the Python nodes of _op.py serve, with the same results.

    ops       torch.ops.fusedloss, or None when the C++ nodes are not loaded
    status    why they are or are not loaded (one line)
"""
import ctypes
import os
import warnings

import torch

from . import _C

_HERE = os.path.dirname(os.path.abspath(__file__))
_LIBRARY = os.path.join(_HERE, "libfusedloss_torch.so")
_BUILT_FOR = os.path.join(_HERE, "torch_nodes_version.txt")


def _load():
    if os.environ.get("FUSEDLOSS_NATIVE_NODES", "1") == "0":
        return None, "off (FUSEDLOSS_NATIVE_NODES=0)"
    if not (os.path.exists(_LIBRARY) and os.path.exists(_BUILT_FOR)):
        return None, "not built (the package was built without torch: pip install --no-build-isolation .)"
    with open(_BUILT_FOR) as f:
        built_for = f.read().strip()
    if built_for != torch.__version__:
        return None, (f"built for torch {built_for}, running torch {torch.__version__}: "
                      "rebuild the package (pip install --no-build-isolation .)")
    try:
        torch.ops.load_library(_LIBRARY)
    except (OSError, RuntimeError) as error:  # a missing symbol, a registration refused
        return None, f"could not be loaded: {error}"
    # the nodes call _C's core (one copy in the process: its device error word, its caches)
    try:
        attach = ctypes.CDLL(_LIBRARY).fusedloss_torch_attach
        attach.argtypes = (ctypes.c_void_p, ctypes.c_uint32)
        attached = attach(_C._core_table(), _C._CORE_TABLE_SIZE) == 0
    except AttributeError:  # a library or a _C from before the table
        attached = False
    if not attached:
        return None, "built from another fusedloss than fusedloss._C (its core table differs): reinstall"
    return torch.ops.fusedloss, f"loaded ({_LIBRARY}, torch {built_for})"


def set_scratch(source: str) -> None:
    """fusedloss.set_scratch_allocator (see there)."""
    if source not in ("torch", "cuda"):
        raise ValueError(f"source: got {source!r}, expected 'torch' (torch's caching allocator) "
                         "or 'cuda' (cudaMallocAsync)")
    if ops is None:
        if source == "cuda":
            return  # what the core does unless told otherwise
        raise RuntimeError(f"fusedloss.set_scratch_allocator('torch'): needs the C++ nodes' library, "
                           f"which is {status}")
    if ctypes.CDLL(_LIBRARY).fusedloss_torch_scratch(int(source == "torch")) != 0:
        raise RuntimeError(f"fusedloss.set_scratch_allocator({source!r}): the C++ nodes' library "
                           "has no core attached")
    global scratch
    scratch = source


scratch = "cuda"  # where the core's CUDA scratch comes from (set_scratch)


ops, status = _load()
if ops is None and os.path.exists(_LIBRARY) and not status.startswith("off"):
    # built, yet unusable here: the same results through the Python nodes, more host time a call
    warnings.warn(f"fusedloss: the C++ autograd nodes are {status}; using the Python nodes")


def _scratch_from_environment():
    """FUSEDLOSS_SCRATCH, else "torch" where the C++ nodes load, when the op modules first import
    this module (on the first use of an op: `import fusedloss` alone imports no torch). A name
    set_scratch_allocator does not know fails that import; FUSEDLOSS_SCRATCH=torch where the C++
    nodes cannot load warns and keeps cudaMallocAsync (the ops still work)."""
    source = os.environ.get("FUSEDLOSS_SCRATCH")
    if not source:
        if ops is not None:
            try:
                set_scratch("torch")
            except RuntimeError as error:  # the ops work on, their scratch from cudaMallocAsync
                warnings.warn(f"fusedloss: {error}; the scratch comes from cudaMallocAsync")
        return
    try:
        set_scratch(source)
    except ValueError as error:
        raise ValueError(f"FUSEDLOSS_SCRATCH: {error}") from None
    except RuntimeError as error:
        warnings.warn(f"FUSEDLOSS_SCRATCH={source}: {error}; the scratch comes from cudaMallocAsync")


_scratch_from_environment()
