"""fusedloss.jax: fusedloss's kernels as JAX ops, through XLA's FFI, on the same C++ core as the
PyTorch ops (the same math, the same options, the same error messages).

    cross_entropy(logits, target, ...)                loss without a [N, V] softmax or gradient buffer
    linear_cross_entropy(hidden, weight, target, ...)  LM head + loss, no [N, V] logits
    linear_log_probs(hidden, weight, tokens, ...)     RL head: log-probs, entropy, arg-max, no logits
    linear_distillation_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, ...)
                                                      knowledge distillation without logits (CPU)
    rms_norm(x, weight, eps=1e-5, ...)                RMSNorm (+ fused residual add)
    swiglu(y, bias=None, ...)                         SwiGLU over the fused gate-up layout

Each is a jax.custom_vjp over XLA FFI handlers (libfusedloss_jax, built with the package where
jax is installed): jax.jit, jax.grad, jax.value_and_grad and jax.vmap compose with them; shapes,
dtypes and options are checked at trace time. The losses take axis_name= inside jax.shard_map
for a vocabulary sharded over a mesh axis (the per-row statistics merged with
jax.lax.all_gather). XLA's host platform runs the CPU backend; a build with CUDA registers the
CUDA handlers too, which run on XLA's stream with scratch from XLA's allocator. Importing this
package imports no torch.
"""
from ._cross_entropy import CrossEntropyOutput, cross_entropy
from ._ffi import PLATFORMS as platforms
from ._ffi import check_device_errors as _check_device_errors
from ._linear_cross_entropy import linear_cross_entropy
from ._linear_distillation import linear_distillation_loss
from ._linear_log_probs import LogProbs, linear_log_probs
from ._rms_norm import rms_norm
from ._swiglu import swiglu

__all__ = ["cross_entropy", "CrossEntropyOutput", "linear_cross_entropy", "linear_log_probs", "LogProbs", "rms_norm",
           "swiglu", "linear_distillation_loss", "check_device_errors", "platforms"]


def check_device_errors() -> None:
    """Raises ValueError naming the first bad target (outside [0, V) and not ignore_index) that
    the CUDA kernels met since the last call: they do not stop the device to report it, the row's
    loss is NaN instead. Call it once the results are ready (after jax.block_until_ready). A
    no-op where the handlers run on the CPU, which raise at the call."""
    _check_device_errors()
