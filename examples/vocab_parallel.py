"""Vocab-parallel cross-entropy over torch.distributed, launched by torchrun:

    torchrun --nproc-per-node N examples/vocab_parallel.py [--vocab 131072 --rows 8192]

Each rank holds V/N columns of the logits; fusedloss merges the shards with one all-gather of
16 B/row. NCCL when every rank has a GPU, else gloo on the CPU. Checks the loss and this rank's
gradient shard against the unsharded torch reference (bench/tp_bench.py times it against peers).
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusedloss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--rows", type=int, default=1024)
    args = ap.parse_args()
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", 1))
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = "cuda" if use_cuda else "cpu"
    dtype = torch.bfloat16 if use_cuda else torch.float32
    V, Vl = args.vocab, args.vocab // world
    if V % world:
        raise SystemExit(f"--vocab {V} must divide by the world size {world}")
    g = torch.Generator().manual_seed(0)  # the same full problem on every rank
    full = (torch.randn(args.rows, V, generator=g) * 2).to(dtype)
    target = torch.randint(0, V, (args.rows,), generator=g)
    shard = full[:, rank * Vl:(rank + 1) * Vl].to(dev).requires_grad_(True)
    loss = fusedloss.cross_entropy(shard, target.to(dev), tp_group=dist.group.WORLD)
    loss.backward()
    ref_x = full.double().requires_grad_(True)
    ref = F.cross_entropy(ref_x, target)
    ref.backward()
    grad_err = (shard.grad.double().cpu() - ref_x.grad[:, rank * Vl:(rank + 1) * Vl]).abs().max().item()
    print(f"rank {rank}/{world} [{dist.get_backend()}] loss {loss.item():.6f} reference {ref.item():.6f} "
          f"max |grad - reference| {grad_err:.2e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
