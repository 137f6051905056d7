"""Host time of an autograd node with no kernels, in Python and in C++, beside torch's RMSNorm.

    python bench/autograd_node_probe.py [--dtype bfloat16] [--block 50] [--repeats 40]

What it answers: how much of an op's forward+backward host time is the autograd machinery
itself (the engine, its hand-off to the device thread, the node), and how much of that an
autograd node written in C++ (torch::autograd::Function, built here with load_inline at -O2)
would save against a torch.autograd.Function. Every node allocates what an RMSNorm allocates
(forward: y and a [rows] fp32 rstd; backward: dx and dweight) and launches nothing.

Tiny CUDA tensors; the GPU is kept busy by a torch.cuda._sleep queued before each block, the
blocks short enough that their launches stay within the driver's queue; the best block's mean,
in microseconds per call.
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

_CPP = r"""
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct EmptyNode : torch::autograd::Function<EmptyNode> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w) {
    at::Tensor rstd = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
    ctx->save_for_backward({x, w, rstd});
    return at::empty_like(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list) {
    auto saved = ctx->get_saved_variables();
    return {at::empty_like(saved[0]), at::empty_like(saved[1])};
  }
};

at::Tensor empty_node(const at::Tensor& x, const at::Tensor& w) { return EmptyNode::apply(x, w); }

TORCH_LIBRARY(fusedloss_probe, m) { m.def("empty_node(Tensor x, Tensor w) -> Tensor"); }
TORCH_LIBRARY_IMPL(fusedloss_probe, CompositeImplicitAutograd, m) { m.impl("empty_node", empty_node); }
"""


class EmptyNode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w, torch.empty(x.size(0), device=x.device))
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        x, w, _ = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(w)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    start = time.time()
    module = load_inline("fusedloss_probe", cpp_sources=[_CPP], functions=["empty_node"],
                         extra_cflags=["-O2"], verbose=False)
    print(f"# built in {time.time() - start:.0f} s; torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}, {args.dtype}, blocks of {args.block} calls")
    dtype = getattr(torch, args.dtype)
    H = 16
    x = torch.randn(8, H, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.ones(H, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.ones(8, H, device="cuda", dtype=dtype)
    dispatched = torch.ops.fusedloss_probe.empty_node.default

    def timed(fn):
        best = float("inf")
        for _ in range(args.repeats):
            torch.cuda._sleep(int(2e9 * 4 * args.block * 200e-6))  # outlasts the block
            t0 = time.perf_counter()
            for _ in range(args.block):
                fn()
            best = min(best, (time.perf_counter() - t0) / args.block * 1e6)
            torch.cuda.synchronize()
        return best

    cases = {
        "F.rms_norm fwd+bwd": lambda: F.rms_norm(x, (H,), w, 1e-5).backward(g),
        "Python autograd.Function fwd+bwd": lambda: EmptyNode.apply(x, w).backward(g),
        "C++ Function via torch.ops fwd+bwd": lambda: dispatched(x, w).backward(g),
        "C++ Function via pybind11 fwd+bwd": lambda: module.empty_node(x, w).backward(g),
        "F.rms_norm fwd": lambda: F.rms_norm(x, (H,), w, 1e-5),
        "Python autograd.Function fwd": lambda: EmptyNode.apply(x, w),
        "C++ Function via torch.ops fwd": lambda: dispatched(x, w),
        "C++ Function via pybind11 fwd": lambda: module.empty_node(x, w),
        "torch.empty (one tensor)": lambda: torch.empty(8, device="cuda"),
    }
    for rep in range(2):
        print(f"# round {rep + 1}")
        for name, fn in cases.items():
            print(f"{name:38s} {timed(fn):8.1f} us", flush=True)


if __name__ == "__main__":
    main()
