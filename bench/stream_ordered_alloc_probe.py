"""Host cost of fusedloss's stream-ordered scratch (cudaMallocAsync from the device's default
pool, src/cuda/runtime.cu) against torch's caching allocator, after a synchronisation and
without one.

The default pool's release threshold is 0: at every synchronisation it gives its free memory
back, so the next cudaMallocAsync of the linear cross-entropy's 256 MiB chunk buffer may map
memory again, where torch.empty reuses a cached block. A training step synchronises at least
once (the loss's .item()).

    python3 bench/stream_ordered_alloc_probe.py      # needs a CUDA GPU and libcudart under CUDA_HOME
"""
import ctypes
import statistics
import time

import torch

import peers


def main():
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    rt = peers.libcudart()
    if rt is None:
        raise SystemExit(f"no libcudart under {peers._CUDA_HOME}")
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    def check(rc, what):
        if rc != 0:
            raise SystemExit(f"{what}: CUDA error {rc}")

    def malloc_free(nbytes):  # host us of the allocation
        p = ctypes.c_void_p()
        t0 = time.perf_counter()
        check(rt.cudaMallocAsync(ctypes.byref(p), ctypes.c_size_t(nbytes), stream), "cudaMallocAsync")
        t1 = time.perf_counter()
        check(rt.cudaFreeAsync(p, stream), "cudaFreeAsync")
        return (t1 - t0) * 1e6

    def median(v):
        return statistics.median(v[3:])

    for mib in (256, 4):
        n = mib << 20
        after_sync, sync_us, no_sync, torch_after_sync = [], [], [], []
        for _ in range(25):
            torch.cuda.synchronize()
            after_sync.append(malloc_free(n))
            t0 = time.perf_counter()
            torch.cuda.synchronize()
            sync_us.append((time.perf_counter() - t0) * 1e6)
        torch.cuda._sleep(50_000_000)  # the GPU busy: no synchronisation happens below
        no_sync += [malloc_free(n) for _ in range(25)]
        torch.cuda.synchronize()
        for _ in range(25):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            x = torch.empty(n, dtype=torch.uint8, device="cuda")
            torch_after_sync.append((time.perf_counter() - t0) * 1e6)
            del x
        print(f"{mib} MiB: cudaMallocAsync after a sync {median(after_sync):.1f} us, without one "
              f"{median(no_sync):.1f} us; the sync after its free {median(sync_us):.1f} us; "
              f"torch.empty after a sync {median(torch_after_sync):.1f} us", flush=True)


if __name__ == "__main__":
    main()
