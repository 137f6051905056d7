"""verl's fused log-prob / entropy kernel, with fusedloss's head: linear_cross_entropy takes the
call and returns the results of verl's verl.utils.kernel.linear_cross_entropy.linear_cross_entropy
(verl 0.9), over fusedloss.linear_log_probs.

    import fusedloss.verl
    fusedloss.verl.apply_fusedloss_to_verl()   # verl's fused path (impl_backend="triton") runs it

verl's convention, which the function keeps:
  - hidden [..., H] and labels [...] are flattened to [N, H] and [N]; weight is [V, H], or this
    rank's vocabulary shard [V / tp, H] with dist_process_group (rank r holds rows
    [r V / tp, (r + 1) V / tp)); labels are global token ids.
  - log_probs are log softmax(hidden @ weight.T / temperature)[label] (<= 0, not the NLL), fp32;
    reduction "none" returns them per token [N], "sum" their sum, "mean" their sum / N.
  - entropy is -sum p log p per token, [N] fp32, whatever the reduction.
  - With dist_process_group every rank gets the same results; the backward leaves this rank's
    partial gradient of hidden (its shard's term) for the caller's collective, as verl's does.
Where it differs: a label equal to -100 gives log-prob and entropy 0 and no gradient (verl's
kernel reads every label as a token id), and hidden, weight and labels may have any strides and
H any size (verl's kernel takes contiguous tensors, H a multiple of 128, on CUDA).
"""
import importlib
import sys
from typing import Optional, Tuple

import torch.distributed as dist
from torch import Tensor

from ._views import require_tensor
from .linear_log_probs import linear_log_probs

_REDUCTIONS = ("none", "sum", "mean")
_VERL_KERNEL = "verl.utils.kernel.linear_cross_entropy"


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float = 1.0,
                         reduction: str = "none",
                         dist_process_group: Optional["dist.ProcessGroup"] = None
                         ) -> Tuple[Tensor, Tensor]:
    """(log_probs, entropy) of the sampled labels from the last hidden states and the LM head's
    weight, without the [N, V] logits: verl's linear_cross_entropy call and results.

    hidden [..., H] and weight [V_local, H] (fp32/fp16/bf16, one dtype; under torch.autocast the
    GEMMs run in its dtype); labels: integer token ids, as many as hidden's rows (any shape:
    both are flattened). temperature: > 0, finite. reduction: "none" (log-probs per token, [N]),
    "sum" or "mean" (over all N tokens; a scalar), case-insensitive. dist_process_group: the
    tensor-parallel group over which weight's vocabulary is split (None: weight is the whole
    vocabulary). Returns fp32 log_probs as reduced and entropy [N]; gradients flow from both into
    hidden (this rank's partial sum at TP > 1) and weight.
    """
    require_tensor(hidden, "hidden")
    require_tensor(labels, "labels")
    if not isinstance(reduction, str) or reduction.lower() not in _REDUCTIONS:
        raise ValueError(f"reduction: got {reduction!r}, expected one of {list(_REDUCTIONS)} "
                         "(any case)")
    if hidden.dim() < 2:
        raise ValueError(f"hidden: got shape {tuple(hidden.shape)}, expected [..., H] (at least "
                         "2 dims)")
    rows = hidden.numel() // max(hidden.size(-1), 1)
    if labels.numel() != rows:
        raise ValueError(f"labels: got {labels.numel()} elements (shape {tuple(labels.shape)}), "
                         f"expected one per row of hidden ({rows}: hidden's shape "
                         f"{tuple(hidden.shape)} without H)")
    out = linear_log_probs(hidden.reshape(rows, hidden.size(-1)), weight, labels.reshape(rows),
                           temperature=temperature, entropy=True, tp_group=dist_process_group)
    log_probs = {"none": out.log_probs, "sum": out.log_probs.sum(),
                 "mean": out.log_probs.sum() / rows}[reduction.lower()]
    return log_probs, out.entropy


def apply_fusedloss_to_verl() -> list:
    """Points verl's fused log-prob kernel at linear_cross_entropy above: the attribute of
    verl.utils.kernel.linear_cross_entropy that verl's models look up when they run (the
    Hugging Face models' fused forward imports it at each call), and every module already
    imported that bound verl's function by name (verl.models.mcore.model_forward_fused and
    model_forward_1f1b_overlap). Returns the names of the modules changed. Call it in every
    process that builds a model (verl's Ray workers: a module named in
    VERL_USE_EXTERNAL_MODULES, which verl imports in each of them, can make the call)."""
    kernel = importlib.import_module(_VERL_KERNEL)
    original = getattr(kernel, "linear_cross_entropy", None)
    if original is None:
        raise RuntimeError(f"{_VERL_KERNEL} has no linear_cross_entropy: expected verl's fused "
                           "log-prob kernel module")
    if original is linear_cross_entropy:  # applied already
        return []
    patched = []
    for name, module in list(sys.modules.items()):
        if name.startswith("verl.") and getattr(module, "linear_cross_entropy", None) is original:
            module.linear_cross_entropy = linear_cross_entropy
            patched.append(name)
    return patched
