"""Where fusedloss's CUDA scratch comes from, measured: fusedloss.set_scratch_allocator("cuda")
(cudaMallocAsync on the device's default pool) against "torch" (torch's caching allocator), on
the linear cross-entropy (whose chunk buffer is the largest scratch) and the cross-entropy,
with torch's own ops in the same run for scale.

    python3 bench/scratch_source_bench.py [--rounds 3] [--iters 20]   # needs a CUDA GPU

peers.time_step per provider: device ms of forward+backward behind a GPU-side wait, the host ms
to enqueue them, and the peak extra memory (torch's peak plus the default pool's). Every run
synchronises first, as a training step does once (its loss.item()): the default pool hands its
free memory back then, so what "cuda" costs after that is in the host column. The sources
alternate within each round and the rounds rotate their order; the figures are medians over
rounds.
"""
import argparse
import statistics

import torch
import torch.nn.functional as F

import fusedloss
import peers

SHAPES = [(4096, 512, 32768), (4096, 4096, 128256)]  # the tiny Megatron model's head, Llama 3's


def cases(N, H, V):
    """name -> (prepare, forward, backward); forward(h, w) returns what backward starts from."""
    g = torch.Generator(device="cuda").manual_seed(N + V)
    h0 = torch.randn(N, H, device="cuda", generator=g, dtype=torch.bfloat16)
    w0 = (torch.randn(V, H, device="cuda", generator=g) * H ** -0.5).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    upstream = torch.rand(N, device="cuda", generator=g)  # Megatron's masked per-token losses

    def prepare():
        return h0.detach().requires_grad_(), w0.detach().requires_grad_()

    def backward(out, h, w):
        (out if out.dim() == 0 else (out * upstream).sum()).backward()

    lce = fusedloss.linear_cross_entropy
    return {
        "torch linear+CE none": (lambda h, w: F.cross_entropy(F.linear(h, w).float(), t, reduction="none")),
        "torch linear+CE mean": (lambda h, w: F.cross_entropy(F.linear(h, w).float(), t)),
        "fusedloss LCE none": (lambda h, w: lce(h, w, t, reduction="none")),
        "fusedloss LCE mean": (lambda h, w: lce(h, w, t)),
        "linear + fusedloss CE none": (lambda h, w: fusedloss.cross_entropy(
            F.linear(h, w), t, reduction="none", inplace_backward=True)),
    }, prepare, backward


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    sources = ["cuda", "torch"]
    default = fusedloss._native.scratch
    print(f"{torch.cuda.get_device_name()}; bf16; forward+backward; medians over {args.rounds} rounds "
          f"of {args.iters} runs")
    for N, H, V in SHAPES:
        named, prepare, backward = cases(N, H, V)
        runs = {}  # (name, source) -> [(device ms, host ms, peak MiB)]
        for r in range(args.rounds):
            order = sources[r % 2:] + sources[:r % 2]
            for name, forward in named.items():
                for source in (order if "fusedloss" in name else ["-"]):
                    if source != "-":
                        fusedloss.set_scratch_allocator(source)
                    _, _, both, peak, host, _ = peers.time_step(prepare, forward, backward, args.iters, 3)
                    runs.setdefault((name, source), []).append((both, host, peak))
        fusedloss.set_scratch_allocator(default)
        print(f"\nN {N}, H {H}, V {V}")
        print(f"{'':32} {'scratch':>8} {'device ms':>10} {'host ms':>9} {'peak MiB':>9}   host per round")
        for (name, source), v in runs.items():
            med = [statistics.median(x[i] for x in v) for i in range(3)]
            rounds = " ".join(f"{x[1]:.3f}" for x in v)
            print(f"{name:32} {source:>8} {med[0]:10.3f} {med[1]:9.3f} {med[2]:9.1f}   {rounds}", flush=True)


if __name__ == "__main__":
    main()
