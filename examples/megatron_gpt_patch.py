"""A tiny Megatron-core GPTModel trained from one seed, with and without the fusedloss patch
(cross-entropy fusion 'native' and fused SwiGLU on). Prints both loss curves, step time,
tokens/s and peak memory, and writes them as CSV.

    python3 examples/megatron_gpt_patch.py --steps 50 --out bench/results

The one line that matters is `apply_fusedloss_to_megatron()`.
"""
import argparse
import csv
import datetime
import os
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F


def build(args, seed):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    bf16 = args.dtype == "bf16"
    cfg = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden, gated_linear_unit=True, activation_func=F.silu,
        bias_activation_fusion=True, add_bias_linear=False, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native",
        hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=args.vocab, max_sequence_length=args.seq).cuda()
    return Float16Module(cfg, model) if bf16 else model


def train(args, patched):
    from fusedloss.megatron import apply_fusedloss_to_megatron, unpatch_megatron

    if patched:
        # <- the one line (--linear-cross-entropy: the output layer and loss fused too)
        # "auto": with the loss_mask below, the head computes its gradients in the forward
        apply_fusedloss_to_megatron(linear_cross_entropy=args.linear_cross_entropy,
                                    linear_cross_entropy_backward="auto")
    model = build(args, seed=1234)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = torch.Generator(device="cuda").manual_seed(99)
    # a small fixed corpus, cycled, so the loss goes somewhere
    corpus = torch.randint(0, args.vocab, (8, args.batch, args.seq + 1), device="cuda", generator=g)
    pos = torch.arange(args.seq, device="cuda").unsqueeze(0).expand(args.batch, -1)
    mask = torch.triu(torch.ones(1, 1, args.seq, args.seq, device="cuda", dtype=torch.bool), diagonal=1)
    losses, times = [], []
    torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        tokens = corpus[step % len(corpus)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        # as pretrain_gpt: the loss_mask to the model and the loss function (the fused head
        # then computes its gradients in the forward)
        loss_mask = torch.ones(tokens.size(0), args.seq, device="cuda")
        per_token = model(tokens[:, :-1], pos, mask, labels=tokens[:, 1:], loss_mask=loss_mask)
        loss = (per_token.float().view(-1) * loss_mask.view(-1)).sum() / loss_mask.sum()
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() / 2**20
    if patched:
        unpatch_megatron()
    del model, opt
    torch.cuda.empty_cache()
    return losses, times, peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                    help="fp32 holds the two loss curves to a tighter tolerance than bf16")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="largest relative loss difference accepted (default 5e-2 bf16, 1e-3 fp32)")
    ap.add_argument("--linear-cross-entropy", action="store_true",
                    help="patch with linear_cross_entropy=True (no [s, b, V] logits)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("megatron_gpt_patch.py needs a CUDA GPU (Megatron's GPTModel over NCCL); "
              "none is usable here, nothing to do")
        return
    warnings.filterwarnings("ignore")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)

    runs = {name: train(args, patched) for name, patched in (("megatron", False), ("fusedloss", True))}
    tokens = args.batch * args.seq
    skip = min(5, args.steps - 1)  # warm-up steps (compilation, allocator) left out of timings
    print(f"{'step':>4} {'megatron loss':>14} {'fusedloss loss':>15} {'rel diff':>9}")
    worst = 0.0
    for i in range(args.steps):
        a, b = runs["megatron"][0][i], runs["fusedloss"][0][i]
        worst = max(worst, abs(a - b) / abs(a))
        if i % 5 == 0 or i == args.steps - 1:
            print(f"{i:>4} {a:>14.4f} {b:>15.4f} {abs(a - b) / abs(a):>9.2e}")
    for name, (losses, times, peak) in runs.items():
        ms = 1e3 * sum(times[skip:]) / len(times[skip:])
        print(f"{name:>10}: step {ms:.1f} ms, {tokens / ms * 1e3:,.0f} tokens/s, peak memory {peak:,.0f} MiB")
    print(f"largest relative loss difference over {args.steps} steps: {worst:.2e}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = torch.cuda.get_device_name().replace(" ", "-")
        suffix = "" if args.dtype == "bf16" else "-fp32"
        path = os.path.join(args.out, f"{datetime.date.today().isoformat()}-{name}-megatron-gpt{suffix}.csv")
        with open(path, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["provider", "step", "loss", "step_ms", "peak_mib", "layers", "hidden", "vocab",
                        "seq", "batch", "gpu", "commit"])
            for prov, (losses, times, peak) in runs.items():
                for i, (l, t) in enumerate(zip(losses, times)):
                    w.writerow([prov, i, f"{l:.6f}", f"{t * 1e3:.3f}", f"{peak:.0f}", args.layers, args.hidden,
                                args.vocab, args.seq, args.batch, torch.cuda.get_device_name(),
                                os.environ.get("FUSEDLOSS_COMMIT", "")])
        print(f"wrote {path}")
    dist.destroy_process_group()
    tolerance = args.tolerance or (5e-2 if args.dtype == "bf16" else 1e-3)
    if worst > tolerance:
        raise SystemExit(f"loss curves disagree: {worst:.2e} > {tolerance:.0e}")


if __name__ == "__main__":
    main()
