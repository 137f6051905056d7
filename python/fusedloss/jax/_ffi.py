"""libfusedloss_jax (python/src/jax/ffi_handlers.cpp): the XLA FFI handlers of fusedloss.jax,
loaded with ctypes and registered with jax.ffi for XLA's host platform and, in a build with CUDA,
for CUDA; and the core's option checks and rules, asked at trace time.

    call(op, results, *args, **attrs)   one handler call (jax.ffi.ffi_call), under jit, vmap and
                                        shard_map alike
"""
import ctypes
import inspect
import os

import jax
import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
_LIBRARY = os.path.join(_HERE, "libfusedloss_jax.so")
_OPS = ("ce_forward", "ce_backward", "ce_local_stats", "ce_merge", "lce_forward",
        "lce_local_stats", "lce_backward", "lce_scale_rows", "lp_forward", "lp_backward",
        "lp_local_stats", "lp_merge", "distill_forward", "distill_backward", "distill_local_partials",
        "distill_merge", "distill_jsd_sums", "rms_norm_forward",
        "rms_norm_backward", "swiglu_forward", "swiglu_backward", "swiglu_gate_up_forward",
        "swiglu_gate_up_backward")


def _load():
    if not os.path.exists(_LIBRARY):
        raise ImportError(
            f"fusedloss.jax: {_LIBRARY} is missing: the package was built without jax. Build it "
            "where jax is installed (pip install --no-build-isolation . with jax in the "
            "environment, or -C cmake.define.FUSEDLOSS_JAX_INCLUDE_DIR=<jax.ffi.include_dir()>)")
    lib = ctypes.CDLL(_LIBRARY)
    platforms = {"cpu": "cpu"}
    if lib.fusedloss_jax_has_cuda():
        platforms["CUDA"] = "cuda"
    for op in _OPS:
        for platform, suffix in platforms.items():
            handler = getattr(lib, f"fusedloss_{op}_{suffix}")
            jax.ffi.register_ffi_target(f"fusedloss_{op}", jax.ffi.pycapsule(handler),
                                        platform=platform)
    return lib, tuple(platforms)


_lib, PLATFORMS = _load()


# ---- handler calls ----

def varying_axes(x) -> frozenset:
    """The mesh axes x varies over inside jax.shard_map (empty outside it, or without check_vma)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # newer JAX: the manual axis type
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def varying(x, axes):
    """x marked as varying over `axes` too (its gradient is then summed over them: pcast's
    transpose is a psum), as shard_map's type system needs where a value meets a shard's."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)


def call(op: str, results, *args, aliases=None, **attrs):
    """fusedloss_<op>(*args) -> results (shape, dtype) pairs, each without batch dims. Attributes
    are typed here as the handlers read them (ints: int64, floats: float32, flags: bool).

    Under jax.vmap the handler gets the batch dims in front of every buffer (expand_dims, see
    ffi_handlers.cpp). Under jax.shard_map with check_vma, XLA's custom call has no rule for the
    mesh axes its results vary over: they vary over every axis an argument varies over, and the
    arguments are all cast to that first (ffi_call requires them equal)."""
    axes = frozenset().union(*(varying_axes(a) for a in args))
    args = [varying(a, axes) for a in args]
    avals = [_result(shape, dtype, args[0]) for shape, dtype in results]
    typed = {k: _attribute(v) for k, v in attrs.items()}
    if aliases and any(type(a).__name__ == "BatchTracer" for a in args):
        # vmap batches the result but maybe not the aliased argument (a size-1 dim in front):
        # their shapes would differ, so the result gets a buffer of its own
        aliases = None
    return jax.ffi.ffi_call(f"fusedloss_{op}", avals, vmap_method="expand_dims",
                            input_output_aliases=aliases)(*args, **typed)


_RESULT_FIELDS = inspect.signature(jax.ShapeDtypeStruct).parameters


def _result(shape, dtype, like):
    """A result's shape and dtype, varying over the mesh axes `like` varies over (the field's name
    depends on the JAX release: manual_axis_type, or vma before it)."""
    aval = jax.typeof(like)
    if varying_axes(like):
        for field in ("manual_axis_type", "vma"):
            if field in _RESULT_FIELDS and hasattr(aval, field):
                # on the shard_map's mesh, replicated over its other axes
                sharding = jax.sharding.NamedSharding(aval.sharding.mesh,
                                                      jax.sharding.PartitionSpec())
                return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding,
                                            **{field: getattr(aval, field)})
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _attribute(value):
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return np.int64(value)
    if isinstance(value, float):
        return np.float32(value)
    raise AssertionError(f"fusedloss.jax internal: attribute {value!r}")


# ---- the core's checks and rules, at trace time ----

