"""Linear cross-entropy (LM head + mean loss, bf16, forward+backward) against its peers and
against the GEMMs alone, in one run on one GPU (run through bench/run_bench.py
linear-cross-entropy).

Providers (fn(hidden, weight, target) -> mean loss; hidden and weight are fresh leaves):
  3-gemm / 4-gemm      cuBLAS alone through torch matmuls: logits, dhidden, dweight (+ the
                       recompute's second logits GEMM); no loss: the floor for each mode
  torch                F.linear + F.cross_entropy
  linear+fusedloss-ce  F.linear + fusedloss.cross_entropy(inplace_backward=True)
  liger                Liger-Kernel's fused linear cross-entropy (if importable)
  cce                  Apple's cut-cross-entropy, its default (gradient filtering) (if importable)
  fusedloss-in_forward / fusedloss-recompute   fusedloss.linear_cross_entropy in both modes, the
                       weight gradient accumulated over token chunks in fp32 (exact; in_forward
                       keeps an fp32 [V, H] until the backward)
  fusedloss-*-wdt      the same, accumulated in the weight's dtype (bf16: the gradients' memory
                       alone, one rounding per pair of chunks)

Device time: CUDA events behind a GPU-side wait (peers.py), median of the runs. Peak extra:
torch's allocator high-water mark above the inputs, including the gradients dhidden [N, H] and
dweight [V, H] every provider must produce. Gradient error: relative L2 error of dhidden and
dweight against a float64 reference computed from the same bf16 inputs.
"""

import torch
import torch.nn.functional as F

import peers

SHAPES = [(4096, 4096, 128256), (8192, 4096, 128256), (16384, 4096, 151936)]
DTYPE = torch.bfloat16


# ---- providers ----

def gemms(n):
    """The GEMMs of the fused op alone, on the same operands (the logits stand in for their
    gradient): what a perfect fusion with the loss hidden underneath would take."""
    def run(h, w, t):
        logits = h @ w.t()
        if n == 4:
            logits = h @ w.t()
        dh = logits @ w
        dw = logits.t() @ h
        return dh, dw
    return run


def torch_lce(h, w, t):
    return F.cross_entropy(F.linear(h, w), t)


def linear_fusedloss_ce(h, w, t):
    import fusedloss
    return fusedloss.cross_entropy(F.linear(h, w), t, inplace_backward=True)


def liger():
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    loss = LigerFusedLinearCrossEntropyLoss()
    return lambda h, w, t: loss(w, h, t)


def cce():
    from cut_cross_entropy import linear_cross_entropy
    return lambda h, w, t: linear_cross_entropy(h, w, t)


def fusedloss_lce(mode, accumulation):
    def make():
        import fusedloss
        return lambda h, w, t: fusedloss.linear_cross_entropy(
            h, w, t, backward_mode=mode, dweight_accumulation=accumulation)
    return make


def providers():
    found = {"3-gemm": gemms(3), "4-gemm": gemms(4), "torch": torch_lce,
             "linear+fusedloss-ce": linear_fusedloss_ce}
    return peers.collect(found, {"liger": liger, "cce": cce,
                                 "fusedloss-in_forward": fusedloss_lce("in_forward", "fp32"),
                                 "fusedloss-recompute": fusedloss_lce("recompute", "fp32"),
                                 "fusedloss-in_forward-wdt": fusedloss_lce("in_forward", "weight_dtype"),
                                 "fusedloss-recompute-wdt": fusedloss_lce("recompute", "weight_dtype")})


# ---- measurement ----

def time_provider(name, fn, h0, w0, t, iters, warmup):
    """peers.time_step of one provider (the GEMM floors without a backward); its numbers and
    the gradients of the last run."""
    raw = name.endswith("gemm")
    f, b, fb, peak, host, (_, (h, w)) = peers.time_step(
        lambda: (h0.detach().requires_grad_(not raw), w0.detach().requires_grad_(not raw)),
        lambda h, w: fn(h, w, t), None if raw else (lambda out, h, w: out.backward()), iters, warmup)
    return f, b, fb, peak, host, (None if raw else (h.grad, w.grad))


def reference_grads(h, w, t, chunk=4096):
    """Float64 dhidden, dweight of the mean loss, a token chunk at a time."""
    h64, w64 = h.double(), w.double()
    valid = (t != -100).sum().clamp(min=1).double()
    dh = torch.empty_like(h64)
    dw = torch.zeros_like(w64)
    for r0 in range(0, h.size(0), chunk):
        hc, tc = h64[r0:r0 + chunk], t[r0:r0 + chunk]
        g = torch.softmax(hc @ w64.t(), -1)
        ok = tc != -100
        g[ok, tc[ok]] -= 1
        g[~ok] = 0
        g /= valid
        dh[r0:r0 + chunk] = g @ w64
        dw += g.t() @ hc
        del g
    return dh, dw


