"""Peer providers of the benchmarks, timed the way bench/ce_bench.cu times fusedloss.

Each provider is a function (logits, target) -> per-token loss that autograd can backprop.
Timing: CUDA events around forward and backward (device time: the GPU is kept busy while the
host enqueues), median of many runs, fresh leaf tensors prepared outside the timed region; the
host's enqueue time is reported beside it. Peak extra memory: torch's allocator high-water mark above
what the inputs already hold.
"""
import csv
import ctypes
import datetime
import glob
import os
import statistics
import time

import torch
import torch.nn.functional as F


def torch_ce(x, t):
    return F.cross_entropy(x, t, reduction="none")


def liger_ce():
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

    def run(x, t):
        # (input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction)
        out = LigerCrossEntropyFunction.apply(x, t, None, -100, 0.0, 0.0, "none")
        return out[0] if isinstance(out, tuple) else out

    return run


_GROUP = None


def single_rank_group():
    """A one-rank NCCL process group, which Megatron's fused cross-entropy requires."""
    global _GROUP
    if _GROUP is None:
        import torch.distributed as dist

        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29531")
            dist.init_process_group("nccl", rank=0, world_size=1)
        _GROUP = dist.new_group([0])
    return _GROUP


def megatron_fused_ce():
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    group = single_rank_group()

    def run(x, t):
        # Megatron's layout: logits [s, b, V], target [s, b]
        return fused_vocab_parallel_cross_entropy(x.unsqueeze(1), t.unsqueeze(1), group).squeeze(1)

    return run


def fusedloss_ce(x, t):
    # x is an autograd intermediate (time_autograd): the in-place gradient lands in its storage
    import fusedloss
    return fusedloss.cross_entropy(x, t, reduction="none", inplace_backward=True)


# The options that change the kernels' traffic, beside the plain call: Gemma 2's soft cap of
# 30, and a per-class weight (all ones: the same loss, the weighted path's cost).
SOFTCAP = 30.0


def fusedloss_ce_softcap(x, t):
    import fusedloss
    return fusedloss.cross_entropy(x, t, reduction="none", inplace_backward=True,
                                   logit_softcap=SOFTCAP)


def fusedloss_ce_class_weight(x, t):
    import fusedloss
    weight = torch.ones(x.size(-1), device=x.device)
    return fusedloss.cross_entropy(x, t, reduction="none", inplace_backward=True, weight=weight)


def liger_ce_softcap():
    from liger_kernel.transformers.functional import liger_cross_entropy
    return lambda x, t: liger_cross_entropy(x, t, reduction="none", softcap=SOFTCAP)


def fusedloss_swiglu(in_place):
    import fusedloss
    return lambda y: fusedloss.swiglu(y, inplace_backward=in_place)


def collect(providers, candidates, *args):
    """providers plus every candidate make(*args) that can be built; a missing wheel (or
    anything else make raises) is reported, not fatal."""
    for name, make in candidates.items():
        try:
            providers[name] = make(*args)
        except Exception as e:
            print(f"[bench] provider {name} unavailable: {type(e).__name__}: {e}")
    return providers


def quack_ce(inplace_backward):
    """QuACK's CuTe-DSL cross-entropy (quack.cross_entropy), per-token losses; with
    inplace_backward its gradient overwrites the logits, as fusedloss's timed call does."""
    def make():
        from quack.cross_entropy import cross_entropy

        return lambda x, t: cross_entropy(x, t, reduction="none", inplace_backward=inplace_backward)
    return make


def available():
    return collect({"torch": torch_ce}, {"liger": liger_ce, "liger-softcap": liger_ce_softcap,
                                         "megatron": megatron_fused_ce,
                                         "quack": quack_ce(False), "quack-inplace": quack_ce(True)})


def time_provider(fn, pristine, target, iters=30, warmup=3):
    """Cross-entropy provider: median ms of forward, backward, forward+backward; peak extra MiB."""
    return time_autograd(lambda x: fn(x, target), pristine, iters, warmup)


# A GPU-side wait queued before each timed region (about 2 ms at H200 clocks): the host
# enqueues the whole forward and backward while the GPU is still busy, so the events time the
# device work alone, as in a training step whose launch queue runs ahead. The host's own time
# to enqueue is measured separately.
_BUSY_CYCLES = 4_000_000


_CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")


