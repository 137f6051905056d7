"""Cross-entropy benchmark: fusedloss (the C++ API, bench/ce_bench) against torch, Liger-Kernel
and Megatron-core, in one run on one GPU. Prints ms, x floor, x each peer and peak extra MiB;
writes bench/results/<date>-<gpu>-cross-entropy.csv and a PNG plot.

usage: python3 bench/run_ce_bench.py --binary build/bench/ce_bench [--out DIR]
"""
import argparse
import csv
import datetime
import io
import os
import subprocess

import torch

import peers

ROWS = 8192  # S=2048, B=4


def git_commit():
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return os.environ.get("FUSEDLOSS_COMMIT", "unknown")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", required=True)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()

    text = subprocess.check_output([args.binary, str(ROWS)], text=True)
    ours = list(csv.DictReader(io.StringIO(text)))
    gpu = ours[0]["gpu"]
    copy_gbs = float(ours[0]["copy_gbs"])
    records = []
    for r in ours:
        records.append(dict(provider="fusedloss", op=r["op"], V=int(r["V"]), ms=float(r["ms"]),
                            floor_ms=float(r["floor_ms"]), peak_mib=float(r["peak_extra_mib"])))
    floors = {(r["op"], r["V"]): r["floor_ms"] for r in records}

    providers = peers.available()
    for V in sorted({r["V"] for r in records}):
        g = torch.Generator(device="cuda").manual_seed(V)
        x = (torch.rand(ROWS, V, device="cuda", generator=g) * 16 - 8).to(torch.bfloat16)
        t = torch.randint(0, V, (ROWS,), device="cuda", generator=g)
        for name, fn in providers.items():
            try:
                f, b, fb, peak = peers.time_provider(fn, x, t)
            except Exception as e:
                print(f"[bench] {name} failed at V={V}: {type(e).__name__}: {e}")
                continue
            for op, ms in (("forward", f), ("backward", b), ("fwd+bwd", fb)):
                records.append(dict(provider=name, op=op, V=V, ms=ms, floor_ms=floors[(op, V)],
                                    peak_mib=peak))
        del x, t
        torch.cuda.empty_cache()

    names = ["fusedloss"] + list(providers)
    by = {(r["provider"], r["op"], r["V"]): r for r in records}
    print(f"\nGPU {gpu}; copy bandwidth {copy_gbs:.0f} GB/s (read+write); rows {ROWS}; bf16; "
          f"reduction none; commit {git_commit()}")
    head = f"{'V':>7} {'op':>9} {'floor':>7} " + " ".join(f"{n:>10}" for n in names)
    head += "  x floor  " + " ".join(f"{'x ' + n:>11}" for n in names[1:]) + "  peak MiB (" + "/".join(names) + ")"
    print(head)
    for V in sorted({r["V"] for r in records}):
        for op in ("forward", "backward", "fwd+bwd"):
            ours_r = by[("fusedloss", op, V)]
            cells = [f"{by[(n, op, V)]['ms']:>10.3f}" if (n, op, V) in by else f"{'-':>10}" for n in names]
            ratios = [f"{ours_r['ms'] / by[(n, op, V)]['ms']:>11.2f}" if (n, op, V) in by else f"{'-':>11}"
                      for n in names[1:]]
            peaks = "/".join(f"{by[(n, op, V)]['peak_mib']:.0f}" if (n, op, V) in by else "-" for n in names)
            print(f"{V:>7} {op:>9} {ours_r['floor_ms']:>7.3f} " + " ".join(cells) +
                  f"  {ours_r['ms'] / ours_r['floor_ms']:>7.2f}  " + " ".join(ratios) + f"  {peaks}")

    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    slug = gpu.replace(" ", "-")
    path = os.path.join(args.out, f"{stamp}-{slug}-cross-entropy.csv")
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["provider", "op", "V", "rows", "dtype", "ms", "floor_ms", "x_floor", "peak_extra_mib",
                    "copy_gbs", "gpu", "commit", "date"])
        for r in records:
            w.writerow([r["provider"], r["op"], r["V"], ROWS, "bf16", f"{r['ms']:.4f}", f"{r['floor_ms']:.4f}",
                        f"{r['ms'] / r['floor_ms']:.3f}", f"{r['peak_mib']:.1f}", f"{copy_gbs:.1f}", gpu,
                        git_commit(), stamp])
    print(f"wrote {path}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        Vs = sorted({r["V"] for r in records})
        for n in names:
            ys = [by[(n, "fwd+bwd", V)]["ms"] if (n, "fwd+bwd", V) in by else float("nan") for V in Vs]
            ax.plot(Vs, ys, marker="o", label=n)
        ax.plot(Vs, [floors[("fwd+bwd", V)] for V in Vs], "k--", label="3-pass floor")
        ax.set_xlabel("vocabulary V")
        ax.set_ylabel("forward+backward ms (8192 rows, bf16)")
        ax.set_title(f"cross-entropy on {gpu}")
        ax.legend()
        ax.grid(alpha=0.3)
        png = path.replace(".csv", ".png")
        fig.savefig(png, dpi=120, bbox_inches="tight")
        print(f"wrote {png}")
    except ImportError as e:
        print(f"[bench] no plot: {e}")


if __name__ == "__main__":
    main()
