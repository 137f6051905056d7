"""Linear distillation (both LM heads + a divergence, mean over the tokens, bf16,
forward+backward) against its peers and against the GEMMs alone, in one run on one GPU (run
through bench/run_bench.py distillation).

The loss: JSD with beta 0.5 at temperature 1.0, mean over the tokens, no target (the case
Liger-Kernel's fused linear JSD covers); fusedloss's forward KL default beside it. Student and
teacher of one width H; the teacher's tensors are constants, the student's hidden states and
weight fresh leaves that get gradients.

Providers (fn(student_hidden, student_weight, teacher_hidden, teacher_weight) -> mean loss):
  4-gemm          cuBLAS alone through torch matmuls: the student's and the teacher's logits,
                  dhidden = G @ W_s and dweight = G^T @ h_s (G: the student's logits standing in
                  for their gradient); no loss math: the floor of a fused op
  6-gemm          the same plus both logits again: the floor of a backward that recomputes them
                  (fusedloss's does)
  torch           F.linear for both logits (bf16), log_softmax in fp32, the JSD written out
                  (m = beta p + (1 - beta) q in log space), mean: unfused, the accuracy yardstick
  liger           Liger-Kernel's LigerFusedLinearJSD(jsd_beta=BETA, temperature=...) (if
                  importable): the gradients are computed in its forward
  fusedloss       fusedloss.linear_distillation_loss(..., divergence="jsd", beta=BETA)
  fusedloss-fkl   fusedloss.linear_distillation_loss(...): divergence="forward_kl", its default
  fusedloss-clusters  fusedloss's jsd with FUSEDLOSS_DISTILL_CLUSTERS=1: each row pair in a
                  thread-block cluster's shared memory (sm_90), read once, instead of the
                  one-block-a-row kernels that read it up to three times
  fusedloss-slices, fusedloss-fkl-slices  jsd and forward_kl with
                  FUSEDLOSS_DISTILL_TEACHER_ROWS=256: the teacher's logits 256 rows at a time,
                  the student's chunks longer (fewer dweight GEMMs) in the same workspace

Device time: CUDA events behind a GPU-side wait (peers.time_step), median of the runs; host
time to enqueue forward+backward beside it. Peak extra: torch's allocator's high-water mark (and
the stream-ordered pool's) above the inputs, including the student's gradients dhidden [N, H]
and dweight [V, H] every provider must produce. Gradient error: relative L2 error of dhidden and
dweight (and of the loss) against a float64 reference from the same bf16 inputs, a token chunk
at a time, at the shapes of at most REFERENCE_TOKENS tokens (its float64 [V, H] weights,
gradient and chunk logits are some 20 GB at V 151936; larger shapes report no error). A
provider that runs out of memory at a shape is recorded as OOM there and the run goes on.

Targets (printed): fusedloss fwd+bwd <= 1.10x the 4-gemm floor, peak extra memory <= the
student's gradients + 320 MiB.
"""
import math
import os

import torch
import torch.nn.functional as F

import peers
from lce_bench import gradient_mib, rel_err

# tokens x hidden x vocab (bf16); the same H for the student and the teacher
SHAPES = [(4096, 4096, 128256), (4096, 4096, 151936), (16384, 4096, 128256),
          (16384, 4096, 151936)]
DTYPE = torch.bfloat16
BETA = 0.5
TEMPERATURE = 1.0
REFERENCE_TOKENS = 4096
TARGET_X_FLOOR = 1.10
TARGET_EXTRA_MIB = 320


# ---- the divergence over log-probabilities (the torch provider's and the reference's) ----

def divergence_rows(ls, lt, divergence, beta=BETA):
    """Per-token divergence from the student's log-probs ls and the teacher's lt ([N, V], one
    dtype), as include/fusedloss/linear_distillation.h defines it: q = exp(ls), p = exp(lt);
    forward_kl KL(p || q); jsd beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q
    (log m by logaddexp: no log of an underflowed sum)."""
    p = lt.exp()
    if divergence == "forward_kl":
        return (p * (lt - ls)).sum(-1)
    lm = torch.logaddexp(lt + math.log(beta), ls + math.log(1 - beta))
    return beta * (p * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)


# ---- providers ----

def gemms(n):
    """The GEMMs of the fused op alone, on the same operands (the student's logits stand in for
    their gradient G): what a perfect fusion with the loss hidden underneath would take."""
    def run(sh, sw, th, tw):
        zs, zt = sh @ sw.t(), th @ tw.t()
        if n == 6:  # the backward's recompute of both logits
            zs, zt = sh @ sw.t(), th @ tw.t()
        return zs @ sw, zs.t() @ sh, zt
    return run