_MESSAGE = 2048


def _checked(fn, *args) -> None:
    """Runs a core validator; its message names the field without the C++ struct's "options."
    prefix (callers know the keyword), as the PyTorch ops' messages do."""
    message = ctypes.create_string_buffer(_MESSAGE)
    if fn(*args, message, ctypes.c_size_t(_MESSAGE)):
        raise ValueError(message.value.decode().removeprefix("options."))


_i64, _i32, _f32 = ctypes.c_int64, ctypes.c_int32, ctypes.c_float


def validate_cross_entropy(o, rows: int, vocab_local: int) -> None:
    """o: a CeOptions (_args.py)."""
    _checked(_lib.fusedloss_jax_validate_cross_entropy, _i64(o.ignore_index),
             _f32(o.label_smoothing), _i32(o.formula), _i32(o.scope), _f32(o.z_loss),
             _i32(o.reduction), _i64(rows), _i64(vocab_local))


def validate_linear_cross_entropy(o, softcap: float, workspace_bytes: int, mode: int, rows: int,
                                  vocab_local: int, hidden: int) -> None:
    _checked(_lib.fusedloss_jax_validate_linear_cross_entropy, _i64(o.ignore_index),
             _f32(o.label_smoothing), _i32(o.formula), _i32(o.scope), _f32(o.z_loss),
             _i32(o.reduction), _f32(softcap), _i64(workspace_bytes), _i32(mode), _i64(rows),
             _i64(vocab_local), _i64(hidden))


def resolve_linear_ce_backward(mode: int, reduction: int, dtype: int,
                               row_weighted: bool = False) -> int:
    """The core's rule for backward_mode "auto" (and its check of an explicit one);
    row_weighted: reduction 'none' with a loss_mask."""
    resolved = _i32(0)
    _checked(_lib.fusedloss_jax_resolve_linear_ce_backward, _i32(mode), _i32(reduction),
             _i32(dtype), _i32(int(row_weighted)), ctypes.byref(resolved))
    return resolved.value


def backward_vocab_block(mode: int, fp32_accumulation: bool, dtype: int, hidden: int) -> int:
    """The core's vocab_block for a backward of the resolved mode into a dweight of `dtype`: > 0
    where a recompute backward into a 16-bit dweight sums it exactly in fp32 blocks."""
    fn = _lib.fusedloss_jax_backward_vocab_block
    fn.restype = ctypes.c_int64
    return int(fn(_i32(mode), _i32(int(fp32_accumulation)), _i32(dtype), _i64(hidden)))


def validate_linear_log_probs(temperature: float, workspace_bytes: int, rows: int,
                              vocab_local: int, hidden: int) -> None:
    _checked(_lib.fusedloss_jax_validate_linear_log_probs, _f32(temperature),
             _i64(workspace_bytes), _i64(rows), _i64(vocab_local), _i64(hidden))


def validate_linear_distillation(divergence: int, beta: float, temperature: float,
                                 hard_label_weight: float, ignore_index: int, workspace_bytes: int,
                                 rows: int, vocab: int, has_target: bool) -> None:
    _checked(_lib.fusedloss_jax_validate_linear_distillation, _i64(divergence), _f32(beta),
             _f32(temperature), _f32(hard_label_weight), _i64(ignore_index), _i64(workspace_bytes),
             _i64(rows), _i64(vocab), _i32(int(has_target)))


def validate_rms_norm(eps: float, zero_centered_gamma: bool) -> None:
    _checked(_lib.fusedloss_jax_validate_rms_norm, _f32(eps), _i32(int(zero_centered_gamma)))


def rms_norm_reads_weight_as_is(x: int, weight: int) -> bool:
    return bool(_lib.fusedloss_jax_rms_norm_reads_weight_as_is(_i32(x), _i32(weight)))


def validate_swiglu(clamp_value, gate_multiplier: float, down_multiplier: float) -> None:
    """clamp_value: None (no clamp) or the clamp."""
    _checked(_lib.fusedloss_jax_validate_swiglu, _i32(clamp_value is not None),
             _f32(clamp_value or 0.0), _f32(gate_multiplier), _f32(down_multiplier))


def check_device_errors() -> None:
    """See fusedloss.jax.check_device_errors."""
    if "CUDA" in PLATFORMS:
        _checked(_lib.fusedloss_jax_check_device_errors, ctypes.c_void_p(None))


def check_scratch_binding(nbytes: int) -> None:
    """Drives the CUDA handlers' scratch binding on the host against a stand-in with the rules of
    XLA's FFI allocator (ffi_handlers.cpp); raises ValueError with what went wrong."""
    _checked(_lib.fusedloss_jax_check_scratch_binding, ctypes.c_size_t(nbytes))
