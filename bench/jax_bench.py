"""fusedloss.jax against a plain JAX LM head and cross-entropy, in one run on one device.

    python bench/jax_bench.py [--out DIR] [--shapes N,H,V ...] [--iters K]

Two ops, value and gradients (jax.value_and_grad under jit), bf16 inputs, mean loss:
  linear-cross-entropy  fj.linear_cross_entropy(hidden, weight, target) against
                        logits = hidden @ weight.T (bf16), then
                        optax.softmax_cross_entropy_with_integer_labels on fp32 logits (the
                        same in jnp where optax is missing): gradients of hidden and weight
  cross-entropy         fj.cross_entropy(logits, target) against the same optax/jnp loss over
                        the given logits: the logits' gradient

Time: the median over K calls of the jitted step, each followed by block_until_ready (JAX
exposes no device events; at these sizes a step is milliseconds of device work against tens of
microseconds of dispatch). Peak memory: the device's peak_bytes_in_use after the provider's
runs (reset between providers by running each in a fresh process), where the platform reports
it (GPUs; CPUs report none). Errors of the loss and each gradient against float64 from the same
bf16 inputs, at the shapes whose float64 reference the host computes quickly (CHECK_MAX_MACS).
The CSV names the device, the commit (FUSEDLOSS_COMMIT, else git's) and the date.
"""
import argparse
import csv
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

from commit import git_commit

SHAPES = [(1024, 2048, 32000), (8192, 4096, 128256), (16384, 4096, 151936)]
# The float64 reference runs on the host (numpy): above this many multiply-adds per GEMM it
# would take minutes, so larger shapes are timed without errors (the small shape has them).
CHECK_MAX_MACS = 2 ** 37


def plain_loss():
    """optax's integer-label cross-entropy, or its definition in jnp where optax is missing."""
    import jax.numpy as jnp
    try:
        import optax
        return "optax", lambda z, t: optax.softmax_cross_entropy_with_integer_labels(z, t).mean()
    except ImportError:
        import jax
        return "jnp", lambda z, t: (jax.nn.logsumexp(z, -1)
                                    - jnp.take_along_axis(z, t[:, None], -1)[:, 0]).mean()


def providers(op):
    import jax.numpy as jnp
    import fusedloss.jax as fj
    name, loss = plain_loss()
    if op == "linear-cross-entropy":
        return {"fusedloss": lambda h, w, t: fj.linear_cross_entropy(h, w, t),
                f"{name}-head": lambda h, w, t: loss((h @ w.T).astype(jnp.float32), t)}
    return {"fusedloss": lambda z, t: fj.cross_entropy(z, t),
            name: lambda z, t: loss(z.astype(jnp.float32), t)}


def inputs(op, n, h, v, seed=0):
    import jax
    import jax.numpy as jnp
    k = jax.random.split(jax.random.key(seed), 3)
    t = jax.random.randint(k[2], (n,), 0, v)
    if op == "linear-cross-entropy":
        hid = jax.random.normal(k[0], (n, h), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(k[1], (v, h), jnp.float32) * h ** -0.5).astype(jnp.bfloat16)
        return (hid, w), t
    return (jax.random.normal(k[0], (n, v), jnp.float32).astype(jnp.bfloat16),), t


def reference(op, args, t):
    """float64 loss and gradients of the same bf16 inputs (on the host: numpy)."""
    import numpy as np
    a = [np.asarray(x, np.float64) for x in args]
    t = np.asarray(t)
    z = a[0] @ a[1].T if op == "linear-cross-entropy" else a[0]
    m = z.max(-1, keepdims=True)
    p = np.exp(z - m)
    s = p.sum(-1, keepdims=True)
    loss = float((np.log(s[:, 0]) + m[:, 0] - z[np.arange(len(t)), t]).mean())
    g = p / s
    g[np.arange(len(t)), t] -= 1.0
    g /= len(t)
    if op == "linear-cross-entropy":
        return loss, [g @ a[1], g.T @ a[0]]
    return loss, [g]


