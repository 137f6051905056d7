"""Host time (Python + dispatch) of the fusedloss PyTorch ops against the torch ops they replace.

    python bench/host_overhead.py [--device cpu|cuda] [--iters N] [--repeats R]

Tiny tensors, so the kernels cost ~nothing and what is timed is the eager host path of one call:
forward (inputs requiring grad, the graph dropped), forward under no_grad, and forward +
backward. Each figure is the best of `repeats` mean times over blocks of `iters` calls, in
microseconds, the torch and fusedloss blocks interleaved.

On CUDA the GPU is kept busy while the host loop is timed: a torch.cuda._sleep queued before
each timed block outlasts it, so no call waits for the device (a kernel launch returns at once)
and the only synchronisation is after the clock stops. Blocks are kept short (--block calls) so
the queued launches stay within the driver's launch queue, which would otherwise block the host.
"""
import argparse
import time

import torch
import torch.nn.functional as F

import fusedloss


def _cases(device):
    """name -> (torch call, fusedloss call), each returning the tensor a backward starts from."""
    torch.manual_seed(0)
    dev = dict(device=device)
    N, V, H = 8, 16, 16
    logits = torch.randn(N, V, requires_grad=True, **dev)
    target = torch.randint(0, V, (N,), **dev)
    y = torch.randn(N, 2 * H, requires_grad=True, **dev)
    x = torch.randn(N, H, requires_grad=True, **dev)
    res = torch.randn(N, H, requires_grad=True, **dev)
    w = torch.ones(H, requires_grad=True, **dev)
    hidden = torch.randn(N, H, requires_grad=True, **dev)
    head = torch.randn(V, H, requires_grad=True, **dev)

    def torch_swiglu():
        gate, up = y.chunk(2, -1)
        return (F.silu(gate) * up).sum()

    def torch_rms_residual():
        s = x + res
        return F.rms_norm(s, (H,), w, 1e-5).sum() + s.sum()

    def fused_rms_residual():
        out, s = fusedloss.rms_norm(x, w, residual=res)
        return out.sum() + s.sum()

    return {
        "cross_entropy": (lambda: F.cross_entropy(logits, target),
                          lambda: fusedloss.cross_entropy(logits, target)),
        "swiglu": (torch_swiglu, lambda: fusedloss.swiglu(y).sum()),
        "rms_norm": (lambda: F.rms_norm(x, (H,), w, 1e-5).sum(),
                     lambda: fusedloss.rms_norm(x, w).sum()),
        "rms_norm+residual": (torch_rms_residual, fused_rms_residual),
        "linear_cross_entropy": (lambda: F.cross_entropy(F.linear(hidden, head), target),
                                 lambda: fusedloss.linear_cross_entropy(hidden, head, target)),
    }


def _timer(device, block):
    if device.type != "cuda":
        def run(fn, iters):
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            return time.perf_counter() - start
        return run

    # 2 GHz is above any data-centre GPU's clock, so the sleep lasts at least the seconds asked
    cycles_per_s = 2e9

    def run(fn, iters):
        total, done = 0.0, 0
        while done < iters:
            n = min(block, iters - done)
            # the GPU sleeps for 4x the previous estimate of this block's host time (1 ms floor)
            guess = max(1e-3, 4 * n * (total / done if done else 1e-4))
            torch.cuda._sleep(int(guess * cycles_per_s))
            start = time.perf_counter()
            for _ in range(n):
                fn()
            total += time.perf_counter() - start
            done += n
            torch.cuda.synchronize(device)  # after the clock: the sleep and the kernels drain
        return total
    return run


def _modes(fn):
    def forward():
        fn()

    def forward_no_grad():
        with torch.no_grad():
            fn()

    def forward_backward():
        fn().backward()

    return {"fwd": forward, "fwd no_grad": forward_no_grad, "fwd+bwd": forward_backward}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--iters", type=int, default=500, help="calls per timed block")
    parser.add_argument("--repeats", type=int, default=20, help="timed blocks per op and mode")
    parser.add_argument("--block", type=int, default=32,
                        help="calls per sleep-covered block on CUDA (~10 launches a call: a few "
                             "hundred launches stay well inside the driver's queue)")
    parser.add_argument("--ops", nargs="*", help="only these ops (default: all)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's intra-op CPU threads (default 1: on a busy host, OpenMP "
                             "workers waiting for a core swamp the host time of tiny calls)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    run = _timer(device, args.block)

    print(f"fusedloss {fusedloss.__version__}, torch {torch.__version__}, {device}; host time per "
          f"call in us (best of {args.repeats} blocks of {args.iters} calls)")
    print(f"{'op':<22}{'mode':<13}{'torch':>9}{'fusedloss':>11}{'ratio':>8}")
    for name, (torch_fn, fused_fn) in _cases(device).items():
        if args.ops and name not in args.ops:
            continue
        torch_modes, fused_modes = _modes(torch_fn), _modes(fused_fn)
        for mode in torch_modes:
            calls = (torch_modes[mode], fused_modes[mode])
            for call in calls:
                run(call, max(50, args.iters // 10))  # warm-up (caches, allocator, first-use probes)
            # interleaved blocks, the best of each: a busy or throttled moment hits both alike
            times = [float("inf")] * len(calls)
            for _ in range(args.repeats):
                for i, call in enumerate(calls):
                    times[i] = min(times[i], run(call, args.iters) / args.iters * 1e6)
            print(f"{name:<22}{mode:<13}{times[0]:>9.1f}{times[1]:>11.1f}{times[1] / times[0]:>7.2f}x")


if __name__ == "__main__":
    main()