def libcudart():
    """The CUDA runtime of the toolkit (ctypes), for what torch does not expose; None without one."""
    libs = sorted(glob.glob(os.path.join(_CUDA_HOME, "lib64", "libcudart.so*")))
    try:
        return ctypes.CDLL(libs[0]) if libs else None
    except OSError:
        return None


class StreamOrderedPool:
    """The device's default cudaMallocAsync pool, where fusedloss's scratch lives when it does
    not come from torch's cache (fusedloss.set_scratch_allocator("cuda"), the C++ API, graph
    captures; src/cuda/runtime.cu): torch's allocator statistics do not see it. A driver object, so any copy of libcudart reads
    the same pool. Where libcudart cannot be loaded or a query fails, `usable` is False and
    `extra` answers 0 (with a printed reason, once)."""

    USED_CURRENT, USED_HIGH = 7, 8  # cudaMemPoolAttrUsedMemCurrent, cudaMemPoolAttrUsedMemHigh

    def __init__(self):
        self.rt, self.pool, self.usable = libcudart(), ctypes.c_void_p(), False
        try:
            self.usable = self.rt is not None and self.rt.cudaDeviceGetDefaultMemPool(
                ctypes.byref(self.pool), torch.cuda.current_device()) == 0
        except AttributeError:
            self.usable = False
        if not self.usable:
            print(f"peers: the stream-ordered pool is not readable (libcudart under {_CUDA_HOME}); "
                  "peak memory counts torch's allocator alone")

    def _get(self, attr):
        value = ctypes.c_uint64()
        if self.rt.cudaMemPoolGetAttribute(self.pool, attr, ctypes.byref(value)) != 0:
            self.usable = False
            print("peers: cudaMemPoolGetAttribute failed; peak memory counts torch's allocator alone")
        return value.value

    def reset(self):
        """Starts a measurement: the high watermark back to what is in use now; returns that."""
        if not self.usable:
            return 0
        zero = ctypes.c_uint64(0)  # the only value the high watermark takes: reset to current
        self.rt.cudaMemPoolSetAttribute(self.pool, self.USED_HIGH, ctypes.byref(zero))
        return self._get(self.USED_CURRENT)

    def extra(self, base):
        """Bytes above `base` (reset's answer) at the pool's high watermark since reset."""
        return max(self._get(self.USED_HIGH) - base, 0) if self.usable else 0


_POOL = None


def time_step(prepare, forward, backward, iters, warmup):
    """Times out = forward(*inputs) and backward(out, *inputs) (None: no backward) with CUDA
    events, on fresh inputs = prepare() each run made outside the timed region, behind the
    GPU-side wait. Returns median device ms of forward, backward and both, peak extra MiB, the
    median host ms to enqueue both (a provider that syncs the host pays for it in both), and
    (out, inputs) of the last run. Peak extra memory is torch's allocator's peak plus the
    stream-ordered pool's (StreamOrderedPool): an upper bound where the two peak apart."""
    global _POOL
    _POOL = _POOL or StreamOrderedPool()
    fwd, bwd, both, host = [], [], [], []
    peak, last = 0, None
    for i in range(iters + warmup):
        last = None  # the previous run's tensors are not part of this run's memory
        inputs = prepare()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        pool_base = _POOL.reset()
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        torch.cuda._sleep(_BUSY_CYCLES)
        t0 = time.perf_counter()
        e[0].record()
        out = forward(*inputs)
        e[1].record()
        if backward is not None:
            backward(out, *inputs)
        e[2].record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        if i >= warmup:
            fwd.append(e[0].elapsed_time(e[1]))
            bwd.append(e[1].elapsed_time(e[2]))
            both.append(e[0].elapsed_time(e[2]))
            host.append((t1 - t0) * 1e3)
            peak = max(peak, torch.cuda.max_memory_allocated() - base + _POOL.extra(pool_base))
        last = (out, inputs)
        del out, inputs
    med = statistics.median
    return med(fwd), med(bwd), med(both), peak / 2**20, med(host), last


class _GradientEndsHere(torch.autograd.Function):
    """x = _GradientEndsHere.apply(leaf): a copy of the leaf, an autograd intermediate whose
    gradient goes no further. Timing through a plain clone would add the leaf's AccumulateGrad
    to the backward: free for a provider whose gradient is a fresh tensor (stolen), a full
    [rows, V] copy for one that writes it into x's storage (x is still referenced). In training
    the gradient flows into the producer's backward (the LM head's GEMM) either way."""

    @staticmethod
    def forward(ctx, leaf):
        return leaf.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


