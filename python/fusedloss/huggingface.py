"""Hugging Face transformers models with fusedloss's ops, the way Liger-Kernel's
apply_liger_kernel_to_llama swaps them: the RMSNorms, the SwiGLU MLPs and, in training with
labels, the LM head and its loss as one fusedloss.linear_cross_entropy (no [tokens, V] logits).

    model = AutoModelForCausalLM.from_pretrained(...)
    fusedloss.huggingface.apply_fusedloss(model)          # this model's modules
    fusedloss.huggingface.apply_fusedloss_to_llama()       # or every Llama built from now on

Families: Llama, Mistral, Qwen2, Qwen3 (q/k norms too), Gemma 2 and 3 (zero-centred RMSNorm
weights (1 + w), the final logit soft-capping; their GELU MLPs keep transformers' own).
What each swap computes is the module's own forward: the tests check the patched model's loss
and every gradient against the unpatched one on tiny random-weight configurations. The loss
follows transformers' ForCausalLMLoss: labels shifted by one (or `shift_labels`), -100 ignored,
the mean over the labelled tokens, or their sum over `num_items_in_batch` when the Trainer
passes it (gradient accumulation). Outside training, or without labels, the model's own forward
runs and returns logits.
"""
import functools
import importlib
import inspect
from typing import Dict, Optional

import torch
import torch.nn.functional as F

# family -> (modeling module, RMSNorm class, MLP class, ForCausalLM classes, zero-centred norm)
_FAMILIES = {
    "llama": ("llama", "LlamaRMSNorm", "LlamaMLP", ("LlamaForCausalLM",), False),
    "mistral": ("mistral", "MistralRMSNorm", "MistralMLP", ("MistralForCausalLM",), False),
    "qwen2": ("qwen2", "Qwen2RMSNorm", "Qwen2MLP", ("Qwen2ForCausalLM",), False),
    "qwen3": ("qwen3", "Qwen3RMSNorm", "Qwen3MLP", ("Qwen3ForCausalLM",), False),
    "gemma2": ("gemma2", "Gemma2RMSNorm", "Gemma2MLP", ("Gemma2ForCausalLM",), True),
    "gemma3": ("gemma3", "Gemma3RMSNorm", "Gemma3MLP", ("Gemma3ForCausalLM",), True),
}
_SILU = ("silu", "swish")


def _eps(module) -> float:
    return float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))


def _rms_norm_forward(self, hidden_states):
    """LlamaRMSNorm's x / rms(x) * w (in fp32, rounded once to x's dtype)."""
    import fusedloss
    return fusedloss.rms_norm(hidden_states, self.weight, eps=_eps(self))


def _zero_centred_rms_norm_forward(self, hidden_states):
    """Gemma's x / rms(x) * (1 + w)."""
    import fusedloss
    return fusedloss.rms_norm(hidden_states, self.weight, eps=_eps(self), zero_centered_gamma=True)


def _swiglu_mlp_forward(self, x):
    """down(silu(gate(x)) * up(x)), the product fused (gradients of both projections)."""
    import fusedloss
    return self.down_proj(fusedloss.swiglu(self.gate_proj(x), self.up_proj(x)))


def _is_silu(mlp) -> bool:
    act = getattr(getattr(mlp, "config", None), "hidden_act", None)
    if act is None:
        act = getattr(mlp, "hidden_act", None)
    if act is not None:
        return act in _SILU
    return isinstance(getattr(mlp, "act_fn", None), torch.nn.SiLU)


def _mlp_forward_for(mlp, original):
    """The fused forward where the MLP's activation is SiLU, else its own."""
    if _is_silu(mlp):
        return _swiglu_mlp_forward.__get__(mlp)
    return original.__get__(mlp)