def torch_distill(sh, sw, th, tw, divergence="jsd"):
    ls = torch.log_softmax(F.linear(sh, sw).float() / TEMPERATURE, -1)
    with torch.no_grad():  # the teacher is a constant
        lt = torch.log_softmax(F.linear(th, tw).float() / TEMPERATURE, -1)
    return divergence_rows(ls, lt, divergence).mean()


def liger():
    from liger_kernel.transformers import LigerFusedLinearJSD
    # Liger's jsd_beta weighs the teacher P, as fusedloss's beta does: its _jsd_kernel
    # (src/liger_kernel/ops/jsd.py) takes X = log Q (the student, "_input") and Y = log P (the
    # teacher, "target"); at commit ead96b6 (lines 79-84)
    #     beta_P = beta * P;  one_minus_beta_Q = (1 - beta) * Q;  M = beta_P + one_minus_beta_Q
    #     loss = beta_P * Y + one_minus_beta_Q * X - M * log_M
    # and in the 0.8.5 wheel (line 86) loss = beta_P * (Y - log_M) + one_minus_beta_Q * (X - log_M):
    # summed over the vocabulary, beta KL(P || M) + (1 - beta) KL(Q || M), fusedloss's jsd with
    # p = the teacher. So jsd_beta = beta, unchanged (0 < beta < 1; Liger's 0 and 1 are forward
    # and reverse KL). Its mean divides by the tokens (n_non_ignore = BT without labels), with no
    # temperature ** 2 factor: the loss fusedloss computes. From 0.8.5 its GEMMs give fp32 logits
    # of bf16 operands (_project_to_float32), where fusedloss and torch keep bf16 logits: against
    # this file's float64 reference (the exact logits) that is an accuracy difference in bf16.
    loss = LigerFusedLinearJSD(jsd_beta=BETA, temperature=TEMPERATURE)
    return lambda sh, sw, th, tw: loss(sh, sw, th, tw, None)  # shift_labels: no default


def fusedloss_provider(env=None, **options):
    """fusedloss's loss with `options`; env: variables set around each call (the CUDA backend
    reads its kernel choices at every call)."""
    def make():
        import fusedloss
        op = fusedloss.linear_distillation_loss
        if not env:
            return lambda sh, sw, th, tw: op(sh, sw, th, tw, **options)

        def call(sh, sw, th, tw):
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                return op(sh, sw, th, tw, **options)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k)
                    else:
                        os.environ[k] = v
        return call
    return make


# the divergence each provider's loss is (its gradients' reference); None: no loss (a floor)
DIVERGENCE = {"4-gemm": None, "6-gemm": None, "torch": "jsd", "liger": "jsd",
              "fusedloss": "jsd", "fusedloss-fkl": "forward_kl", "fusedloss-clusters": "jsd",
              "fusedloss-slices": "jsd", "fusedloss-fkl-slices": "forward_kl"}
FUSEDLOSS = [name for name in DIVERGENCE if name.startswith("fusedloss")]
SLICES = {"FUSEDLOSS_DISTILL_TEACHER_ROWS": "256"}
PEERS = ("torch", "liger")


def providers():
    return peers.collect({"4-gemm": gemms(4), "6-gemm": gemms(6), "torch": torch_distill},
                         {"liger": liger,
                          "fusedloss": fusedloss_provider(divergence="jsd", beta=BETA),
                          "fusedloss-fkl": fusedloss_provider(divergence="forward_kl"),
                          # jsd with the row kernels in clusters (opt-in until measured)
                          "fusedloss-clusters": fusedloss_provider(
                              {"FUSEDLOSS_DISTILL_CLUSTERS": "1"}, divergence="jsd", beta=BETA),
                          "fusedloss-slices": fusedloss_provider(SLICES, divergence="jsd",
                                                                 beta=BETA),
                          "fusedloss-fkl-slices": fusedloss_provider(
                              SLICES, divergence="forward_kl")})


# ---- measurement ----

def time_provider(name, fn, sh0, sw0, th, tw, iters, warmup):
    """peers.time_step of one provider on fresh student leaves (the GEMM floors without a
    backward); its numbers, the last run's loss and the student's gradients (None for a floor)."""
    raw = DIVERGENCE[name] is None
    f, b, fb, peak, host, (out, (h, w)) = peers.time_step(
        lambda: (sh0.detach().requires_grad_(not raw), sw0.detach().requires_grad_(not raw)),
        lambda h, w: fn(h, w, th, tw), None if raw else (lambda out, h, w: out.backward()),
        iters, warmup)
    if raw:
        return f, b, fb, peak, host, None
    return f, b, fb, peak, host, (out.detach(), h.grad, w.grad)


