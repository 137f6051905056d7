"""Linear cross-entropy (LM head + mean loss, bf16, forward+backward) against its peers and
against the GEMMs alone, in one run on one GPU (run through bench/run_bench.py
linear-cross-entropy).

Providers (fn(hidden, weight, target) -> mean loss; hidden and weight are fresh leaves):
  3-gemm / 4-gemm      cuBLAS alone through torch matmuls: logits, dhidden, dweight (+ the
                       recompute's second logits GEMM); no loss: the floor for each mode
  torch                F.linear + F.cross_entropy (unfused, bf16: the accuracy yardstick)
  liger                Liger-Kernel's LigerFusedLinearCrossEntropyLoss() (if importable)
  cce                  Apple's cut_cross_entropy.linear_cross_entropy, its default (if importable)
  quack                QuACK's chunked_linear_cross_entropy, its default (the SM90 scaled-exp
                       pipeline where eligible) (if importable)
  fusedloss            fusedloss.linear_cross_entropy(h, w, t): the call with no options
  fusedloss-fp32       dweight_accumulation="fp32": exact fp32 accumulation (an fp32 [V, H] kept
                       until the backward)
  fusedloss-recompute  backward_mode="recompute" (4 GEMMs), the default accumulation

Device time: CUDA events behind a GPU-side wait (peers.py), median of the runs. Peak extra:
torch's allocator high-water mark above the inputs, including the gradients dhidden [N, H] and
dweight [V, H] every provider must produce. Gradient error: relative L2 error of dhidden and
dweight against a float64 reference computed from the same bf16 inputs.

Pipeline variants (--variants of run_bench.py): each fusedloss provider also runs as
name[variant], with the FUSEDLOSS_LCE_* knobs of src/core/lce_tuning.h set for its calls (or a
larger workspace), and then once more with FUSEDLOSS_LCE_TIMING=1: the device time per phase of
the chunk loops (logits GEMMs, cross-entropy steps, dhidden GEMMs, dweight GEMMs, the whole
loops; summed over one forward+backward) is printed per provider, so one run shows where the
time goes and which variant wins.
"""

import os

import torch
import torch.nn.functional as F

import peers

SHAPES = [(4096, 4096, 128256), (8192, 4096, 128256), (16384, 4096, 151936),
          (32768, 4096, 128256), (8192, 8192, 256000)]
DTYPE = torch.bfloat16

# name -> (FUSEDLOSS_LCE_* settings, workspace_bytes or None); "default" is what ships.
VARIANTS = {
    "default": ({}, None),
    "dh-group": ({"FUSEDLOSS_LCE_DHIDDEN": "group"}, None),
    "two-buffers": ({"FUSEDLOSS_LCE_BUFFERS": "2"}, None),
    "serial": ({"FUSEDLOSS_LCE_SIDE_STREAM": "0"}, None),
    "algos8": ({"FUSEDLOSS_LCE_GEMM_ALGOS": "8"}, None),
    "dh-group+algos8": ({"FUSEDLOSS_LCE_DHIDDEN": "group", "FUSEDLOSS_LCE_GEMM_ALGOS": "8"}, None),
    "two-buffers+algos8": ({"FUSEDLOSS_LCE_BUFFERS": "2", "FUSEDLOSS_LCE_GEMM_ALGOS": "8"}, None),
    "ce-rows128": ({"FUSEDLOSS_LCE_CE_ROWS": "128"}, None),
    "dh-group+ce-rows128": ({"FUSEDLOSS_LCE_DHIDDEN": "group", "FUSEDLOSS_LCE_CE_ROWS": "128"}, None),
    "ce-rows64": ({"FUSEDLOSS_LCE_CE_ROWS": "64"}, None),
    "dh-pieces2": ({"FUSEDLOSS_LCE_DH_PIECES": "2"}, None),
    "dh-pieces3": ({"FUSEDLOSS_LCE_DH_PIECES": "3"}, None),
    "dh-pieces2+algos8": ({"FUSEDLOSS_LCE_DH_PIECES": "2", "FUSEDLOSS_LCE_GEMM_ALGOS": "8"}, None),
    "dh-pieces2+ce-rows64": ({"FUSEDLOSS_LCE_DH_PIECES": "2", "FUSEDLOSS_LCE_CE_ROWS": "64"}, None),
    "ws288": ({}, 288 << 20),  # the chunk of 256 MiB beside cuBLASLt's 32 MiB (before 2026-12-04)
    "gemm-ws32": ({"FUSEDLOSS_LCE_GEMM_WORKSPACE_MIB": "32"}, None),  # 768 tokens at V 128256
    "gemm-ws4": ({"FUSEDLOSS_LCE_GEMM_WORKSPACE_MIB": "4"}, None),  # the default: 1024 tokens
    "gemm-ws1": ({"FUSEDLOSS_LCE_GEMM_WORKSPACE_MIB": "1"}, None),
    "gemm-ws0": ({"FUSEDLOSS_LCE_GEMM_WORKSPACE_MIB": "0"}, None),
    "ws512": ({}, 512 << 20),
    "ws1024": ({}, 1024 << 20),
}
KNOBS = ("FUSEDLOSS_LCE_BUFFERS", "FUSEDLOSS_LCE_DHIDDEN", "FUSEDLOSS_LCE_SIDE_STREAM",
         "FUSEDLOSS_LCE_GEMM_ALGOS", "FUSEDLOSS_LCE_CE_ROWS", "FUSEDLOSS_LCE_DH_PIECES",
         "FUSEDLOSS_LCE_GEMM_WORKSPACE_MIB", "FUSEDLOSS_LCE_TIMING")


