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
# float64 reference on the same bf16 inputs
ref_w = weight.detach().double().requires_grad_(True)
ref = F.cross_entropy((hidden.double() @ ref_w).view(-1, 32000), target.view(-1), label_smoothing=0.1)
ref.backward()
ce_loss_err = abs(loss.item() - ref.item()) / abs(ref.item())
ce_grad_err = ((weight.grad.double() - ref_w.grad).norm() / ref_w.grad.norm()).item()
print(f"[{device}] cross-entropy  fusedloss {loss.item():.6f}  torch (float64) {ref.item():.6f}  "
      f"loss rel. error {ce_loss_err:.2e}  weight-grad rel. error {ce_grad_err:.2e}")

# SwiGLU over Megatron's fused gate-up layout [s, b, 2n].
y = torch.randn(256, 2, 2 * 1024, device=device, dtype=torch.bfloat16, requires_grad=True)
out = fusedloss.swiglu(y)
a, b = y.detach().double().chunk(2, -1)
ref_out = F.silu(a) * b
sw_err = ((out.double() - ref_out).norm() / ref_out.norm()).item()
print(f"[{device}] swiglu         rel. error vs float64 silu(a)*b {sw_err:.2e}")
fusedloss.check_device_errors()

# bf16 storage: the loss is fp32 (rounding of the bf16 logits only); results stored in bf16 are
# held to a few bf16 ulps.
checks = {"cross-entropy loss": (ce_loss_err, 2e-3), "cross-entropy weight grad": (ce_grad_err, 2e-2),
          "swiglu": (sw_err, 1e-2)}
bad = [f"{name} {err:.2e} > {tol:.0e}" for name, (err, tol) in checks.items() if not err <= tol]
if bad:
    raise SystemExit(f"FAILED: differs from the float64 reference: {', '.join(bad)}")
print("OK: matches the float64 reference")