def _causal_lm_loss(model, hidden, labels, shift_labels, num_items_in_batch):
    import fusedloss
    if shift_labels is None:  # transformers' shift: position i predicts token i + 1
        shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    cap = getattr(model.config, "final_logit_softcapping", None)
    head = model.get_output_embeddings()
    loss = fusedloss.linear_cross_entropy(
        hidden, head.weight, shift_labels.to(hidden.device), getattr(head, "bias", None),
        ignore_index=-100, reduction="sum" if num_items_in_batch is not None else "mean",
        logit_softcap=cap or None)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _make_causal_lm_forward(original):
    names = [p.name for p in inspect.signature(original).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        kwargs.update(zip(names, args))
        labels = kwargs.get("labels")
        shift_labels = kwargs.get("shift_labels")
        if not self.training or (labels is None and shift_labels is None):
            return original(self, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast
        for name in ("labels", "shift_labels", "logits_to_keep", "num_logits_to_keep"):
            kwargs.pop(name, None)
        num_items = kwargs.get("num_items_in_batch")
        kwargs["return_dict"] = True
        outputs = self.model(**kwargs)
        loss = _causal_lm_loss(self, outputs[0], labels, shift_labels, num_items)
        fields = set(CausalLMOutputWithPast.__dataclass_fields__)
        rest = {k: v for k, v in outputs.items() if k in fields and k != "logits"}
        return CausalLMOutputWithPast(loss=loss, logits=None, **rest)

    forward.__fusedloss_original__ = original
    return forward


def _family_of(model) -> Optional[str]:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in ("gemma3_text",):
        return "gemma3"
    return model_type if model_type in _FAMILIES else None


def apply_fusedloss(model, *, rms_norm: bool = True, swiglu: bool = True,
                    linear_cross_entropy: bool = True) -> Dict[str, int]:
    """Swaps the modules of `model` (a transformers causal LM of a family above) in place: its
    RMSNorm modules, its SiLU MLPs, and its ForCausalLM forward in training with labels.
    Returns how many modules each swap took; raises ValueError for a model of another family
    (nothing is changed then)."""
    family = _family_of(model)
    if family is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(f"model: got a {type(model).__name__} (model_type={model_type!r}), "
                         f"expected one of the families {sorted(_FAMILIES)}")
    _, norm_name, mlp_name, lm_names, zero_centred = _FAMILIES[family]
    counts = {"rms_norm": 0, "swiglu": 0, "linear_cross_entropy": 0}
    norm_forward = _zero_centred_rms_norm_forward if zero_centred else _rms_norm_forward
    for module in model.modules():
        kind = type(module).__name__
        if rms_norm and kind == norm_name:
            module.forward = norm_forward.__get__(module)
            counts["rms_norm"] += 1
        elif swiglu and kind == mlp_name and _is_silu(module):
            module.forward = _swiglu_mlp_forward.__get__(module)
            counts["swiglu"] += 1
    if linear_cross_entropy and type(model).__name__ in lm_names:
        original = type(model).forward
        model.forward = _make_causal_lm_forward(original).__get__(model)
        counts["linear_cross_entropy"] += 1
    return counts


def _apply_to_classes(family, rms_norm, swiglu, linear_cross_entropy):
    module_name, norm_name, mlp_name, lm_names, zero_centred = _FAMILIES[family]
    modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    if rms_norm:
        getattr(modeling, norm_name).forward = (_zero_centred_rms_norm_forward if zero_centred
                                                else _rms_norm_forward)
    if swiglu:
        mlp = getattr(modeling, mlp_name)
        original = getattr(mlp.forward, "__fusedloss_original__", mlp.forward)

        def forward(self, x, _original=original):
            return _mlp_forward_for(self, _original)(x)
        forward.__fusedloss_original__ = original
        mlp.forward = forward
    if linear_cross_entropy:
        for name in lm_names:
            cls = getattr(modeling, name)
            original = getattr(cls.forward, "__fusedloss_original__", cls.forward)
            cls.forward = _make_causal_lm_forward(original)


def _class_patcher(family):
    def apply(rms_norm: bool = True, swiglu: bool = True, linear_cross_entropy: bool = True):
        _apply_to_classes(family, rms_norm, swiglu, linear_cross_entropy)
    apply.__name__ = f"apply_fusedloss_to_{family}"
    apply.__doc__ = (f"Swaps transformers' {family} classes (RMSNorm, the SiLU MLP, the "
                     "ForCausalLM forward in training with labels) for every model built after "
                     "the call, as apply_fusedloss does for one model.")
    return apply


apply_fusedloss_to_llama = _class_patcher("llama")
apply_fusedloss_to_mistral = _class_patcher("mistral")
apply_fusedloss_to_qwen2 = _class_patcher("qwen2")
apply_fusedloss_to_qwen3 = _class_patcher("qwen3")
apply_fusedloss_to_gemma2 = _class_patcher("gemma2")
apply_fusedloss_to_gemma3 = _class_patcher("gemma3")