def set_knobs(env):
    """The FUSEDLOSS_LCE_* environment exactly as env says (the others unset); the C++ core
    reads it at every call."""
    for k in KNOBS:
        if k in env:
            os.environ[k] = env[k]
        else:
            os.environ.pop(k, None)


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


def quack():
    from quack.linear_cross_entropy import chunked_linear_cross_entropy
    return lambda h, w, t: chunked_linear_cross_entropy(h, w, t)


class FusedlossLce:
    """fusedloss.linear_cross_entropy with the keyword options `kwargs` (none: the default call)
    in one pipeline variant; the variant's knobs are set on every call (the backward follows in
    the same step, under the same knobs)."""
    def __init__(self, kwargs, variant, timing=False):
        import fusedloss
        self.op = fusedloss.linear_cross_entropy
        self.kwargs, self.variant = kwargs, variant
        env, workspace = VARIANTS[variant]
        self.call_kwargs = dict(kwargs) if workspace is None else dict(kwargs, workspace_bytes=workspace)
        self.env = dict(env, FUSEDLOSS_LCE_TIMING="1") if timing else env

    def __call__(self, h, w, t):
        set_knobs(self.env)
        return self.op(h, w, t, **self.call_kwargs)


MODES = {"fusedloss": {},
         "fusedloss-fp32": {"dweight_accumulation": "fp32"},
         "fusedloss-recompute": {"backward_mode": "recompute"}}


def providers(variants=("default",)):
    found = {"3-gemm": gemms(3), "4-gemm": gemms(4), "torch": torch_lce}
    ours = {}
    for v in variants:
        for name, kwargs in MODES.items():
            ours[name if v == "default" else f"{name}[{v}]"] = (
                lambda kwargs=kwargs, v=v: FusedlossLce(kwargs, v))
    return peers.collect(found, {"liger": liger, "cce": cce, "quack": quack, **ours})


def phase_times(fn, h0, w0, t):
    """One forward+backward of a fusedloss provider with FUSEDLOSS_LCE_TIMING=1: the phase sums
    of its chunk loops (ms), or None for the other providers."""
    if not isinstance(fn, FusedlossLce):
        return None
    import fusedloss._C as C
    timed = FusedlossLce(fn.kwargs, fn.variant, timing=True)
    h, w = h0.detach().requires_grad_(), w0.detach().requires_grad_()
    torch.cuda.synchronize()
    C.linear_cross_entropy_phase_times(True)
    timed(h, w, t).backward()
    torch.cuda.synchronize()
    set_knobs({})
    return C.linear_cross_entropy_phase_times(True)


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


def run(out_dir, commit, iters=10, warmup=2, variants=("default",), shapes=None):
    gpu = torch.cuda.get_device_name()
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"variants: got {unknown}, expected some of {list(VARIANTS)}")
    provs = providers(variants)
    names = list(provs)
    records, phases = [], []
    for N, H, V in shapes or SHAPES:
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
            ph = phase_times(fn, h0, w0, t)
            if ph is not None:
                phases.append(dict(ph, provider=name, N=N, H=H, V=V, both=fb))
            torch.cuda.empty_cache()
        del h0, w0, t, ref_dh, ref_dw
        torch.cuda.empty_cache()
    set_knobs({})
    report(records, names, gpu, commit, out_dir)
    report_phases(phases, records, gpu, commit, out_dir)
    return records


