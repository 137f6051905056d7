"""fusedloss against its peers, in one run on one GPU.

  cross-entropy: bench/ce_bench (the C++ API) vs torch F.cross_entropy, Liger-Kernel, Megatron-core
  swiglu:        bench/swiglu_bench vs torch silu(a)*b, Liger's fused gate-up, Megatron bias_swiglu_impl
  rms-norm:      bench/rms_norm_bench vs torch F.rms_norm (eager and torch.compile), Liger's
                 RMSNorm, and a plain streaming kernel of the same traffic ("stream-kernel": what an
                 SM kernel without a row reduction reaches at that size); [T, H] from 16384 x 2048
                 to 8192 x 16384, H = 5120 / 6144, bf16 and fp32
  linear-cross-entropy: fusedloss.linear_cross_entropy (both modes) vs the GEMMs alone, torch,
                 Liger, cut-cross-entropy, QuACK (bench/lce_bench.py)
  log-probs:     fusedloss.linear_log_probs vs the GEMMs alone, torch (whole and chunked), verl's
                 Triton kernel (bench/log_probs_bench.py)
  distillation:  fusedloss.linear_distillation_loss (jsd, and forward KL) vs the GEMMs alone
                 (4 and 6), torch, Liger's fused linear JSD (bench/distill_bench.py)

Prints ms, x floor (bytes over the copy bandwidth measured in the same run), x each peer and
peak extra MiB; writes bench/results/<date>-<gpu>-<kind>.csv and a PNG plot.

usage: python3 bench/run_bench.py {cross-entropy,swiglu,rms-norm} --build build-gpu [--out DIR]
       python3 bench/run_bench.py linear-cross-entropy [--variants all|v1,v2] [--shapes N,H,V;...]
       python3 bench/run_bench.py log-probs [--shapes N,H,V;...]
       python3 bench/run_bench.py distillation [--shapes N,H,V;...]
"""
import argparse
import csv
import io
import os
import subprocess

import torch

import peers
from commit import git_commit

ROWS = 8192  # S=2048, B=4


_TIMING = ["ms", "floor_ms", "x_floor", "peak_extra_mib", "host_ms", "copy_gbs", "gpu", "commit", "date"]


def _timing(r, copy_gbs, gpu):
    """The _TIMING columns of one measurement."""
    host = "" if r.get("host_ms") is None else f"{r['host_ms']:.4f}"
    ratio = f"{r['ms'] / r['floor_ms']:.3f}" if r["floor_ms"] > 0 else ""  # a skipped backward: floor 0
    return [f"{r['ms']:.4f}", f"{r['floor_ms']:.4f}", ratio,
            f"{r['peak_mib']:.1f}", host, f"{copy_gbs:.1f}", gpu, git_commit(), peers.today()]


# The C++ benchmarks' provider whose numbers the peer table compares (bench_util.cuh's default
# name); ce_bench also times the mean reduction and the gradient-in-forward modes, reported
# beside the table, each against its own floor.
_MAIN_CPP = "fusedloss-cpp"


def run_ours(binary, size_key):
    """Records of the C++ benchmark: its main provider as "fusedloss", any other under its own
    name."""
    text = subprocess.check_output([binary, str(ROWS)], text=True)
    rows = list(csv.DictReader(io.StringIO(text)))
    recs = [dict(provider="fusedloss" if r["provider"] == _MAIN_CPP else r["provider"], op=r["op"],
                 size=int(r[size_key]), ms=float(r["ms"]), floor_ms=float(r["floor_ms"]),
                 peak_mib=float(r["peak_extra_mib"])) for r in rows]
    return recs, rows[0]["gpu"], float(rows[0]["copy_gbs"])


def report_cpp_modes(records, size_name):
    """The C++ benchmark's other providers, each over its own floor."""
    extra = [r for r in records if r["provider"].startswith("fusedloss-cpp")]
    if not extra:
        return
    print("\nthe C++ API's other modes (ms, x their own floor; a skipped backward has floor 0):")
    for r in extra:
        ratio = f"{r['ms'] / r['floor_ms']:.2f}x" if r["floor_ms"] > 0 else "-"
        print(f"  {r['provider']:<34} {size_name} {r['size']:>7} {r['op']:>9} {r['ms']:8.3f} "
              f"floor {r['floor_ms']:7.3f} {ratio:>6}")


