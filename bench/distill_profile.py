"""Where the linear distillation's forward+backward spends its device time: torch.profiler's
CUDA kernel table (total ms per kernel name over STEPS steps, divided by STEPS) for fusedloss's
JSD and forward KL, with and without FUSEDLOSS_DISTILL_CLUSTERS, at one shape (bf16); the
chunk loop's phase times (FUSEDLOSS_LCE_TIMING=1); and the dweight GEMM accumulated a chunk of
tokens at a time (bf16 C read and written each time) against one GEMM over all the tokens.

  python3 bench/distill_profile.py [N H V]        (default 16384 4096 151936)
"""
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import fusedloss
import peers

STEPS = 3


def step(sh, sw, th, tw, divergence):
    h, w = sh.detach().requires_grad_(True), sw.detach().requires_grad_(True)
    loss = fusedloss.linear_distillation_loss(h, w, th, tw, divergence=divergence)
    loss.backward()


def device_ms(fn, runs=3):
    """Median device ms of fn() behind the GPU-side wait (peers.time_step)."""
    return peers.time_step(lambda: (), lambda: fn(), None, runs, 1)[0]


def dweight_chunks(n, hid, v):
    g = torch.randn(n, v, device="cuda").bfloat16()
    h = torch.randn(n, hid, device="cuda").bfloat16()
    c = torch.zeros(v, hid, device="cuda", dtype=torch.bfloat16)
    whole = device_ms(lambda: torch.mm(g.t(), h, out=c))
    print(f"\n== dweight [{v}, {hid}] over {n} tokens: one GEMM {whole:.2f} ms")
    for k in (256, 512, 768, 1024, 2048):
        def run():
            for i in range(0, n, k):
                c.addmm_(g[i:i + k].t(), h[i:i + k])
        print(f"  chunks of {k:5d}: {device_ms(run):8.2f} ms")


def main():
    n, hid, v = (int(x) for x in sys.argv[1:4]) if len(sys.argv) > 3 else (16384, 4096, 151936)
    torch.manual_seed(0)
    mk = lambda *s: (torch.randn(*s, device="cuda") * s[-1] ** -0.5).to(torch.bfloat16)
    sh, sw, th, tw = torch.randn(n, hid, device="cuda").bfloat16(), mk(v, hid), \
        torch.randn(n, hid, device="cuda").bfloat16(), mk(v, hid)
    os.environ["FUSEDLOSS_LCE_TIMING"] = "1"
    for divergence in ("jsd", "forward_kl"):
        step(sh, sw, th, tw, divergence)
        torch.cuda.synchronize()
        fusedloss._C.linear_cross_entropy_phase_times(True)
        for _ in range(STEPS):
            step(sh, sw, th, tw, divergence)
        torch.cuda.synchronize()
        t = fusedloss._C.linear_cross_entropy_phase_times(True)
        print(f"== phases {divergence}: " + ", ".join(
            f"{k} {t[k] / STEPS:.2f}" for k in
            ("logits_ms", "ce_ms", "dhidden_ms", "dweight_ms", "loop_ms")) + f" (loops {t['loops']})")
    os.environ["FUSEDLOSS_LCE_TIMING"] = "0"
    for clusters in ("0", "1"):
        os.environ["FUSEDLOSS_DISTILL_CLUSTERS"] = clusters
        for divergence in ("jsd", "forward_kl"):
            step(sh, sw, th, tw, divergence)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(STEPS):
                    step(sh, sw, th, tw, divergence)
                torch.cuda.synchronize()
            rows = {}
            for e in prof.events():
                if e.device_type.name == "CUDA":
                    name = e.name[:90]
                    t, c = rows.get(name, (0.0, 0))
                    rows[name] = (t + e.device_time / 1e3, c + 1)
            total = sum(t for t, _ in rows.values()) / STEPS
            print(f"\n== {divergence} clusters={clusters} {n}x{hid}x{v}: {total:.2f} ms of kernels a step")
            for name, (t, c) in sorted(rows.items(), key=lambda r: -r[1][0])[:14]:
                print(f"  {t / STEPS:8.2f} ms  {c // STEPS:5d}x  {name}")
    del sh, sw, th, tw
    dweight_chunks(n, hid, v)


if __name__ == "__main__":
    main()