def time_autograd(forward, pristine, iters, warmup):
    """time_step of forward(x) and its backward, x a fresh autograd intermediate (a copy of a
    leaf, made outside the timed region), as logits and fc1 outputs are in training, so
    in-place providers may write into it; the upstream gradient is random, drawn once. Returns
    time_step's numbers without the last run."""
    with torch.no_grad():
        grad = torch.rand_like(forward(pristine.detach().clone())) + 0.5
    *numbers, _ = time_step(lambda: (_GradientEndsHere.apply(pristine.detach().requires_grad_(True)),),
                            forward, lambda out, x: out.backward(grad), iters, warmup)
    return tuple(numbers)

# ---- SwiGLU over the fused gate-up buffer y [T, 2n] ----

def torch_swiglu(y):
    a, b = torch.chunk(y, 2, -1)
    return F.silu(a) * b


def liger_swiglu():
    from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

    return lambda y: LigerFusedGateUpSiLUMulFunction.apply(y, False)


def megatron_swiglu():
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    return lambda y: bias_swiglu_impl(y, None)


def available_swiglu():
    return collect({"torch": torch_swiglu}, {"liger": liger_swiglu, "megatron": megatron_swiglu})


def time_unary(fn, pristine, iters=50, warmup=3):
    """SwiGLU provider y -> out: as time_provider."""
    return time_autograd(fn, pristine, iters, warmup)


# ---- RMSNorm over [T, H] with a learnable weight (its gradient is part of the backward) ----

def torch_rms_norm(weight, eps=1e-5):
    return lambda x: F.rms_norm(x, (x.size(-1),), weight, eps)


def torch_compile_rms_norm(weight, eps=1e-5):
    fn = torch.compile(lambda x, w: F.rms_norm(x, (x.size(-1),), w, eps), dynamic=False)
    return lambda x: fn(x, weight)


def liger_rms_norm(weight, eps=1e-5):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return lambda x: LigerRMSNormFunction.apply(x, weight, eps)


def fusedloss_rms_norm(weight, eps=1e-5):
    import fusedloss
    return lambda x: fusedloss.rms_norm(x, weight, eps)


def quack_rms_norm(weight, eps=1e-5):
    from quack.rmsnorm import rmsnorm

    return lambda x: rmsnorm(x, weight, eps=eps)


def available_rms_norm(weight):
    return collect({"torch": torch_rms_norm(weight)},
                   {"torch-compile": torch_compile_rms_norm, "liger": liger_rms_norm,
                    "quack": quack_rms_norm}, weight)


# ---- results ----

def write_csv(out_dir, gpu, kind, header, rows):
    """bench/results-style CSV <date>-<gpu>-<kind>.csv in out_dir; returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    path = os.path.join(out_dir, f"{stamp}-{gpu.replace(' ', '-')}-{kind}.csv")
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(rows)
    print(f"wrote {path}")
    return path


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (said once) where it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"[bench] no plot: {e}")
        return None
    return plt


def plot_time_and_memory(path, names, shapes, value, title, tick):
    """Two bar charts beside each other, a bar per provider in `names` at each (N, H, V) of
    `shapes`: forward+backward ms and peak extra GiB. value(name, N, V, key) gives a record's
    "both" (ms) or "peak" (MiB), 0 where there is none; tick(N, H, V) labels a shape. Written
    next to the CSV at `path` as .png (nothing where matplotlib is missing)."""
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(names), 1)
    for i, n in enumerate(names):
        xs = [k + i * width for k in range(len(shapes))]
        axes[0].bar(xs, [value(n, N, V, "both") for N, _, V in shapes], width, label=n)
        axes[1].bar(xs, [value(n, N, V, "peak") / 1024 for N, _, V in shapes], width, label=n)
    for ax, label in zip(axes, ["forward+backward ms", "peak extra GiB (incl. gradients)"]):
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(shapes))])
        ax.set_xticklabels([tick(N, H, V) for N, H, V in shapes], fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    png = path.replace(".csv", ".png")
    fig.savefig(png, dpi=110, bbox_inches="tight")
    print(f"wrote {png}")


def today():
    return datetime.date.today().isoformat()
