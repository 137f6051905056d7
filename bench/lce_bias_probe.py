"""The linear cross-entropy with an LM-head bias on CUDA against float64 and torch: the gradient
errors (dhidden, dweight, dbias) of each backward mode and pipeline variant, the bias folded
into the GEMM as a column of ones (the no-bias path), and the per-row losses against float64 of
the logits as stored. Liger's init (torch.rand weight and bias), bf16.

    python bench/lce_bias_probe.py
"""
import os, torch, torch.nn.functional as F, fusedloss
torch.manual_seed(0)
def rel(a, r): return ((a.double().cpu() - r).norm() / r.norm()).item()
for (N, H, V) in [(8, 512, 512), (4096, 4096, 32000)]:
    g = torch.Generator().manual_seed(N + V)
    w = torch.rand(V, H, generator=g).bfloat16().cuda()
    b = torch.rand(V, generator=g).bfloat16().cuda()
    x = torch.randn(N, H, generator=g).bfloat16().cuda()
    t = torch.randint(0, V, (N,), generator=g).cuda()
    refs = [a.double().cpu().requires_grad_() for a in (x, w, b)]
    z = F.linear(*refs); z = z + (z.to(torch.bfloat16).double() - z).detach()
    F.cross_entropy(z, t.cpu()).backward()
    def run(name, fn, args):
        leaves = [a.clone().requires_grad_() for a in args]
        fn(*leaves).backward()
        errs = [rel(l.grad, r.grad) for l, r in zip(leaves, refs)]
        print(f"N{N} {name:38s} dh {errs[0]:.2e} dw {errs[1]:.2e}" + (f" db {errs[2]:.2e}" if len(errs) > 2 else ""), flush=True)
    run("torch", lambda x, w, b: F.cross_entropy(F.linear(x, w, b).float(), t), (x, w, b))
    for mode in ("auto", "in_forward", "recompute"):
        run(f"fusedloss bias {mode}", lambda x, w, b: fusedloss.linear_cross_entropy(x, w, t, b, backward_mode=mode), (x, w, b))
    run("fusedloss no bias (ref has bias)", lambda x, w, b: fusedloss.linear_cross_entropy(x, w, t) + 0 * b.sum(), (x, w, b))
    # the bias folded into the GEMM: a column of ones
    ones = torch.ones(N, 1, dtype=x.dtype, device="cuda")
    run("fusedloss folded bias", lambda x, w, b: fusedloss.linear_cross_entropy(torch.cat([x, ones], 1), torch.cat([w, b[:, None]], 1), t), (x, w, b))
    os.environ["FUSEDLOSS_LCE_BUFFERS"] = "1"
    run("fusedloss bias buffers=1", lambda x, w, b: fusedloss.linear_cross_entropy(x, w, t, b), (x, w, b))
    del os.environ["FUSEDLOSS_LCE_BUFFERS"]
    os.environ["FUSEDLOSS_LCE_SIDE_STREAM"] = "0"
    run("fusedloss bias side_stream=0", lambda x, w, b: fusedloss.linear_cross_entropy(x, w, t, b), (x, w, b))
    del os.environ["FUSEDLOSS_LCE_SIDE_STREAM"]
    # logits as our op stores them vs torch's F.linear
    lt = F.linear(x, w, b).double().cpu(); print("  torch logits vs rounded ref: max diff", (lt - z.detach()).abs().max().item(), flush=True)
    # per-row losses: the logits' rounding shows here
    zr = z.detach()
    ref_rows = F.cross_entropy(zr, t.cpu(), reduction="none")
    for name, fn in [("bias", lambda: fusedloss.linear_cross_entropy(x, w, t, b, reduction="none")),
                     ("folded", lambda: fusedloss.linear_cross_entropy(torch.cat([x, ones], 1), torch.cat([w, b[:, None]], 1), t, reduction="none")),
                     ("torch", lambda: F.cross_entropy(F.linear(x, w, b).float(), t, reduction="none"))]:
        d = (fn().double().cpu() - ref_rows).abs()
        print(f"  rows {name:7s} max |loss - ref| {d.max().item():.3e} mean {d.mean().item():.3e}", flush=True)
