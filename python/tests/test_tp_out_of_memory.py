"""One rank out of memory in a vocab-parallel forward (gloo on CPU): at whichever of the call's
allocations it happens, every rank raises torch.OutOfMemoryError naming that rank at the same
call, none waits in a collective, and the next call runs on every rank. Every allocation of the
forward comes before its agreement."""
import contextlib

import pytest
import torch
import torch.distributed as dist

import fusedloss
import fusedloss._distributed as distributed
from dist_util import run_world


class _OutOfMemoryAt:
    """While active, this process's k-th torch.empty / Tensor.new_empty outside the agreement
    raises torch.OutOfMemoryError (the agreement's own header is a few bytes, allocated before
    its first collective). `seen` counts the allocations."""

    def __init__(self, k):
        self.k, self.seen, self.agreeing = k, 0, False

    def _failing(self, allocate):
        def wrapper(*args, **kwargs):
            if not self.agreeing:
                self.seen += 1
                if self.seen == self.k:
                    raise torch.OutOfMemoryError(f"allocation {self.k}: out of memory (injected)")
            return allocate(*args, **kwargs)
        return wrapper

    def __enter__(self):
        self.saved = torch.empty, torch.Tensor.new_empty, distributed.agree
        agree = distributed.agree

        def agreeing(*args, **kwargs):
            self.agreeing = True
            try:
                return agree(*args, **kwargs)
            finally:
                self.agreeing = False

        torch.empty = self._failing(self.saved[0])
        torch.Tensor.new_empty = self._failing(self.saved[1])
        distributed.agree = agreeing
        return self

    def __exit__(self, *exc):
        torch.empty, torch.Tensor.new_empty, distributed.agree = self.saved
        return False


def _every_allocation_fails_together(rank, world, op):
    g = torch.Generator().manual_seed(0)
    rows, H, V = 11, 8, 24 * world
    h = torch.randn(rows, H, generator=g)
    w = torch.randn(V // world, H, generator=g)
    x = torch.randn(rows, V // world, generator=g)
    t = torch.randint(0, V, (rows,), generator=g)
    calls = {
        "cross_entropy": lambda: fusedloss.cross_entropy(x, t, tp_group=dist.group.WORLD),
        "linear_cross_entropy in_forward": lambda: fusedloss.linear_cross_entropy(
            h.requires_grad_(True), w, t, tp_group=dist.group.WORLD, backward_mode="in_forward"),
        "linear_cross_entropy recompute": lambda: fusedloss.linear_cross_entropy(
            h.requires_grad_(True), w, t, tp_group=dist.group.WORLD, reduction="none"),
    }
    expected = calls[op]().detach()
    k = 0
    while True:  # rank 1's allocations 1, 2, ... fail in turn, until the call makes no more
        k += 1
        injected = _OutOfMemoryAt(k) if rank == 1 else contextlib.nullcontext()
        try:
            with injected:
                calls[op]()
            failed = 0
        except torch.OutOfMemoryError as error:
            assert "vocab-parallel rank 1" in str(error) and f"allocation {k}" in str(error), error
            failed = 1
        every = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(every, torch.tensor([failed]))
        assert all(int(e) == int(every[0]) for e in every), (k, every)
        if not failed:
            break
        assert torch.equal(calls[op]().detach(), expected)  # the next call runs everywhere
    assert k > 3, f"rank 1 made {k - 1} allocations: the injection did not reach the forward"


@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy in_forward",
                                "linear_cross_entropy recompute"])
def test_one_ranks_out_of_memory_is_every_ranks(op):
    run_world(2, _every_allocation_fails_together, op, timeout_s=30)


class _AddressSpaceCap:
    """While active, this process has about `headroom` bytes of address space left (a real
    out-of-memory for the host allocator: torch's CPU allocator raises a RuntimeError)."""

    def __init__(self, headroom):
        self.headroom = headroom

    def __enter__(self):
        import resource
        with open("/proc/self/statm") as statm:
            mapped = int(statm.read().split()[0]) * resource.getpagesize()
        self.saved = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (mapped + self.headroom, self.saved[1]))
        return self

    def __exit__(self, *exc):
        import resource
        resource.setrlimit(resource.RLIMIT_AS, self.saved)
        return False


def _real_out_of_memory_fails_together(rank, world):
    # 2^22 rows, one vocabulary column a rank: the logits and targets exist before the cap; the
    # call's own buffers (stats: 64 MiB, gathered: 128 MiB) do not fit in rank 1's 16 MiB.
    rows = 1 << 22
    x = torch.zeros(rows, 1)
    t = torch.arange(rows) % world
    expected = fusedloss.cross_entropy(x, t, tp_group=dist.group.WORLD)
    cap = _AddressSpaceCap(16 << 20) if rank == 1 else contextlib.nullcontext()
    with pytest.raises(torch.OutOfMemoryError, match="vocab-parallel rank 1"):
        with cap:
            fusedloss.cross_entropy(x, t, tp_group=dist.group.WORLD)
    assert torch.equal(fusedloss.cross_entropy(x, t, tp_group=dist.group.WORLD), expected)


def test_a_real_out_of_memory_is_every_ranks():
    run_world(2, _real_out_of_memory_fails_together, timeout_s=60)