def reference(sh, sw, th, tw, divergence, chunk=1024):
    """Float64 loss, dhidden and dweight of the mean divergence from the bf16 inputs, a token
    chunk at a time (autograd through the chunk's float64 logits)."""
    sw64, tw64 = sw.double(), tw.double()
    n = sh.size(0)
    loss = torch.zeros((), dtype=torch.float64, device=sh.device)
    dh = torch.empty(sh.shape, dtype=torch.float64, device=sh.device)
    dw = torch.zeros_like(sw64)
    for r0 in range(0, n, chunk):
        h = sh[r0:r0 + chunk].double()
        z = (h @ sw64.t()).requires_grad_(True)
        with torch.no_grad():
            lt = torch.log_softmax(th[r0:r0 + chunk].double() @ tw64.t() / TEMPERATURE, -1)
        part = divergence_rows(torch.log_softmax(z / TEMPERATURE, -1), lt, divergence).sum() / n
        (g,) = torch.autograd.grad(part, z)
        loss += part.detach()
        dh[r0:r0 + chunk] = g @ sw64
        dw += g.t() @ h
        del z, lt, part, g
    return loss, dh, dw


def run(out_dir, commit, iters=10, warmup=2, shapes=None):
    gpu = torch.cuda.get_device_name()
    provs = providers()
    names = list(provs)
    records = []
    for N, H, V in shapes or SHAPES:
        g = torch.Generator(device="cuda").manual_seed(N + V)
        sh0 = torch.randn(N, H, device="cuda", generator=g).to(DTYPE)
        sw0 = (torch.randn(V, H, device="cuda", generator=g) * H ** -0.5).to(DTYPE)
        th0 = torch.randn(N, H, device="cuda", generator=g).to(DTYPE)
        tw0 = (torch.randn(V, H, device="cuda", generator=g) * H ** -0.5).to(DTYPE)
        refs = {}
        if N <= REFERENCE_TOKENS:
            for d in sorted({d for n, d in DIVERGENCE.items() if d and n in provs}):
                refs[d] = reference(sh0, sw0, th0, tw0, d)
            torch.cuda.empty_cache()
        for name, fn in provs.items():
            rec = dict(provider=name, N=N, H=H, V=V, status="ok", fwd=math.nan, bwd=math.nan,
                       both=math.nan, peak=math.nan, host=math.nan, err_loss=math.nan,
                       err_h=math.nan, err_w=math.nan)
            try:
                f, b, fb, peak, host, got = time_provider(name, fn, sh0, sw0, th0, tw0, iters, warmup)
            except torch.cuda.OutOfMemoryError:
                rec["status"] = "OOM"
                print(f"[bench] {name} ran out of memory at N={N} V={V}: recorded as OOM")
            except Exception as e:  # a provider that cannot run (a refusal, a bug) is named, not fatal
                print(f"[bench] {name} failed at N={N} V={V}: {type(e).__name__}: {e}")
                rec = None
            else:
                rec.update(fwd=f, bwd=b, both=fb, peak=peak, host=host)
                ref = refs.get(DIVERGENCE[name])
                if got is not None and ref is not None:
                    rec.update(err_loss=rel_err(got[0], ref[0]), err_h=rel_err(got[1], ref[1]),
                               err_w=rel_err(got[2], ref[2]))
                del got
            if rec is not None:
                records.append(rec)
            torch.cuda.empty_cache()  # after the except block: a caught error's frames are gone
        del sh0, sw0, th0, tw0, refs
        torch.cuda.empty_cache()
    report(records, names, gpu, commit, out_dir)
    return records


# ---- report ----

def _ratio(r, other):
    """r's fwd+bwd over other's: nan where either is missing or OOM."""
    if other is None or r["status"] != "ok" or other["status"] != "ok":
        return math.nan
    return r["both"] / other["both"]


