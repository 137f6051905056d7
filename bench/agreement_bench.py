"""Host cost of the vocab-parallel shard agreement in the PyTorch API (one all-gather of a
32-byte header per rank and its host sync, every call).

    python bench/agreement_bench.py            # gloo on CPU, 2 ranks (spawned here)
    python bench/agreement_bench.py --nccl     # NCCL, one rank per visible GPU (1 is enough)

Prints, per backend: microseconds per forward call with and without the check
(check_shard_agreement=False), their difference, and the exchange alone; a CSV line each.
"""
import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _time_us(fn, iters, sync):
    for _ in range(5):
        fn()
    sync()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def _worker(rank, world, port, backend, rows, v_local, iters, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = "cuda"
    dist.init_process_group(backend, rank=rank, world_size=world)
    import fusedloss
    from fusedloss import _distributed
    group = dist.group.WORLD
    x = torch.randn(rows, v_local, device=device)
    t = torch.randint(0, v_local * world, (rows,), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def call(check):
        return lambda: fusedloss.cross_entropy(x, t, tp_group=group, check_shard_agreement=check)

    res = {}
    if world > 1:
        res["checked"] = _time_us(call(True), iters, sync)
        res["unchecked"] = _time_us(call(False), iters, sync)
    res["exchange"] = _time_us(lambda: _distributed.agree(group, rows, v_local, 0, None, "bench"), iters, sync)
    if rank == 0:
        out.put(res)
    dist.barrier()
    os._exit(0)  # gloo's threads can abort in interpreter teardown; the result is already out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nccl", action="store_true")
    ap.add_argument("--world", type=int, default=None)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--vocab-local", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    backend = "nccl" if args.nccl else "gloo"
    world = args.world or (torch.cuda.device_count() if args.nccl else 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(world, port, backend, args.rows, args.vocab_local, args.iters, out),
                       nprocs=world, start_method="spawn")
    res = out.get()
    print("backend,world,rows,vocab_local,checked_us,unchecked_us,difference_us,exchange_alone_us")
    checked, unchecked = res.get("checked", float("nan")), res.get("unchecked", float("nan"))
    print(f"{backend},{world},{args.rows},{args.vocab_local},{checked:.1f},{unchecked:.1f},"
          f"{checked - unchecked:.1f},{res['exchange']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
