"""What the patched Megatron objects read at call time: the options, resolved once when the
patch is applied (no per-call option parsing or signature binding), the tensor-parallel guard,
and the one-time warnings."""
import inspect
import warnings

import torch

import fusedloss
from fusedloss import _C
from fusedloss._distributed import agree, group_size  # (the adapters call state.group_size)

CONFIG = {}
_WARNED = set()
# keyword arguments of fusedloss.cross_entropy / linear_cross_entropy, set by configure()
_CE_KWARGS = {}
_LCE_KWARGS = {}
# Megatron's label smoothing: the smoothing mass spread over V - 1 classes, over each rank's shard
MEGATRON_SMOOTHING = dict(smoothing_formula="megatron", smoothing_scope="partition")


def configure(flags, ignore_index, label_smoothing, lce_backward="recompute", lce_workspace_bytes=0):
    """lce_workspace_bytes: checked (as_workspace_bytes), 0 for the op's default."""
    CONFIG.clear()
    CONFIG.update(flags, ignore_index=int(ignore_index), label_smoothing=float(label_smoothing))
    # the patch's arguments (the workspace as checked), which the context manager restores
    CONFIG["options"] = dict(flags, ignore_index=ignore_index, label_smoothing=label_smoothing,
                             linear_cross_entropy_backward=lce_backward,
                             linear_cross_entropy_workspace_bytes=lce_workspace_bytes or None)
    common = dict(MEGATRON_SMOOTHING, ignore_index=int(ignore_index), reduction="none",
                  check_shard_agreement=flags["check_shard_agreement"])
    _CE_KWARGS.clear()
    _CE_KWARGS.update(common, inplace_backward=flags["inplace_backward"])
    _LCE_KWARGS.clear()
    # "recompute": any upstream gradient; "auto": in_forward with the loss_mask Megatron's
    # forward received (its loss_func reduces c * sum(loss_mask * loss)), recompute without one
    # 0 resolved to the op's default, so that ranks passing None and the default agree
    workspace = lce_workspace_bytes or _C.LinearCrossEntropyOptions().workspace_bytes
    _LCE_KWARGS.update(common, label_smoothing=float(label_smoothing), backward_mode=lce_backward,
                       dhidden_reduction="partial", workspace_bytes=workspace)


def warn_once(key, message, category=UserWarning):
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, category, stacklevel=3)


def parameter_names(fn):
    """The names a positional call binds to, in order."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds]


def tp_group_from_parallel_state():
    try:
        from megatron.core import parallel_state
        if not parallel_state.model_parallel_is_initialized():
            return None
        return parallel_state.get_tensor_model_parallel_group()
    except (AssertionError, RuntimeError, AttributeError):
        return None  # not initialised: TP=1 as far as anyone can tell


def guard(tp_group, where):
    """The group to hand the op (None at TP=1); TP > 1 without allow_vocab_parallel raises."""
    if tp_group is None:
        return None
    size = group_size(tp_group)
    if size > 1 and not CONFIG["allow_vocab_parallel"]:
        refusal = tp_refusal(f"{where} was called with a tensor-parallel group of size {size}")
        if CONFIG["check_shard_agreement"] and not torch.compiler.is_compiling():
            # Every rank raises it: a rank patched with allow_vocab_parallel=True is about to
            # wait in the op's (or the head's) agreement, its first collective, which this rank
            # joins with the refusal; ranks that refuse all agree on it. (check_shard_agreement
            # must be the same on every rank; while torch.compile traces, no collective runs.)
            _refuse_on_every_rank(tp_group, refusal)
        raise RuntimeError(f"fusedloss.megatron: {refusal}")
    if size > 1:
        warn_once("vocab_parallel", "fusedloss.megatron: experimental vocab-parallel cross-entropy "
                  f"(TP={size}, one all-gather per forward)")
        return tp_group
    return None


def tp_refusal(what: str) -> str:
    """The TP > 1 refusal without allow_vocab_parallel (at patch time and at call time)."""
    return (f"{what}. The patch is scoped to tensor_model_parallel_size == 1 by default; pass "
            "allow_vocab_parallel=True to apply_fusedloss_to_megatron(...) to run fusedloss's "
            "experimental vocab-parallel cross-entropy, or unpatch_megatron().")


@torch.compiler.disable  # host-side collectives: never traced (a frame torch.compile left to
def _refuse_on_every_rank(tp_group, refusal):  # eager would still have agree()'s compiled)
    try:
        agree(tp_group, -1, -1, 0, refusal, "fusedloss.megatron")
    except _C.Error as refused:  # "fusedloss.megatron: vocab-parallel rank r: ..."
        raise RuntimeError(str(refused)) from None


def cross_entropy(logits, target, tp_group, label_smoothing):
    """Megatron's contract: [s, b, V/tp] logits, [s, b] targets -> [s, b] fp32 per-token loss.
    label_smoothing None: the patch's own."""
    ls = CONFIG["label_smoothing"] if label_smoothing is None else label_smoothing
    return fusedloss.cross_entropy(logits, target, label_smoothing=ls, tp_group=tp_group, **_CE_KWARGS)


def lce_options():
    return _LCE_KWARGS
