"""Vocab-parallel cross-entropy over torch.distributed, launched by torchrun:

    torchrun --nproc-per-node N examples/vocab_parallel.py [--vocab 131072 --rows 8192]

Each rank holds V/N columns of the logits; fusedloss merges the shards with one all-gather of
16 B/row. Then the LM head and the loss in one op (fusedloss.linear_cross_entropy), vocab- and
sequence-parallel: each rank holds V/N rows of the output weight and rows/N of the hidden
states. NCCL when every rank has a GPU, else gloo on the CPU. Checks the losses and this rank's
gradient shards against the unsharded torch reference (bench/tp_bench.py times the
cross-entropy against peers).
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
    if V % world or args.rows % world:
        raise SystemExit(f"--vocab {V} and --rows {args.rows} must divide by the world size {world}")
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

    # hidden [rows, H] @ weight.T without the [rows, V] logits: this rank's token slice of hidden
    # (gathered by the op) and vocabulary shard of weight; the hidden gradient comes back summed
    # over the ranks for this rank's slice (dhidden_reduction="reduce_scatter")
    H, n = 256, args.rows // world
    hidden = torch.randn(args.rows, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * H ** -0.5).to(dtype)
    h_slice = hidden[rank * n:(rank + 1) * n].to(dev).requires_grad_(True)
    w_shard = weight[rank * Vl:(rank + 1) * Vl].to(dev).requires_grad_(True)
    loss = fusedloss.linear_cross_entropy(h_slice, w_shard, target.to(dev), tp_group=dist.group.WORLD,
                                          dhidden_reduction="reduce_scatter")
    loss.backward()
    ref_h, ref_w = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    ref = F.cross_entropy(F.linear(ref_h, ref_w), target)
    ref.backward()
    dh_err = (h_slice.grad.double().cpu() - ref_h.grad[rank * n:(rank + 1) * n]).abs().max().item()
    dw_err = (w_shard.grad.double().cpu() - ref_w.grad[rank * Vl:(rank + 1) * Vl]).abs().max().item()
    print(f"rank {rank}/{world} linear CE loss {loss.item():.6f} reference {ref.item():.6f} "
          f"max |dhidden - reference| {dh_err:.2e} max |dweight - reference| {dw_err:.2e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