def report_targets(by, shapes):
    """fusedloss (jsd) against the targets: fwd+bwd over the 4-GEMM floor <= 1.10, peak extra
    memory <= the student's gradients + 320 MiB; its errors over torch's beside them."""
    print(f"\ntargets: fusedloss fwd+bwd x 4-gemm <= {TARGET_X_FLOOR:.2f}; peak - the student's "
          f"gradients <= {TARGET_EXTRA_MIB} MiB  (error / torch's: for information)")
    if not any(name.startswith("fusedloss") for name, _, _ in by):
        print("  fusedloss not measured (unavailable or failed at every shape: see [bench] above)")
    for N, H, V in shapes:
        for name in FUSEDLOSS:
            r = by.get((name, N, V))
            if r is None:
                continue
            if r["status"] != "ok":
                print(f"{f'{N}, {H}, {V}':>20} {name:>14} {r['status']} -> missed")
                continue
            x = _ratio(r, by.get(("4-gemm", N, V)))
            over = r["peak"] - gradient_mib(N, H, V)
            t = by.get(("torch", N, V)) if name == "fusedloss" else None
            eh = r["err_h"] / t["err_h"] if t else math.nan
            ew = r["err_w"] / t["err_w"] if t else math.nan
            missed = ",".join(v for v, bad in (("time", not x <= TARGET_X_FLOOR),
                                               ("memory", over > TARGET_EXTRA_MIB)) if bad) or "met"
            print(f"{f'{N}, {H}, {V}':>20} {name:>14} x4gemm {x:6.3f}  peak-grads {over:8.1f} MiB  "
                  f"err/torch dh {eh:5.2f} dw {ew:5.2f}  -> {missed}")


def report(records, names, gpu, commit, out_dir):
    by = {(r["provider"], r["N"], r["V"]): r for r in records}
    shapes = sorted({(r["N"], r["H"], r["V"]) for r in records})
    print(f"\nlinear distillation on {gpu}; bf16, jsd beta {BETA} (fusedloss-fkl: forward KL), "
          f"temperature {TEMPERATURE}, mean, no target; forward+backward device ms; commit {commit}")
    peer_cols = "".join(f" {'x ' + p:>9}" for p in PEERS)
    print(f"{'N, H, V':>22} {'provider':>14} {'fwd':>8} {'bwd':>8} {'fwd+bwd':>8} {'x 4gemm':>8} "
          f"{'x 6gemm':>8}{peer_cols} {'peak MiB':>9} {'-grads':>8} {'loss err':>9} {'dh err':>9} "
          f"{'dw err':>9} {'host ms':>8}")
    rows = []
    for N, H, V in shapes:
        g4, g6 = by.get(("4-gemm", N, V)), by.get(("6-gemm", N, V))
        grads = gradient_mib(N, H, V)
        for n in names:
            r = by.get((n, N, V))
            if r is None:
                continue
            shape = f"{N}, {H}, {V}"
            xs = [_ratio(r, g4), _ratio(r, g6)] + [_ratio(r, by.get((p, N, V))) for p in PEERS]
            if r["status"] != "ok":
                print(f"{shape:>22} {n:>14} {r['status']:>8}")
            else:
                print(f"{shape:>22} {n:>14} {r['fwd']:8.2f} {r['bwd']:8.2f} {r['both']:8.2f} "
                      + " ".join(f"{x:8.3f}" for x in xs[:2])
                      + "".join(f" {x:9.3f}" for x in xs[2:])
                      + f" {r['peak']:9.1f} {r['peak'] - grads:8.1f} {r['err_loss']:9.2e} "
                      f"{r['err_h']:9.2e} {r['err_w']:9.2e} {r['host']:8.2f}")
            num = (lambda v, fmt: "" if math.isnan(v) else fmt % v)
            rows.append([n, N, H, V, "bf16", r["status"], num(r["fwd"], "%.4f"),
                         num(r["bwd"], "%.4f"), num(r["both"], "%.4f")]
                        + [num(x, "%.4f") for x in xs]
                        + [num(r["peak"], "%.1f"), num(r["peak"] - grads, "%.1f"),
                           num(r["err_loss"], "%.3e"), num(r["err_h"], "%.3e"),
                           num(r["err_w"], "%.3e"), num(r["host"], "%.3f"), gpu, commit,
                           peers.today()])
    report_targets(by, shapes)
    path = peers.write_csv(out_dir, gpu, "distillation",
                           ["provider", "N", "H", "V", "dtype", "status", "fwd_ms", "bwd_ms",
                            "fwd_bwd_ms", "x_4gemm", "x_6gemm"] + [f"x_{p}" for p in PEERS]
                           + ["peak_extra_mib", "peak_minus_grads_mib", "loss_rel_err",
                              "dhidden_rel_err", "dweight_rel_err", "host_ms", "gpu", "commit",
                              "date"],
                           rows)

    def value(n, N, V, key):
        r = by.get((n, N, V))
        return r[key] if r is not None and r["status"] == "ok" else 0

    peers.plot_time_and_memory(
        path, names, shapes, value,
        f"linear distillation (bf16, jsd beta {BETA}, mean) on {gpu}; OOM: no bar",
        lambda N, H, V: f"N {N}, H {H}\nV {V}")
