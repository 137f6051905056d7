"""Run a function on N processes of a gloo (CPU) or NCCL (one GPU per rank) world, or of a gloo
world whose ranks keep the GPUs ("gloo-cuda": CUDA tensors through gloo, every rank on one GPU
when there is one; how TP > 1 runs on a one-GPU machine)."""
import datetime
import os
import socket
import sys
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, backend, fn, args, errors, timeout_s):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "gloo":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU world: keep the GPUs out of it
    else:  # nccl, gloo-cuda
        import torch
        torch.cuda.set_device(rank % torch.cuda.device_count())
    try:
        dist.init_process_group("gloo" if backend == "gloo-cuda" else backend, rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        fn(rank, world, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            # No rank may leave while a peer still talks to it (gloo aborts on a closed peer);
            # bounded, so a rank that died early cannot hang the others.
            try:
                if backend.startswith("gloo"):
                    dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
                else:
                    dist.barrier()
            except Exception:
                pass
    # Leave without running C++ destructors or interpreter finalization: gloo's worker and
    # store threads can abort the process when torn down during finalization, which would
    # turn a passing rank into a SIGABRT. Everything a rank reports is already in `errors`.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

def run_world(world, fn, *args, backend="gloo", timeout_s=60):
    """Runs fn(rank, world, *args) on `world` processes; raises with every failing rank's trace.
    timeout_s bounds every collective, so a rank left waiting fails instead of hanging."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    # A CPU world hides the GPUs from the start: unpickling fn imports modules in the child
    # before _worker runs, and a GPU counted then stays counted (torch caches it).
    hidden = {"CUDA_VISIBLE_DEVICES": ""} if backend == "gloo" else {}
    saved = {k: os.environ.get(k) for k in hidden}
    os.environ.update(hidden)
    try:
        mp.start_processes(_worker, args=(world, _free_port(), backend, fn, args, errors, timeout_s),
                           nprocs=world, join=True, start_method="spawn")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures:
        raise AssertionError("\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(failures)))