def python_providers(kind):
    """fusedloss through its PyTorch API (what users call), when the package is installed."""
    try:
        import fusedloss  # noqa: F401
    except ImportError as e:
        print(f"[bench] fusedloss Python package unavailable: {e}")
        return {}
    if kind == "cross-entropy":
        return {"fusedloss-py": peers.fusedloss_ce,
                "fusedloss-py-softcap": peers.fusedloss_ce_softcap,
                "fusedloss-py-class-weight": peers.fusedloss_ce_class_weight}
    return {"fusedloss-py": peers.fusedloss_swiglu(True),
            "fusedloss-py-out-of-place": peers.fusedloss_swiglu(False)}


def peer_records(kind, sizes, floors):
    recs = []
    providers = python_providers(kind)
    providers.update(peers.available() if kind == "cross-entropy" else peers.available_swiglu())
    for size in sizes:
        g = torch.Generator(device="cuda").manual_seed(size)
        if kind == "cross-entropy":
            x = (torch.rand(ROWS, size, device="cuda", generator=g) * 16 - 8).to(torch.bfloat16)
            t = torch.randint(0, size, (ROWS,), device="cuda", generator=g)
            timer = lambda fn: peers.time_provider(fn, x, t)
        else:
            x = (torch.rand(ROWS, 2 * size, device="cuda", generator=g) * 8 - 4).to(torch.bfloat16)
            timer = lambda fn: peers.time_unary(fn, x)
        for name, fn in providers.items():
            try:
                f, b, fb, peak, host = timer(fn)
            except Exception as e:
                print(f"[bench] {name} failed at {size}: {type(e).__name__}: {e}")
                continue
            for op, ms in (("forward", f), ("backward", b), ("fwd+bwd", fb)):
                recs.append(dict(provider=name, op=op, size=size, ms=ms, floor_ms=floors[(op, size)],
                                 peak_mib=peak, host_ms=host if op == "fwd+bwd" else None))
        del x
        torch.cuda.empty_cache()
    return recs, list(providers)


