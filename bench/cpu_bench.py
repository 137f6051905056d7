"""The CPU backend against torch's CPU ops for the same math, forward + backward, in one process.

  linear-ce   fusedloss.linear_cross_entropy(h, w, t) (mean: its in-forward backward, 3 GEMMs)
              against F.cross_entropy(F.linear(h, w), t)
  log-probs   fusedloss.linear_log_probs(h, w, t, temperature=T), log_probs and entropy into a
              loss with fixed upstream gradients (4 GEMMs: the backward recomputes the logits)
              against log_softmax(F.linear(h, w) / T), gather, -(p * logp).sum(-1)
  distill     fusedloss.linear_distillation_loss(h, w, th, tw, temperature=T), forward KL from
              a fixed teacher of the same shapes, mean over the tokens (6 GEMMs: the backward
              recomputes both logits) against the same loss through both [N, V] logits (the
              teacher's under no_grad)

Wall time of forward + backward (gradients of hidden and weight), the median of --reps runs (more
where a run is short) after one warm-up run; ratio = fusedloss / torch. Shapes: tokens x hidden x vocab. The CSV (--csv)
starts with comment lines naming the CPU, the threads, torch and the BLAS fusedloss was built with.

    python bench/cpu_bench.py [--dtypes float32 bfloat16] [--reps 3] [--shapes 4096x64x1000 ...]
                              [--csv bench/results/cpu-<machine>.csv]
"""
import argparse
import itertools
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import fusedloss

SHAPES = [(4096, 64, 1000), (2048, 1024, 32000), (1024, 2048, 128256)]
TEMPERATURE = 0.7


def torch_ce(h, w, t, g, e):
    return F.cross_entropy(F.linear(h, w), t)


def fusedloss_ce(h, w, t, g, e):
    return fusedloss.linear_cross_entropy(h, w, t)


def torch_log_probs(h, w, t, g, e):
    logp = torch.log_softmax(F.linear(h, w).float() / TEMPERATURE, -1)
    lp = logp.gather(-1, t[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    return (lp * g).sum() + (ent * e).sum()


def fusedloss_log_probs(h, w, t, g, e):
    out = fusedloss.linear_log_probs(h, w, t, temperature=TEMPERATURE)
    return (out.log_probs * g).sum() + (out.entropy * e).sum()


_TEACHERS = {}


def _teacher(h, w):
    """A fixed teacher of the student's shapes (made once per shape, outside the timing)."""
    key = (tuple(h.shape), tuple(w.shape), h.dtype)
    if key not in _TEACHERS:
        gen = torch.Generator().manual_seed(1)
        _TEACHERS[key] = (torch.randn(h.shape, generator=gen).to(h.dtype) * h.detach().float().std(),
                          torch.randn(w.shape, generator=gen).to(w.dtype))
    return _TEACHERS[key]


def torch_distill(h, w, t, g, e):
    th, tw = _teacher(h, w)
    with torch.no_grad():  # the teacher is a constant
        lp = torch.log_softmax(F.linear(th, tw).float() / TEMPERATURE, -1)
    lq = torch.log_softmax(F.linear(h, w).float() / TEMPERATURE, -1)
    return (lp.exp() * (lp - lq)).sum(-1).mean()


def fusedloss_distill(h, w, t, g, e):
    th, tw = _teacher(h, w)
    return fusedloss.linear_distillation_loss(h, w, th, tw, temperature=TEMPERATURE)


OPS = {"linear-ce": (fusedloss_ce, torch_ce), "log-probs": (fusedloss_log_probs, torch_log_probs),
       "distill": (fusedloss_distill, torch_distill)}


def seconds(fn, args, reps):
    """Median wall time of fn(*args).backward() after one warm-up run: over reps runs, or as
    many as fill about 2 s when the warm-up was shorter (at most 50)."""
    h, w = args[0], args[1]

    def once():
        h.grad = w.grad = None
        start = time.perf_counter()
        fn(*args).backward()
        return time.perf_counter() - start

    warm = once()
    runs = max(reps, min(50, int(2.0 / max(warm, 1e-6))))
    return statistics.median(once() for _ in range(runs))


def cpu_model():
    """The CPU's model name, family and model number (a name alone may say only "AMD EPYC")."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or "unknown CPU"
    flags = fields.get("flags", "").split()
    isa = ", AVX-512" if "avx512f" in flags else ""
    isa += " with BF16" if isa and "avx512_bf16" in flags else ""
    return (f"{fields.get('model name', 'unknown CPU')} (family {fields.get('cpu family', '?')} "
            f"model {fields.get('model', '?')}{isa})")


def header_lines():
    info = fusedloss.build_info()
    blas = ", ".join(os.path.realpath(p) for p in info.get("blas_libraries", [])) or "none (plain loops)"
    return [f"CPU: {cpu_model()}, {os.cpu_count()} cores visible",
            f"threads: torch {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
            f"torch {torch.__version__}; fusedloss {info['version']}, BLAS: {blas}; bf16 GEMMs: "
            + (f"oneDNN {info.get('dnnl_version')}" if info.get("cpu_bf16_dnnl") else "the BLAS, on fp32 tiles"),
            "forward + backward, median of the runs after a warm-up; ratio = fusedloss / torch"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="*", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shapes", nargs="*", default=[f"{n}x{h}x{v}" for n, h, v in SHAPES],
                    help="tokens x hidden x vocab")
    ap.add_argument("--ops", nargs="*", default=list(OPS), choices=list(OPS))
    ap.add_argument("--csv", help="write the results here")
    args = ap.parse_args()
    header = header_lines()
    for line in header:
        print("#", line)
    rows = []
    print(f"{'op':10} {'N':>6} {'H':>6} {'V':>7} {'dtype':9} {'fusedloss ms':>12} {'torch ms':>10} "
          f"{'ratio':>6}")
    for shape, dtype in itertools.product(args.shapes, args.dtypes):
        n, hid, v = (int(x) for x in shape.split("x"))
        gen = torch.Generator().manual_seed(0)
        h = (torch.randn(n, hid, generator=gen) / hid ** 0.5).to(getattr(torch, dtype))
        w = torch.randn(v, hid, generator=gen).to(h.dtype)
        t = torch.randint(0, v, (n,), generator=gen)
        g, e = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        inputs = (h.requires_grad_(), w.requires_grad_(), t, g, e)
        for op in args.ops:
            ours, theirs = OPS[op]
            ms = [1e3 * seconds(fn, inputs, args.reps) for fn in (ours, theirs)]
            rows.append((op, n, hid, v, dtype, ms[0], ms[1], ms[0] / ms[1]))
            print(f"{op:10} {n:6} {hid:6} {v:7} {dtype:9} {ms[0]:12.1f} {ms[1]:10.1f} "
                  f"{ms[0] / ms[1]:6.2f}", flush=True)
        del h, w, inputs
    if args.csv:
        with open(args.csv, "w") as f:
            f.writelines(f"# {line}\n" for line in header)
            f.write("op,tokens,hidden,vocab,dtype,fusedloss_ms,torch_ms,ratio\n")
            for r in rows:
                f.write(",".join(str(x) for x in r[:5]) + f",{r[5]:.2f},{r[6]:.2f},{r[7]:.3f}\n")


if __name__ == "__main__":
    main()
