"""Mode 2: fusedloss inside a hand-built Megatron layer, without patching anything.

A layer spec is just modules; this MLP uses Megatron's parallel linears around fusedloss's
SwiGLU, and the loss comes from fused_language_model_loss (Megatron's [b, s] layout).
Runs on the CPU (gloo, one rank) or a GPU:

    python3 examples/megatron_mode2.py
"""
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fusedloss.megatron import FusedLossSwiGLU, fused_language_model_loss


class FusedMLP(torch.nn.Module):
    """linear_fc1 -> fusedloss SwiGLU -> linear_fc2, as Megatron's gated MLP."""

    def __init__(self, config):
        super().__init__()
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        init = config.init_method
        self.fc1 = ColumnParallelLinear(config.hidden_size, 2 * config.ffn_hidden_size, config=config,
                                        init_method=init, bias=False, gather_output=False)
        self.act = FusedLossSwiGLU(inplace_backward=True)  # the gradient lands in fc1's output
        self.fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, config=config,
                                     init_method=init, bias=False, input_is_parallel=True,
                                     skip_bias_add=True)

    def forward(self, x):
        h, _ = self.fc1(x)
        out, _ = self.fc2(self.act(h))
        return out


def main():
    warnings.filterwarnings("ignore")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    dev = "cuda" if cuda else "cpu"
    cfg = TransformerConfig(num_layers=1, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                            use_cpu_initialization=True, activation_func=F.silu, gated_linear_unit=True)
    torch.manual_seed(0)
    mlp = FusedMLP(cfg).to(dev)
    head = torch.nn.Linear(128, 1000, bias=False).to(dev)
    x = torch.randn(64, 2, 128, device=dev)             # [s, b, h]
    labels = torch.randint(0, 1000, (2, 64), device=dev)  # [b, s]
    logits = head(mlp(x))                                # [s, b, V]
    loss = fused_language_model_loss(labels, logits).mean()
    # read the logits before backward: the in-place backward turns them into their gradient
    ref = F.cross_entropy(logits.detach().double().transpose(0, 1).reshape(-1, 1000), labels.reshape(-1))
    loss.backward()
    print(f"mode 2 on {dev}: loss {loss.item():.6f} (torch on the same logits: {ref.item():.6f}); "
          f"fc1 grad norm {mlp.fc1.weight.grad.norm().item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
