"""Per-call host time of the Megatron patch's cross-entropy, SwiGLU and RMSNorm against what they
replace.

    python3 bench/megatron_host_overhead.py [--device cuda] [--rounds 7] [--calls 1000]

Forward + backward at a tiny shape, so the kernels cost next to nothing and a call's time is
its host time (on CUDA: the enqueue time, the GPU keeping up); each case is timed `rounds`
times over `calls` calls, cases interleaved, and the minimum is reported (a shared machine's
noise only adds). Cases: torch's own ops, fusedloss's ops called directly, Megatron's
functions unpatched, and the same Megatron functions through the patch.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=1000)
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cpu":
        torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1)
    from megatron.core import parallel_state, tensor_parallel
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    from megatron.core.fusions import fused_bias_swiglu as fbs
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    import fusedloss
    from fusedloss.megatron import apply_fusedloss_to_megatron, unpatch_megatron

    tp = parallel_state.get_tensor_model_parallel_group()
    x0, y0 = torch.randn(4, 2, 32, device=dev), torch.randn(4, 2, 32, device=dev)
    t = torch.randint(0, 32, (4, 2), device=dev)

    def ce(call):
        def step():
            v = x0.clone().requires_grad_(True)
            call(v * 1).sum().backward()  # non-leaf logits, as Megatron's
        return step

    def sw(call):
        def step():
            v = y0.clone().requires_grad_(True)
            call(v).sum().backward()
        return step

    # Megatron's norm as its local spec builds it for normalization="RMSNorm" (WrappedTorchNorm:
    # torch.nn.RMSNorm), and the same call built under the patch (FusedLossRMSNorm; an instance
    # stays what it was built as, so it is built once, here).
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, normalization="RMSNorm",
                            use_cpu_initialization=True)
    norm = WrappedTorchNorm(cfg, 32, eps=1e-5).to(dev)
    apply_fusedloss_to_megatron()
    norm_patched = WrappedTorchNorm(cfg, 32, eps=1e-5).to(dev)
    unpatch_megatron()
    assert type(norm_patched) is not type(norm), "the patch did not replace Megatron's RMSNorm"
    w = torch.ones(32, device=dev, requires_grad=True)

    cases = {  # name: (patched?, step)
        "torch F.cross_entropy": (False, ce(lambda v: F.cross_entropy(v.view(-1, 32), t.view(-1), reduction="none"))),
        "fusedloss.cross_entropy": (False, ce(lambda v: fusedloss.cross_entropy(v, t, reduction="none"))),
        "megatron fused CE": (False, ce(lambda v: fused_vocab_parallel_cross_entropy(v, t, tp))),
        "megatron fused CE, patched": (True, ce(lambda v: fused_vocab_parallel_cross_entropy(v, t, tp))),
        "megatron unfused CE": (False, ce(lambda v: tensor_parallel.vocab_parallel_cross_entropy(v, t))),
        "megatron unfused CE, patched": (True, ce(lambda v: tensor_parallel.vocab_parallel_cross_entropy(v, t))),
        "torch silu(a) * b": (False, sw(lambda v: (lambda a, b: F.silu(a) * b)(*v.chunk(2, -1)))),
        "fusedloss.swiglu": (False, sw(lambda v: fusedloss.swiglu(v))),
        "megatron bias_swiglu_impl": (False, sw(lambda v: fbs.bias_swiglu_impl(v, None))),
        "megatron bias_swiglu_impl, patched": (True, sw(lambda v: fbs.bias_swiglu_impl(v, None))),
        "torch F.rms_norm": (False, sw(lambda v: F.rms_norm(v, (32,), w, 1e-5))),
        "fusedloss.rms_norm": (False, sw(lambda v: fusedloss.rms_norm(v, w, 1e-5))),
        "megatron RMSNorm (local spec)": (False, sw(lambda v: norm(v))),
        "megatron RMSNorm, patched": (False, sw(lambda v: norm_patched(v))),
    }
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(args.rounds):
        for name, (patched, step) in cases.items():
            if patched:
                apply_fusedloss_to_megatron(rms_norm=False)
            for _ in range(50):  # warm-up (Megatron's torch.compile'd helpers compile here)
                step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.calls):
                step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            best[name] = min(best[name], (time.perf_counter() - start) / args.calls * 1e6)
            if patched:
                unpatch_megatron()
    for name, us in best.items():
        print(f"{name:38s} {us:8.1f} us/call")


if __name__ == "__main__":
    main()
