"""Vocab-parallel cross-entropy at TP = N against Megatron-core and Liger-Kernel, per rank.

    torchrun --standalone --nproc-per-node N bench/tp_bench.py [--vocab 131072 262144] [--out DIR]
    python3 bench/tp_bench.py --summarize DIR/<date>-<gpu>-tp.csv

Each rank holds the bf16 logits shard [rows, V/N] (Megatron's [s, b, V/N] for the peers) and
runs forward+backward of each provider on the tensor-parallel group: fusedloss (one all-gather
of 16 B/row), Megatron-core's unfused vocab_parallel_cross_entropy (three all-reduces) and
fused_vocab_parallel_cross_entropy, Liger-Kernel's vocab-parallel CE. Reported per provider:
the median over runs of the slowest rank's time (what a training step waits for), peak extra
device MiB, and for fusedloss its collective timed alone. Rows are appended to
<out>/<date>-<gpu>-tp.csv, one run per N; --summarize prints strong-scaling efficiency
t(1) / (N t(N)) from that file and plots it. Without GPUs the same code runs on gloo (CPU,
fp32, host timers) to check the script, not to measure anything.
"""
import argparse
import csv
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist

import peers  # the timing conventions and git commit of the single-GPU benchmark
from commit import git_commit


def providers(group, device):
    import fusedloss
    found = {"fusedloss": lambda x, t: fusedloss.cross_entropy(
        x, t, reduction="none", tp_group=group, inplace_backward=True)}
    candidates = {"megatron": _megatron_unfused}
    if device == "cuda":  # these peers are GPU-only
        candidates.update(megatron_fused=_megatron_fused, liger=_liger)
    return peers.collect(found, candidates, group)


def _megatron_unfused(group):
    from megatron.core import tensor_parallel  # uses parallel_state's TP group (= group)
    return lambda x, t: tensor_parallel.vocab_parallel_cross_entropy(x.unsqueeze(1), t.unsqueeze(1))


def _megatron_fused(group):
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    return lambda x, t: fused_vocab_parallel_cross_entropy(x.unsqueeze(1), t.unsqueeze(1), group)


def _liger(group):
    from liger_kernel.transformers import LigerVocabParallelCrossEntropy
    ce = LigerVocabParallelCrossEntropy()
    return lambda x, t: ce(x.unsqueeze(1), t.unsqueeze(1), group)


def time_on_group(body, group, device, iters, warmup, setup=lambda: None):
    """Median over runs of the slowest rank's ms for body(), and the most device memory it
    added (MiB); setup() runs before each run, outside the timing. Ranks start each run
    together; on CUDA the GPU is kept busy while the host enqueues (device time, as in
    peers.py)."""
    times, peak = [], 0.0
    for i in range(iters + warmup):
        setup()
        dist.barrier(group)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(peers._BUSY_CYCLES)
            start.record()
            body()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
            peak = max(peak, (torch.cuda.max_memory_allocated() - base) / 2**20)
        else:
            t0 = time.perf_counter()
            body()
            ms = (time.perf_counter() - t0) * 1e3
        slowest = torch.tensor([ms], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        if i >= warmup:
            times.append(slowest.item())
    return statistics.median(times), peak


def measure(fn, shard, target, group, device, iters, warmup):
    """Forward+backward of one provider on a fresh copy of the shard each run: an autograd
    intermediate (a clone of a leaf), as logits are in training, so in-place writes into it."""
    grad = torch.rand(target.shape, generator=torch.Generator().manual_seed(7)).to(device) + 0.5
    leaf = {}

    def setup():
        leaf["x"] = shard.detach().requires_grad_(True).clone()

    def body():
        fn(leaf.pop("x"), target).reshape(-1).backward(grad)

    return time_on_group(body, group, device, iters, warmup, setup)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, nargs="+", default=[131072, 262144])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--summarize", metavar="CSV", help="print and plot the scaling of a CSV")
    args = ap.parse_args()
    if args.summarize:
        return summarize(args.summarize)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        from megatron.core import parallel_state
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        group = parallel_state.get_tensor_model_parallel_group()
    except Exception as e:
        print(f"[tp_bench] megatron-core unavailable ({type(e).__name__}: {e}); using the world group")
        group = dist.group.WORLD
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    records = []
    for V in args.vocab:
        if V % world:
            raise SystemExit(f"--vocab {V} must divide by the world size {world}")
        v_local = V // world
        g = torch.Generator(device=device).manual_seed(V * 1000 + rank)  # each rank its own shard
        shard = (torch.rand(args.rows, v_local, generator=g, device=device) * 16 - 8).to(dtype)
        target = torch.randint(0, V, (args.rows,), generator=torch.Generator().manual_seed(V)).to(device)
        for name, fn in providers(group, device).items():
            try:
                ms, peak = measure(fn, shard, target, group, device, args.iters, 3)
            except Exception as e:
                print(f"[tp_bench] {name} failed at V={V}: {type(e).__name__}: {e}")
                continue
            records.append(dict(provider=name, tp=world, V=V, ms=ms, peak=peak, collective_ms=""))
        # fusedloss's hook alone: the all-gather of each rank's 16-byte row stats
        stats = torch.zeros(args.rows, 4, device=device)
        every = torch.empty(world * args.rows, 4, device=device)
        hook_ms, _ = time_on_group(lambda: dist.all_gather_into_tensor(every, stats, group=group),
                                   group, device, args.iters, 3)
        for r in records:
            if r["provider"] == "fusedloss" and r["V"] == V:
                r["collective_ms"] = f"{hook_ms:.4f}"
        del shard
    if rank == 0:
        write(records, args, gpu, world)
    dist.destroy_process_group()