def rel_err(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


def run(out_dir, commit, iters=10, warmup=2):
    gpu = torch.cuda.get_device_name()
    provs = providers()
    names = list(provs)
    records = []
    for N, H, V in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(N + V)
        h0 = torch.randn(N, H, device="cuda", generator=g).to(DTYPE)
        w0 = (torch.randn(V, H, device="cuda", generator=g) * H ** -0.5).to(DTYPE)
        t = torch.randint(0, V, (N,), device="cuda", generator=g)
        ref_dh, ref_dw = reference_grads(h0, w0, t)
        torch.cuda.empty_cache()
        for name, fn in provs.items():
            try:
                f, b, fb, peak, host, grads = time_provider(name, fn, h0, w0, t, iters, warmup)
            except Exception as e:
                print(f"[bench] {name} failed at N={N} V={V}: {type(e).__name__}: {e}")
                torch.cuda.empty_cache()
                continue
            err_h = err_w = float("nan")
            if grads is not None:
                err_h, err_w = rel_err(grads[0], ref_dh), rel_err(grads[1], ref_dw)
            records.append(dict(provider=name, N=N, H=H, V=V, fwd=f, bwd=b, both=fb, peak=peak,
                                host=host, err_h=err_h, err_w=err_w))
            del grads
            torch.cuda.empty_cache()
        del h0, w0, t, ref_dh, ref_dw
        torch.cuda.empty_cache()
    report(records, names, gpu, commit, out_dir)
    return records


def report(records, names, gpu, commit, out_dir):
    by = {(r["provider"], r["N"], r["V"]): r for r in records}
    shapes = sorted({(r["N"], r["H"], r["V"]) for r in records})
    print(f"\nlinear cross-entropy on {gpu}; bf16, mean loss, forward+backward device ms; commit {commit}")
    print(f"{'N, H, V':>20} {'provider':>22} {'fwd':>8} {'bwd':>8} {'fwd+bwd':>8} {'x 3gemm':>8} "
          f"{'x 4gemm':>8} {'peak GiB':>9} {'dh err':>9} {'dw err':>9} {'host ms':>8}")
    for N, H, V in shapes:
        g3, g4 = by.get(("3-gemm", N, V)), by.get(("4-gemm", N, V))
        for n in names:
            r = by.get((n, N, V))
            if r is None:
                continue
            x3 = r["both"] / g3["both"] if g3 else float("nan")
            x4 = r["both"] / g4["both"] if g4 else float("nan")
            print(f"{f'{N}, {H}, {V}':>20} {n:>22} {r['fwd']:8.2f} {r['bwd']:8.2f} {r['both']:8.2f} "
                  f"{x3:8.3f} {x4:8.3f} {r['peak'] / 1024:9.2f} {r['err_h']:9.2e} {r['err_w']:9.2e} "
                  f"{r['host']:8.2f}")
    def row(r):
        g3, g4 = by.get(("3-gemm", r["N"], r["V"])), by.get(("4-gemm", r["N"], r["V"]))
        return [r["provider"], r["N"], r["H"], r["V"], "bf16", f"{r['fwd']:.4f}", f"{r['bwd']:.4f}",
                f"{r['both']:.4f}", f"{r['both'] / g3['both']:.4f}" if g3 else "",
                f"{r['both'] / g4['both']:.4f}" if g4 else "", f"{r['peak']:.1f}",
                f"{r['err_h']:.3e}", f"{r['err_w']:.3e}", f"{r['host']:.3f}", gpu, commit, peers.today()]

    path = peers.write_csv(out_dir, gpu, "linear-cross-entropy",
                           ["provider", "N", "H", "V", "dtype", "fwd_ms", "bwd_ms", "fwd_bwd_ms",
                            "x_3gemm", "x_4gemm", "peak_extra_mib", "dhidden_rel_err",
                            "dweight_rel_err", "host_ms", "gpu", "commit", "date"],
                           [row(r) for r in records])
    plt = peers.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(names), 1)
    for i, n in enumerate(names):
        xs = [k + i * width for k in range(len(shapes))]
        axes[0].bar(xs, [by[(n, N, V)]["both"] if (n, N, V) in by else 0 for N, _, V in shapes],
                    width, label=n)
        axes[1].bar(xs, [by[(n, N, V)]["peak"] / 1024 if (n, N, V) in by else 0
                         for N, _, V in shapes], width, label=n)
    for ax, label in zip(axes, ["forward+backward ms", "peak extra GiB (incl. gradients)"]):
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(shapes))])
        ax.set_xticklabels([f"{N}x{H}x{V}" for N, H, V in shapes])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"linear cross-entropy (bf16, mean) on {gpu}")
    fig.savefig(path.replace(".csv", ".png"), dpi=110, bbox_inches="tight")
    print(f"wrote {path.replace('.csv', '.png')}")