def report(kind, size_name, records, names, gpu, copy_gbs, out_dir):
    by = {(r["provider"], r["op"], r["size"]): r for r in records}
    sizes = sorted({r["size"] for r in records})
    print(f"\n{kind} on {gpu}; copy bandwidth {copy_gbs:.0f} GB/s (read+write); rows {ROWS}; bf16; "
          f"commit {git_commit()}")
    print(f"{size_name:>7} {'op':>9} {'floor':>7} " + " ".join(f"{n:>10}" for n in names) +
          "  x floor " + " ".join(f"{'x ' + n:>11}" for n in names[1:]) +
          "  peak extra MiB (" + "/".join(names) + ")")
    def cell(n, op, s, fmt):
        return fmt(by[(n, op, s)]) if (n, op, s) in by else "-"

    for s in sizes:
        for op in ("forward", "backward", "fwd+bwd"):
            ours = by[("fusedloss", op, s)]
            times = " ".join("%10s" % cell(n, op, s, lambda r: "%.3f" % r["ms"]) for n in names)
            ratios = " ".join("%11s" % cell(n, op, s, lambda r: "%.2f" % (ours["ms"] / r["ms"]))
                              for n in names[1:])
            peaks = "/".join(cell(n, op, s, lambda r: "%.0f" % r["peak_mib"]) for n in names)
            print(f"{s:>7} {op:>9} {ours['floor_ms']:>7.3f} {times}  "
                  f"{ours['ms'] / ours['floor_ms']:>7.2f} {ratios}  {peaks}")
    path = peers.write_csv(out_dir, gpu, kind, ["provider", "op", size_name, "rows", "dtype"] + _TIMING,
                           [[r["provider"], r["op"], r["size"], ROWS, "bf16"] + _timing(r, copy_gbs, gpu)
                            for r in records])
    plt = peers.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for n in names:
        ax.plot(sizes, [by[(n, "fwd+bwd", s)]["ms"] if (n, "fwd+bwd", s) in by else float("nan")
                        for s in sizes], marker="o", label=n)
    ax.plot(sizes, [by[("fusedloss", "fwd+bwd", s)]["floor_ms"] for s in sizes], "k--",
            label="floor (copy bandwidth)")
    ax.set_xlabel(size_name)
    ax.set_ylabel(f"forward+backward ms ({ROWS} rows, bf16)")
    ax.set_title(f"{kind} on {gpu}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(path.replace(".csv", ".png"), dpi=110, bbox_inches="tight")
    print(f"wrote {path.replace('.csv', '.png')}")


def report_overhead(ours, theirs, size_name):
    """The Python layer's cost at the smallest size: extra device time over the C++ API, and
    the host time each Python provider takes to enqueue forward+backward."""
    by = {(r["provider"], r["op"], r["size"]): r for r in ours + theirs}
    small = min(r["size"] for r in ours)
    if ("fusedloss-py", "fwd+bwd", small) in by:
        cpp, py = by[("fusedloss", "fwd+bwd", small)], by[("fusedloss-py", "fwd+bwd", small)]
        print(f"Python layer overhead at {size_name}={small}, forward+backward: device "
              f"{py['ms'] - cpp['ms']:+.3f} ms ({py['ms'] / cpp['ms']:.2f}x the C++ API); host "
              f"{py['host_ms'] * 1e3:.0f} us to enqueue (hidden while the GPU is busy)")
        hosts = ", ".join(f"{r['provider']} {r['host_ms'] * 1e3:.0f} us" for r in theirs
                          if r["op"] == "fwd+bwd" and r["size"] == small)
        print(f"host time to enqueue forward+backward at {size_name}={small}: {hosts}")


def rms_norm_main(build, out_dir):
    """RMSNorm: the C++ API's rows (T, H, dtype) against the Python providers on the same shapes;
    ratios over the floor (forward 4 B/element, forward+backward 10 B/element in bf16, twice
    that in fp32) from the copy bandwidth the C++ binary measured."""
    text = subprocess.check_output([os.path.join(build, "bench", "rms_norm_bench")], text=True)
    rows = list(csv.DictReader(io.StringIO(text)))
    gpu, copy_gbs = rows[0]["gpu"], float(rows[0]["copy_gbs"])
    recs = [dict(provider="fusedloss", op=r["op"], T=int(r["T"]), H=int(r["H"]), dtype=r["dtype"],
                 ms=float(r["ms"]), floor_ms=float(r["floor_ms"]), peak_mib=0.0, host_ms=None)
            for r in rows]
    # the same traffic through a plain streaming kernel (no row reduction): what an SM kernel
    # reaches at this size, beside the floor of the large copy
    recs += [dict(r, provider="stream-kernel", ms=float(row["stream_ms"]))
             for r, row in zip(list(recs), rows) if row.get("stream_ms")]
    floors = {(r["op"], r["T"], r["H"], r["dtype"]): r["floor_ms"] for r in recs}
    names = ["fusedloss"] + (["stream-kernel"] if any(r["provider"] == "stream-kernel" for r in recs) else [])
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    for (T, H, dt) in sorted({(r["T"], r["H"], r["dtype"]) for r in recs}):
        g = torch.Generator(device="cuda").manual_seed(H)
        x = (torch.randn(T, H, device="cuda", generator=g)).to(dtypes[dt])
        weight = (torch.rand(H, device="cuda", generator=g) + 0.5).to(dtypes[dt]).requires_grad_(True)
        providers = {}
        try:
            providers["fusedloss-py"] = peers.fusedloss_rms_norm(weight)
        except ImportError as e:
            print(f"[bench] fusedloss Python package unavailable: {e}")
        providers.update(peers.available_rms_norm(weight))
        for name, fn in providers.items():
            try:
                f, b, fb, peak, host = peers.time_unary(fn, x, iters=30)
            except Exception as e:
                print(f"[bench] {name} failed at {T}x{H} {dt}: {type(e).__name__}: {e}")
                continue
            if name not in names:
                names.append(name)
            for op, ms in (("forward", f), ("backward", b), ("fwd+bwd", fb)):
                recs.append(dict(provider=name, op=op, T=T, H=H, dtype=dt, ms=ms,
                                 floor_ms=floors[(op, T, H, dt)], peak_mib=peak,
                                 host_ms=host if op == "fwd+bwd" else None))
        del x, weight
        torch.cuda.empty_cache()
    by = {(r["provider"], r["op"], r["T"], r["H"], r["dtype"]): r for r in recs}
    shapes = sorted({(r["dtype"], r["T"], r["H"]) for r in recs})
    print(f"\nrms-norm on {gpu}; copy bandwidth {copy_gbs:.0f} GB/s (read+write); commit {git_commit()}")
    print(f"{'dtype':>5} {'T x H':>12} {'op':>9} {'floor':>7} " + " ".join(f"{n:>13}" for n in names)
          + "   (ms, then x floor)")
    for dt, T, H in shapes:
        for op in ("forward", "backward", "fwd+bwd"):
            cells = []
            for n in names:
                r = by.get((n, op, T, H, dt))
                cells.append(f"{r['ms']:6.3f} {r['ms'] / r['floor_ms']:5.2f}x" if r else f"{'-':>13}")
            print(f"{dt:>5} {f'{T}x{H}':>12} {op:>9} {floors[(op, T, H, dt)]:>7.3f} " + " ".join(cells))
    path = peers.write_csv(out_dir, gpu, "rms-norm", ["provider", "op", "T", "H", "dtype"] + _TIMING,
                           [[r["provider"], r["op"], r["T"], r["H"], r["dtype"]] + _timing(r, copy_gbs, gpu)
                            for r in recs])
    plt = peers.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, op in zip(axes, ("forward", "fwd+bwd")):
        labels = [f"{dt} {T}x{H}" for dt, T, H in shapes]
        for n in names:
            ax.plot(labels, [by[(n, op, T, H, dt)]["ms"] / by[(n, op, T, H, dt)]["floor_ms"]
                             if (n, op, T, H, dt) in by else float("nan") for dt, T, H in shapes],
                    marker="o", label=n)
        ax.axhline(1.0, color="k", linestyle="--", label="floor (copy bandwidth)")
        ax.set_ylabel(f"{op} time / floor")
        ax.set_title(f"rms-norm {op} on {gpu}")
        ax.tick_params(axis="x", rotation=60)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path.replace(".csv", ".png"), dpi=110, bbox_inches="tight")
    print(f"wrote {path.replace('.csv', '.png')}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["cross-entropy", "swiglu", "rms-norm", "linear-cross-entropy",
                                     "log-probs", "distillation"])
    ap.add_argument("--build", help="CMake build dir holding bench/ce_bench etc. (not needed for "
                    "linear-cross-entropy, which runs through the Python package)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--variants", default="default",
                    help="linear-cross-entropy: comma-separated pipeline variants of "
                    "bench/lce_bench.py VARIANTS (or 'all'); each fusedloss mode runs in each")
    ap.add_argument("--shapes", default=None,
                    help="linear-cross-entropy, log-probs, distillation: N,H,V[;N,H,V...] "
                    "instead of the issue's shapes")
    args = ap.parse_args()
    shapes = ([tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
              if args.shapes else None)
    if not torch.cuda.is_available():
        print("run_bench.py times the CUDA kernels and needs a GPU; none is usable here, nothing to do")
        return
    if args.kind == "distillation":
        import distill_bench
        distill_bench.run(args.out, git_commit(), shapes=shapes)
        return
    if args.kind == "log-probs":
        import log_probs_bench
        log_probs_bench.run(args.out, git_commit(), shapes=shapes)
        return
    if args.kind == "linear-cross-entropy":
        import lce_bench
        variants = (list(lce_bench.VARIANTS) if args.variants == "all"
                    else [v for v in args.variants.split(",") if v])
        lce_bench.run(args.out, git_commit(), variants=variants, shapes=shapes)
        return
    if not args.build:
        ap.error("--build is required for " + args.kind)
    if args.kind == "rms-norm":
        return rms_norm_main(args.build, args.out)
    binary, size_name = (("ce_bench", "V") if args.kind == "cross-entropy" else ("swiglu_bench", "n"))
    ours, gpu, copy_gbs = run_ours(os.path.join(args.build, "bench", binary), size_name)
    main = [r for r in ours if r["provider"] == "fusedloss"]
    floors = {(r["op"], r["size"]): r["floor_ms"] for r in main}
    theirs, names = peer_records(args.kind, sorted({r["size"] for r in main}), floors)
    report(args.kind, size_name, ours + theirs, ["fusedloss"] + names, gpu, copy_gbs, args.out)
    report_cpp_modes(ours, size_name)
    report_overhead(ours, theirs, size_name)

if __name__ == "__main__":
    main()