def rel(a, ref):
    import numpy as np
    a = np.asarray(a, np.float64)
    return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-300))


def run_one(op, provider, shape, iters, check):
    """One provider at one shape, in this process: a JSON line on stdout."""
    import jax
    n, h, v = shape
    fn = providers(op)[provider]
    args, t = inputs(op, n, h, v)
    step = jax.jit(jax.value_and_grad(lambda *a: fn(*a, t), argnums=tuple(range(len(args)))))
    out = jax.block_until_ready(step(*args))  # compile and warm up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        out = jax.block_until_ready(step(*args))
        times.append((time.perf_counter() - start) * 1e3)
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    inputs_bytes = sum(x.size * x.dtype.itemsize for x in args)
    peak = stats.get("peak_bytes_in_use")
    record = dict(op=op, provider=provider, N=n, H=h, V=v, ms=statistics.median(times),
                  peak_extra_mib=(peak - inputs_bytes) / 2**20 if peak else None,
                  device=dev.device_kind)
    if check and n * h * v <= CHECK_MAX_MACS:
        loss, grads = reference(op, args, t)
        record["loss_err"] = abs(float(out[0]) - loss) / abs(loss)
        record["grad_errs"] = [rel(g, r) for g, r in zip(out[1], grads)]
    print(json.dumps(record))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="folder for jax-<device>.csv")
    ap.add_argument("--shapes", nargs="*", default=None, help="N,H,V (default: %s)" % SHAPES)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-check", action="store_true", help="skip the float64 errors")
    ap.add_argument("--one", nargs=3, metavar=("OP", "PROVIDER", "N,H,V"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        run_one(a.one[0], a.one[1], tuple(int(x) for x in a.one[2].split(",")), a.iters,
                not a.no_check)
        return
    shapes = [tuple(int(x) for x in s.split(",")) for s in a.shapes] if a.shapes else SHAPES
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    records = []
    for op in ("linear-cross-entropy", "cross-entropy"):
        for shape in shapes:
            for provider in providers(op):
                cmd = [sys.executable, __file__, "--iters", str(a.iters), "--one", op, provider,
                       ",".join(map(str, shape))] + (["--no-check"] if a.no_check else [])
                done = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if done.returncode != 0:
                    print(f"[bench] {op} {provider} {shape} failed: {done.stderr[-400:]}")
                    continue
                records.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"[bench] {op} {provider} {shape}: {records[-1]['ms']:.2f} ms", flush=True)
    today, sha = datetime.date.today().isoformat(), git_commit()
    print(f"fusedloss.jax on {records[0]['device'] if records else '?'}; bf16; commit {sha}")
    base = {(r["op"], r["N"], r["H"], r["V"]): r for r in records if r["provider"] != "fusedloss"}
    for r in records:
        plain = base.get((r["op"], r["N"], r["H"], r["V"]))
        ratio = f"{r['ms'] / plain['ms']:.2f}x plain" if plain and plain is not r else ""
        peak = f"{r['peak_extra_mib']:.0f} MiB" if r["peak_extra_mib"] is not None else "n/a"
        errs = (f" loss err {r['loss_err']:.1e} grad errs "
                + " ".join(f"{e:.1e}" for e in r["grad_errs"])) if "loss_err" in r else ""
        print(f"  {r['op']:<21} {r['provider']:<12} {r['N']}x{r['H']}x{r['V']} {r['ms']:8.2f} ms "
              f"{ratio:>12} peak {peak}{errs}")
    if a.out and records:
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, f"jax-{records[0]['device'].replace(' ', '-')}.csv")
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["op", "provider", "N", "H", "V", "ms", "peak_extra_mib", "loss_err",
                        "grad_errs", "device", "commit", "date"])
            for r in records:
                w.writerow([r["op"], r["provider"], r["N"], r["H"], r["V"], f"{r['ms']:.4f}",
                            "" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:.1f}",
                            r.get("loss_err", ""), " ".join(map(str, r.get("grad_errs", []))),
                            r["device"], sha, today])
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
