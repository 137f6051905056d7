"""TRL's trainers with fusedloss's log-prob head: GRPOTrainer's per-token log-probs and entropy
(its clipped loss, KL penalty, entropy bonus, entropy metric and high-entropy mask) come from the
last hidden states through fusedloss.linear_log_probs, without [tokens, V] logits.

    import fusedloss.trl
    fusedloss.trl.apply_fusedloss_to_trl()     # before the trainer is built or run
    trainer = trl.GRPOTrainer(...)

TRL (1.15 and newer) scores tokens through its fused LM head (trl.trainer.utils.add_fused_lm_head:
the model's forward with fused_lm_head=True runs the backbone, picks the labelled positions and
hands their hidden states to one kernel, trl.kernels.ChunkedLogProbFunction). The patch replaces
that kernel, as trl.trainer.utils binds it, with linear_log_probs; everything around it (which
positions are scored, autocast, the FSDP2 gather of the head, the loss, the MoE aux loss) stays
TRL's. The calls linear_log_probs cannot run go to TRL's own kernel: an LM head with a bias, a
final-logit soft cap (Gemma 2), a logit scale <= 0, outputs other than log_probs, entropy and
is_top1, DeepSpeed ZeRO-3 (its head is gathered only while TRL's kernel runs) and devices other
than CPU and CUDA. A logit scale s > 0 (Cohere, Granite) runs as the temperature T / s.
"""
import inspect

import torch

from .linear_log_probs import linear_log_probs

_OUTPUTS = ("log_probs", "entropy", "is_top1")
# TRL's kernel's call, as add_fused_lm_head makes it
_PARAMETERS = ["ctx", "hidden", "weight", "bias", "targets", "temperature", "chunk_size",
               "final_logit_softcapping", "logit_scale", "outputs"]


class FusedLossLogProbs:
    """TRL's ChunkedLogProbFunction's apply() over fusedloss.linear_log_probs: (log_probs,
    entropy, log_sum_sq_probs, mean_logits, is_top1) per token, the ones not asked for None."""

    def __init__(self, original):
        self.original = original  # TRL's kernel: the calls linear_log_probs does not take

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size,
              final_logit_softcapping=None, logit_scale=1.0, outputs=None):
        if not _runs_here(hidden, bias, final_logit_softcapping, logit_scale, outputs):
            if self.original is None:
                raise RuntimeError("this call (an LM head bias, a soft cap, a logit scale <= 0, "
                                   f"outputs {outputs!r} or device {hidden.device}) needs TRL's "
                                   "own kernel, which this TRL build lacks")
            return self.original.apply(hidden, weight, bias, targets, temperature, chunk_size,
                                       final_logit_softcapping, logit_scale, outputs)
        if not torch.is_autocast_enabled(hidden.device.type) and weight.dtype != hidden.dtype:
            weight = weight.to(hidden.dtype)  # TRL's kernel runs in hidden's dtype
        out = linear_log_probs(hidden, weight, targets,
                               temperature=float(temperature) / float(logit_scale),
                               entropy="entropy" in outputs, argmax="is_top1" in outputs)
        is_top1 = None if out.argmax is None else out.argmax == targets
        return out.log_probs, out.entropy, None, None, is_top1


def _runs_here(hidden, bias, softcap, logit_scale, outputs) -> bool:
    """Whether linear_log_probs computes this call of TRL's kernel."""
    if outputs is None or not set(outputs) <= set(_OUTPUTS):
        return False
    if bias is not None or softcap is not None or not float(logit_scale) > 0:
        return False
    if hidden.device.type not in ("cpu", "cuda"):
        return False
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    return not is_deepspeed_zero3_enabled()


def _trl_utils():
    import trl
    import trl.trainer.utils as utils
    if not hasattr(utils, "add_fused_lm_head") or not hasattr(utils, "_ChunkedLogProbFunction"):
        raise RuntimeError(f"trl {trl.__version__}: expected trl 1.15 or newer (its fused LM "
                           "head, trl.trainer.utils.add_fused_lm_head)")
    return utils


def apply_fusedloss_to_trl() -> None:
    """Makes TRL's fused LM head (every trainer that scores tokens through it: GRPOTrainer's
    policy and reference model among them) compute its per-token log-probs, entropy and is_top1
    with fusedloss.linear_log_probs. Idempotent; unpatch_trl() restores TRL's kernel. Raises
    RuntimeError for a TRL without the fused head (older than 1.15) or whose kernel takes other
    arguments than the ones this patch knows."""
    utils = _trl_utils()
    current = utils._ChunkedLogProbFunction
    if isinstance(current, FusedLossLogProbs):
        return
    if current is not None:
        found = list(inspect.signature(current.forward).parameters)
        if found != _PARAMETERS:
            import trl
            raise RuntimeError(f"trl {trl.__version__}: its fused LM head's kernel takes {found}, "
                               f"expected {_PARAMETERS}")
    utils._ChunkedLogProbFunction = FusedLossLogProbs(current)


def unpatch_trl() -> None:
    """Restores TRL's own kernel in its fused LM head."""
    utils = _trl_utils()
    if isinstance(utils._ChunkedLogProbFunction, FusedLossLogProbs):
        utils._ChunkedLogProbFunction = utils._ChunkedLogProbFunction.original


def is_patched() -> bool:
    """Whether TRL's fused LM head runs fusedloss.linear_log_probs."""
    return isinstance(_trl_utils()._ChunkedLogProbFunction, FusedLossLogProbs)