def write(records, args, gpu, world):
    for r in records:
        print(f"TP={world} V={r['V']:>7} {r['provider']:>15}: {r['ms']:8.3f} ms (slowest rank), "
              f"peak extra {r['peak']:8.1f} MiB" +
              (f", collective alone {float(r['collective_ms']):.3f} ms" if r["collective_ms"] else ""))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{datetime.date.today().isoformat()}-{gpu.replace(' ', '-')}-tp.csv")
    new = not os.path.exists(path)
    with open(path, "a", newline="") as fh:
        w = csv.writer(fh)
        if new:
            w.writerow(["provider", "tp", "V", "rows", "ms", "collective_ms", "peak_extra_mib", "gpu",
                        "commit", "date"])
        for r in records:
            w.writerow([r["provider"], r["tp"], r["V"], args.rows, f"{r['ms']:.4f}", r["collective_ms"],
                        f"{r['peak']:.1f}", gpu, git_commit(), datetime.date.today().isoformat()])
    print(f"appended to {path}")


def summarize(path):
    with open(path) as fh:
        rows = list(csv.DictReader(fh))
    ms = {(r["provider"], int(r["V"]), int(r["tp"])): float(r["ms"]) for r in rows}
    for V in sorted({v for _, v, _ in ms}):
        print(f"V = {V}: ms per rank (strong-scaling efficiency t(1) / (N t(N)))")
        tps = sorted({tp for _, v, tp in ms if v == V})
        for name in sorted({p for p, v, _ in ms if v == V}):
            cells = []
            for tp in tps:
                t = ms.get((name, V, tp))
                base = ms.get((name, V, 1))
                eff = f" ({base / (tp * t):.2f})" if t and base else ""
                cells.append(f"TP={tp}: {t:.3f}{eff}" if t else f"TP={tp}: -")
            print(f"  {name:>15}  " + "  ".join(cells))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"[tp_bench] no plot: {e}")
        return
    vocabs = sorted({v for _, v, _ in ms})
    fig, axes = plt.subplots(1, len(vocabs), figsize=(6 * len(vocabs), 4), squeeze=False)
    for ax, V in zip(axes[0], vocabs):
        for name in sorted({p for p, v, _ in ms if v == V}):
            tps = sorted(tp for p, v, tp in ms if p == name and v == V)
            ax.plot(tps, [ms[(name, V, tp)] for tp in tps], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("TP")
        ax.set_ylabel("forward+backward ms (slowest rank)")
        ax.set_title(f"V = {V}, {rows[0]['rows']} rows, {rows[0]['gpu']}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path.replace(".csv", ".png"), dpi=110, bbox_inches="tight")
    print(f"wrote {path.replace('.csv', '.png')}")


if __name__ == "__main__":
    main()
