"""fusedloss from PyTorch: cross-entropy and SwiGLU next to their torch references, on the GPU
when there is one, else on the CPU backend."""
import torch
import torch.nn.functional as F

import fusedloss

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)

# Cross-entropy: [s, b, V] bf16 logits, gradient written into the logits (no [N, V] buffer).
hidden = torch.randn(256, 2, 512, device=device, dtype=torch.bfloat16)
weight = (torch.randn(512, 32000, device=device, dtype=torch.bfloat16) * 0.05).requires_grad_(True)
target = torch.randint(0, 32000, (256, 2), device=device)
target[:8] = -100  # padding
logits = hidden @ weight
loss = fusedloss.cross_entropy(logits, target, label_smoothing=0.1, inplace_backward=True)
loss.backward()
ref_w = weight.detach().float().requires_grad_(True)
ref = F.cross_entropy((hidden.float() @ ref_w).view(-1, 32000), target.view(-1), label_smoothing=0.1)
ref.backward()
print(f"[{device}] cross-entropy  fusedloss {loss.item():.6f}  torch (fp32) {ref.item():.6f}  "
      f"weight-grad rel. error {((weight.grad.float() - ref_w.grad).norm() / ref_w.grad.norm()).item():.2e}")

# SwiGLU over Megatron's fused gate-up layout [s, b, 2n].
y = torch.randn(256, 2, 2 * 1024, device=device, dtype=torch.bfloat16, requires_grad=True)
out = fusedloss.swiglu(y)
a, b = y.detach().float().chunk(2, -1)
ref_out = F.silu(a) * b
print(f"[{device}] swiglu         rel. error vs fp32 silu(a)*b {((out.float() - ref_out).norm() / ref_out.norm()).item():.2e}")
fusedloss.check_device_errors()
