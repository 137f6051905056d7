"""Mode 2: fusedloss building blocks for hand-built Megatron layers, without patching.

    loss = fused_language_model_loss(labels, logits, tp_group)   # [b, s] fp32, like
           # LanguageModule.compute_language_model_loss
    act = FusedLossSwiGLU()                                      # on linear_fc1's [s, b, 2n]
    h = act(fc1_out, fc1_bias)
    norm = FusedLossRMSNorm(config, hidden_size, eps)            # what the patch builds for
                                                                 # normalization="RMSNorm"
"""
from typing import Optional

import torch

import fusedloss
from fusedloss.megatron.state import MEGATRON_SMOOTHING


def fused_language_model_loss(labels: torch.Tensor, logits: torch.Tensor, tp_group=None, *,
                              ignore_index: int = -100, label_smoothing: float = 0.0,
                              inplace_backward: bool = True) -> torch.Tensor:
    """labels [b, s], logits [s, b, V/tp] -> per-token loss [b, s] (fp32), Megatron's layout.
    A tp_group of size > 1 runs the vocab-parallel path (experimental)."""
    loss = fusedloss.cross_entropy(logits, labels.transpose(0, 1).contiguous(), reduction="none",
                                   ignore_index=ignore_index, label_smoothing=label_smoothing,
                                   **MEGATRON_SMOOTHING, inplace_backward=inplace_backward,
                                   tp_group=tp_group)
    return loss.transpose(0, 1).contiguous()


class FusedLossSwiGLU(torch.nn.Module):
    """SwiGLU over linear_fc1's fused gate-up output, with Megatron's variants."""

    def __init__(self, clamp_value: Optional[float] = None, fp8_input_store: bool = False,
                 inplace_backward: bool = False):
        super().__init__()
        self.clamp_value, self.fp8_input_store = clamp_value, fp8_input_store
        self.inplace_backward = inplace_backward

    def forward(self, fc1_out, bias=None, per_token_scale=None):
        return fusedloss.swiglu(fc1_out, bias, per_token_scale=per_token_scale, clamp_value=self.clamp_value,
                                fp8_input_store=self.fp8_input_store, inplace_backward=self.inplace_backward)


class FusedLossRMSNorm(fusedloss.RMSNorm):
    """fusedloss.RMSNorm built from a Megatron TransformerConfig, as WrappedTorchNorm is:
    weight [hidden_size] (ones, or zeros with config.layernorm_zero_centered_gamma, gamma =
    1 + weight), created like torch.nn.RMSNorm (default device and dtype; Megatron moves and
    casts the model). Under sequence parallelism the weight carries `sequence_parallel = True`,
    so Megatron all-reduces its gradient (a partial sum over this rank's tokens) across the
    tensor-parallel group, as for its own fused norms."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps,
                         zero_centered_gamma=bool(getattr(config, "layernorm_zero_centered_gamma", False)))
        self.config = config
        setattr(self.weight, "sequence_parallel", bool(getattr(config, "sequence_parallel", False)))
