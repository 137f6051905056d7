"""Vocab-parallel cross-entropy over torch.distributed (gloo on CPU): the sharded loss and
gradients equal the unsharded ones; mismatched shards fail on every rank."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusedloss
from dist_util import run_world


def _problem(rows=24, V=2400, seed=1234):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, V, generator=g) * 3
    t = torch.randint(0, V, (rows,), generator=g)
    t[5] = -100
    return x, t


def _check_matches_unsharded(rank, world, reduction, ls, compiled=False, inplace=False):
    x, t = _problem()
    V_local = x.size(1) // world
    shard = x[:, rank * V_local:(rank + 1) * V_local].clone().requires_grad_(True)

    def step(s):  # under torch.compile the group travels into the traced graph as its name
        return fusedloss.cross_entropy(s * 1.0 if inplace else s, t, tp_group=dist.group.WORLD,
                                       reduction=reduction, label_smoothing=ls,
                                       inplace_backward=inplace)

    loss = (torch.compile(step, fullgraph=True, backend="aot_eager") if compiled else step)(shard)
    full = x.double().requires_grad_(True)
    ref = F.cross_entropy(full, t, reduction=reduction, label_smoothing=ls)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    # bit-identical on every rank
    every = [torch.empty_like(loss) for _ in range(world)]
    dist.all_gather(every, loss.contiguous())
    assert all(torch.equal(e, every[0]) for e in every)
    g = torch.rand_like(loss) + 0.5
    dist.broadcast(g, 0)
    loss.backward(g)
    ref.backward(g.double())
    torch.testing.assert_close(shard.grad.double(), full.grad[:, rank * V_local:(rank + 1) * V_local],
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("reduction, ls", [("mean", 0.0), ("none", 0.1), ("sum", 0.0)])
def test_gloo_matches_unsharded(world, reduction, ls):
    run_world(world, _check_matches_unsharded, reduction, ls)


def _check_mismatch(rank, world):
    x, t = _problem(rows=8, V=64 * world)
    V_local = 64 + (1 if rank == 1 else 0)
    try:
        fusedloss.cross_entropy(torch.randn(8, V_local), t, tp_group=dist.group.WORLD)
    except ValueError as e:
        assert "V_local" in str(e), str(e)
        return
    raise AssertionError(f"rank {rank}: no error for mismatched shards")


def test_gloo_mismatched_shards_fail_everywhere():
    run_world(2, _check_mismatch)

@pytest.mark.parametrize("inplace", [False, True])
def test_gloo_torch_compile_fullgraph(inplace):
    run_world(2, _check_matches_unsharded, "mean", 0.1, True, inplace)
