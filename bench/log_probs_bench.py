"""The log-prob head (per-token log-probs at a temperature + entropy, bf16) against its peers and
against the GEMMs alone, in one run on one GPU (run through bench/run_bench.py log-probs).

Two measurements per shape:
  forward   the reference model / rollout scoring: no gradient (floor: 1 GEMM)
  fwd+bwd   the policy: upstream gradients of log_probs and entropy, as a clipped-ratio loss
            gives them after the forward (floor: 4 GEMMs: logits, their recompute, dhidden,
            dweight)

Providers (fn(hidden, weight, tokens) -> (log_probs, entropy)):
  1-gemm / 4-gemm      cuBLAS alone through torch matmuls
  torch                logits -> log_softmax(logits.float() / T) gathered, entropy from the
                       same [N, V] fp32 tensor (TRL's and verl's default)
  torch-chunked        the same 4096 tokens at a time, each chunk recomputed in the backward
                       (torch.utils.checkpoint)
  verl                 verl's Triton linear_cross_entropy with token entropy (the kernel
                       TransformerEngine ships), when importable
  fusedloss            fusedloss.linear_log_probs(hidden, weight, tokens, temperature=T)

Device time behind a GPU-side wait (peers.time_step), median of the runs; peak extra memory
above the inputs (gradients included); errors of log_probs and entropy against float64 from the
same bf16 inputs.
"""
import torch
import torch.utils.checkpoint as checkpoint

import peers

SHAPES = [(16384, 4096, 151936), (32768, 4096, 128256)]
DTYPE = torch.bfloat16
TEMPERATURE = 0.7


def gemms(n):
    def run(h, w, t):
        logits = h @ w.t()
        if n == 1:
            return logits[:, 0].float(), logits[:, 1].float()
        logits = h @ w.t()
        return (logits @ w).sum(-1).float(), (logits.t() @ h).sum(-1)[: h.size(0)].float()
    return run


def _torch_rows(h, w, t):
    logits = (h @ w.t()).float() / TEMPERATURE
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, t[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def torch_head(h, w, t):
    return _torch_rows(h, w, t)


def torch_chunked(h, w, t, chunk=4096):
    parts = [checkpoint.checkpoint(_torch_rows, h[i:i + chunk], w, t[i:i + chunk],
                                   use_reentrant=False)
             for i in range(0, h.size(0), chunk)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def verl():
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy
    return lambda h, w, t: linear_cross_entropy(h, w, t, TEMPERATURE)[:2]


def fusedloss_head(h, w, t):
    import fusedloss
    out = fusedloss.linear_log_probs(h, w, t, temperature=TEMPERATURE)
    return out.log_probs, out.entropy


def reference(h, w, t, chunk=2048):
    lp, ent = [], []
    w64 = w.double()
    for i in range(0, h.size(0), chunk):
        logp = torch.log_softmax((h[i:i + chunk].double() @ w64.t()) / TEMPERATURE, -1)
        lp.append(logp.gather(-1, t[i:i + chunk, None])[:, 0])
        ent.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(lp), torch.cat(ent)


def rel_err(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


def run(out_dir, commit, iters=10, warmup=2, shapes=None):
    gpu = torch.cuda.get_device_name()
    provs = peers.collect({"1-gemm": gemms(1), "4-gemm": gemms(4), "torch": torch_head,
                           "torch-chunked": torch_chunked, "fusedloss": fusedloss_head},
                          {"verl": verl})
    records = []
    for N, H, V in shapes or SHAPES:
        g = torch.Generator(device="cuda").manual_seed(N + V)
        h0 = torch.randn(N, H, device="cuda", generator=g).to(DTYPE)
        w0 = (torch.randn(V, H, device="cuda", generator=g) * H ** -0.5).to(DTYPE)
        t = torch.randint(0, V, (N,), device="cuda", generator=g)
        g_lp, g_ent = torch.randn(N, device="cuda", generator=g), torch.randn(N, device="cuda", generator=g)
        ref_lp, ref_ent = reference(h0, w0, t)
        for name, fn in provs.items():
            for phase in ("forward", "fwd+bwd"):
                grad = phase == "fwd+bwd"
                if grad and name == "1-gemm" or not grad and name == "4-gemm":
                    continue
                try:
                    def prepare():
                        return (h0.detach().requires_grad_(grad and "gemm" not in name),
                                w0.detach().requires_grad_(grad and "gemm" not in name))

                    def forward(h, w):
                        with torch.set_grad_enabled(grad):
                            return fn(h, w, t)

                    def backward(out, h, w):
                        torch.autograd.backward(out, (g_lp, g_ent))

                    f, b, fb, peak, host, (out, _) = peers.time_step(
                        prepare, forward, backward if grad and "gemm" not in name else None,
                        iters, warmup)
                except Exception as e:  # a peer that cannot run a shape is reported, not fatal
                    print(f"[bench] {name} {phase} failed at N={N} V={V}: {type(e).__name__}: {e}")
                    torch.cuda.empty_cache()
                    continue
                err_lp = err_ent = float("nan")
                if "gemm" not in name:
                    err_lp, err_ent = rel_err(out[0].detach(), ref_lp), rel_err(out[1].detach(), ref_ent)
                records.append(dict(provider=name, phase=phase, N=N, H=H, V=V, ms=fb, peak=peak,
                                    host=host, err_lp=err_lp, err_ent=err_ent))
                del out
                torch.cuda.empty_cache()
        del h0, w0, t, ref_lp, ref_ent
        torch.cuda.empty_cache()
    report(records, gpu, commit, out_dir)
    return records


def report(records, gpu, commit, out_dir):
    by = {(r["provider"], r["phase"], r["N"], r["V"]): r for r in records}
    print(f"\nlog-prob head on {gpu}; bf16, T = {TEMPERATURE}; device ms; commit {commit}")
    print(f"{'N, H, V':>20} {'phase':>8} {'provider':>14} {'ms':>9} {'x floor':>8} {'peak MiB':>9} "
          f"{'logp err':>9} {'ent err':>9} {'host ms':>8}")
    rows = []
    for r in records:
        floor = by.get(("1-gemm" if r["phase"] == "forward" else "4-gemm", r["phase"], r["N"], r["V"]))
        x = r["ms"] / floor["ms"] if floor else float("nan")
        shape = f"{r['N']}, {r['H']}, {r['V']}"
        print(f"{shape:>20} {r['phase']:>8} {r['provider']:>14} "
              f"{r['ms']:9.2f} {x:8.3f} {r['peak']:9.1f} {r['err_lp']:9.2e} {r['err_ent']:9.2e} "
              f"{r['host']:8.2f}")
        rows.append([r["provider"], r["phase"], r["N"], r["H"], r["V"], f"{r['ms']:.4f}", f"{x:.4f}",
                     f"{r['peak']:.1f}", f"{r['err_lp']:.3e}", f"{r['err_ent']:.3e}",
                     f"{r['host']:.3f}", gpu, commit, peers.today()])
    peers.write_csv(out_dir, gpu, "log-probs",
                    ["provider", "phase", "N", "H", "V", "ms", "x_floor", "peak_extra_mib",
                     "log_probs_rel_err", "entropy_rel_err", "host_ms", "gpu", "commit", "date"],
                    rows)