def report_phases(phases, records, gpu=None, commit=None, out_dir=None):
    """Per fusedloss provider: the phase sums of one timed forward+backward, against the GEMM
    floor of its mode (3 GEMMs for in_forward, 4 for recompute)."""
    if not phases:
        return
    floor = {(r["provider"], r["N"], r["V"]): r["both"] for r in records}
    print("\nchunk-loop phases: device ms summed over one forward+backward (FUSEDLOSS_LCE_TIMING=1)."
          "\n  GEMMs = logits + dhidden + dweight; loops = the chunk loops end to end (the CE on the"
          " side stream overlaps the GEMMs, so loops < GEMMs + CE when it hides);"
          "\n  other = fwd+bwd (the untimed median above) - loops: scaling, reductions, allocations;"
          " x floor = fwd+bwd / the mode's GEMM floor; GEMMs x = GEMMs / that floor")
    print(f"{'N, H, V':>20} {'provider':>40} {'logits':>8} {'CE':>7} {'dhidden':>8} {'dweight':>8} "
          f"{'GEMMs':>8} {'loops':>8} {'other':>7} {'fwd+bwd':>8} {'x floor':>8} {'GEMMs x':>8}")
    for p in phases:
        g = p["logits_ms"] + p["dhidden_ms"] + p["dweight_ms"]
        fl = floor.get(("4-gemm" if "recompute" in p["provider"] else "3-gemm", p["N"], p["V"]))
        x = p["both"] / fl if fl else float("nan")
        gx = g / fl if fl else float("nan")
        shape = f"{p['N']}, {p['H']}, {p['V']}"
        print(f"{shape:>20} {p['provider']:>40} {p['logits_ms']:8.2f} {p['ce_ms']:7.2f} "
              f"{p['dhidden_ms']:8.2f} {p['dweight_ms']:8.2f} {g:8.2f} {p['loop_ms']:8.2f} "
              f"{p['both'] - p['loop_ms']:7.2f} {p['both']:8.2f} {x:8.3f} {gx:8.3f}")
    if out_dir is not None:
        keys = ["logits_ms", "ce_ms", "dhidden_ms", "dweight_ms", "loop_ms", "loops", "both"]
        peers.write_csv(out_dir, gpu, "linear-cross-entropy-phases",
                        ["provider", "N", "H", "V"] + keys[:-1] + ["fwd_bwd_ms", "gpu", "commit",
                                                                    "date"],
                        [[p["provider"], p["N"], p["H"], p["V"]] +
                         [f"{p[k]:.4f}" if k != "loops" else p[k] for k in keys] +
                         [gpu, commit, peers.today()] for p in phases])


def gradient_mib(N, H, V):
    """The bf16 gradients dhidden [N, H] and dweight [V, H] every provider returns (MiB)."""
    return 2 * (N + V) * H / 2**20


def report_targets(by, shapes):
    """The default call (3 GEMMs) and the recompute mode (4 GEMMs) against the targets: time
    over its mode's GEMM floor <= 1.05, peak extra memory <= the gradients + 320 MiB, dhidden
    and dweight errors against float64 <= 1.25x those of torch's unfused bf16 path."""
    print("\ntargets: time x its GEMM floor <= 1.05; peak - gradients <= 320 MiB; "
          "error / torch's <= 1.25 (dhidden, dweight)")
    for N, H, V in shapes:
        torch_r = by.get(("torch", N, V))
        for name, floor_name in (("fusedloss", "3-gemm"), ("fusedloss-recompute", "4-gemm")):
            r, floor = by.get((name, N, V)), by.get((floor_name, N, V))
            if r is None or floor is None:
                continue
            x = r["both"] / floor["both"]
            over = r["peak"] - gradient_mib(N, H, V)
            eh = r["err_h"] / torch_r["err_h"] if torch_r else float("nan")
            ew = r["err_w"] / torch_r["err_w"] if torch_r else float("nan")
            verdict = ["time" if x > 1.05 else "", "memory" if over > 320 else "",
                       "error" if max(eh, ew) > 1.25 else ""]
            missed = ",".join(v for v in verdict if v) or "met"
            print(f"{f'{N}, {H}, {V}':>20} {name:>22} x{floor_name} {x:6.3f}  peak-grads "
                  f"{over:7.1f} MiB  err/torch dh {eh:5.2f} dw {ew:5.2f}  -> {missed}")


def report(records, names, gpu, commit, out_dir):
    by = {(r["provider"], r["N"], r["V"]): r for r in records}
    shapes = sorted({(r["N"], r["H"], r["V"]) for r in records})
    print(f"\nlinear cross-entropy on {gpu}; bf16, mean loss, forward+backward device ms; commit {commit}")
    print(f"{'N, H, V':>20} {'provider':>40} {'fwd':>8} {'bwd':>8} {'fwd+bwd':>8} {'x 3gemm':>8} "
          f"{'x 4gemm':>8} {'peak GiB':>9} {'dh err':>9} {'dw err':>9} {'host ms':>8}")
    for N, H, V in shapes:
        g3, g4 = by.get(("3-gemm", N, V)), by.get(("4-gemm", N, V))
        for n in names:
            r = by.get((n, N, V))
            if r is None:
                continue
            x3 = r["both"] / g3["both"] if g3 else float("nan")
            x4 = r["both"] / g4["both"] if g4 else float("nan")
            print(f"{f'{N}, {H}, {V}':>20} {n:>40} {r['fwd']:8.2f} {r['bwd']:8.2f} {r['both']:8.2f} "
                  f"{x3:8.3f} {x4:8.3f} {r['peak'] / 1024:9.2f} {r['err_h']:9.2e} {r['err_w']:9.2e} "
                  f"{r['host']:8.2f}")
    report_targets(by, shapes)

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
    peers.plot_time_and_memory(
        path, names, shapes,
        lambda n, N, V, key: by[(n, N, V)][key] if (n, N, V) in by else 0,
        f"linear cross-entropy (bf16, mean) on {gpu}", lambda N, H, V: f"{N}x{H}x{V}")
