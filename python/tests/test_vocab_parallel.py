"""Vocab-parallel cross-entropy over torch.distributed (gloo on CPU): the sharded loss and
gradients equal the unsharded ones; mismatched shards fail on every rank."""
import time

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


def _check_matches_unsharded(rank, world, reduction, ls, compiled=False, inplace=False,
                             in_forward=False):
    x, t = _problem()
    V_local = x.size(1) // world
    shard = x[:, rank * V_local:(rank + 1) * V_local].clone().requires_grad_(True)

    def step(s):  # under torch.compile the group travels into the traced graph as its name
        return fusedloss.cross_entropy(s * 1.0 if inplace else s, t, tp_group=dist.group.WORLD,
                                       reduction=reduction, label_smoothing=ls,
                                       inplace_backward=inplace, grad_in_forward=in_forward)

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


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gloo_gradient_in_the_forward(reduction):
    # grad_in_forward with a sum/mean loss: the merged lse, then each shard's gradient, in the
    # forward; the backward scales it
    run_world(2, _check_matches_unsharded, reduction, 0.1, False, True, True)


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


# ---- every rank raises the same error at the same call, promptly, on the first call and later ----

def _same_error_everywhere(call, *match):
    """Runs call(); every rank must raise, with one identical message containing `match`."""
    start = time.monotonic()
    try:
        call()
        message = None
    except ValueError as e:
        message = str(e)
    elapsed = time.monotonic() - start
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, message)
    assert message is not None, f"rank {dist.get_rank()}: no error; others: {every}"
    assert all(m == message for m in every), every
    for m in match:
        assert m in message, message
    assert elapsed < 10, f"{elapsed:.1f} s to raise"  # the group's timeout is 30 s


def _ce(x, t, **kw):
    return fusedloss.cross_entropy(x, t, tp_group=dist.group.WORLD, **kw)


def _check_later_disagreement(rank, world, what):
    V_local, rows = 32, 6
    t = torch.randint(0, V_local * world, (rows,), generator=torch.Generator().manual_seed(7))
    for _ in range(2):  # agreed steps first: nothing may be cached from them
        _ce(torch.randn(rows, V_local, requires_grad=True), t).backward()
    if what == "rows":
        r = rows - 1 if rank == world - 1 else rows
        _same_error_everywhere(lambda: _ce(torch.randn(r, V_local), t[:r]), "vocab-parallel rows",
                               f"rank {world - 1} has {rows - 1} rows")
    elif what == "V_local":
        v = V_local + 1 if rank == 1 else V_local
        _same_error_everywhere(lambda: _ce(torch.randn(rows, v), t), "shard size", "rank 1 has V_local 33")
    elif what == "target":  # out of range on one rank only
        bad = t.clone()
        if rank == world - 1:
            bad[3] = V_local * world + 5
        _same_error_everywhere(lambda: _ce(torch.randn(rows, V_local), bad),
                               f"vocab-parallel rank {world - 1}: target[3]: got {V_local * world + 5}")
    elif what == "target_values":  # in range on every rank, but another token on one rank
        other = t.clone()
        if rank == 1:
            other[4] = (int(t[4]) + 1) % (V_local * world)
        _same_error_everywhere(lambda: _ce(torch.randn(rows, V_local), other),
                               "vocab-parallel targets: rank 1's differ from rank 0's")
    elif what == "target_layouts":  # the same tokens in another layout and dtype: agreed
        same = torch.stack([t, t], -1)[..., 1].to(torch.int32) if rank == 1 else t
        loss = _ce(torch.randn(rows, V_local), same)
        assert torch.isfinite(loss)
    elif what == "target_rows_swapped":  # the same tokens, two blocks of rows in another order
        other = t.clone()
        if rank == 1:
            other = torch.cat([t[3:], t[:3]])
        _same_error_everywhere(lambda: _ce(torch.randn(rows, V_local), other),
                               "vocab-parallel targets: rank 1's differ from rank 0's")
    elif what == "dtype":  # a rank whose own arguments are rejected before the op
        x = torch.randn(rows, V_local, dtype=torch.float64 if rank == 0 else torch.float32)
        _same_error_everywhere(lambda: _ce(x, t), "vocab-parallel rank 0: logits.dtype: got torch.float64")
    elif what == "options":  # another smoothing on one rank: different losses, silently, before
        ls = 0.2 if rank == 1 else 0.0
        _same_error_everywhere(lambda: _ce(torch.randn(rows, V_local), t, label_smoothing=ls),
                               "vocab-parallel options: rank 1's label_smoothing=0.2 differs from "
                               "rank 0's label_smoothing=0.0")
    elif what == "options_hash_alike":  # values hash() does not tell apart (mod 2**61 - 1)
        kw = [dict(label_smoothing=0.5), dict(label_smoothing=2.0 ** -62),
              dict(ignore_index=3), dict(ignore_index=3 + 2 ** 61 - 1)]
        for a, b in ((0, 1), (2, 3)):
            name = next(iter(kw[a]))
            _same_error_everywhere(lambda: _ce(torch.randn(rows, V_local), t, **kw[b if rank else a]),
                                   f"vocab-parallel options: rank 1's {name}={kw[b][name]!r} differs "
                                   f"from rank 0's {name}={kw[a][name]!r}")
    elif what == "bad_option":  # raised on that rank alone while the others waited
        ii = 1.5 if rank == 1 else -100
        _same_error_everywhere(lambda: _ce(torch.randn(rows, V_local), t, ignore_index=ii),
                               "vocab-parallel rank 1: ignore_index: got 1.5")
    elif what == "V_local_and_target":  # the smaller shard's targets are out of its range too
        v = V_local - 1 if rank == 1 else V_local
        big = t.clone()
        big[0] = V_local * world - 1
        _same_error_everywhere(lambda: _ce(torch.randn(rows, v), big), "shard size",
                               f"rank 1 has V_local {V_local - 1}")
    elif what == "grad_in_forward":  # the gradient in the forward asked for a per-row loss, on one rank
        gif = rank == 1
        _same_error_everywhere(
            lambda: _ce(torch.randn(rows, V_local, requires_grad=True) * 1, t, reduction="none",
                        grad_in_forward=gif),
            "vocab-parallel rank 1: grad_in_forward: got True with reduction='none'")
    elif what == "grad_in_forward_target":  # the gradient in the forward, a bad target on one rank
        bad = t.clone()
        if rank == 0:
            bad[2] = -7
        x = torch.randn(rows, V_local, requires_grad=True) * 1
        before = x.detach().clone()
        _same_error_everywhere(lambda: _ce(x, bad, grad_in_forward=True),
                               "vocab-parallel rank 0: target[2]: got -7")
        assert torch.equal(x.detach(), before)  # refused before anything was written
    elif what == "check_flag":  # the agreement's own flag, bad on one rank
        kw = dict(check_shard_agreement=1) if rank == 1 else {}
        _same_error_everywhere(lambda: _ce(torch.randn(rows, V_local), t, **kw),
                               "vocab-parallel rank 1: check_shard_agreement: got 1 (int)")
    elif what == "overflow":  # an option whose conversion raises OverflowError, on one rank
        ls = 10 ** 400 if rank == 1 else 0.0
        _same_error_everywhere(lambda: _ce(torch.randn(rows, V_local), t, label_smoothing=ls),
                               "vocab-parallel rank 1: label_smoothing: got an integer too large")
    elif what == "bits8_target":  # an integer-like dtype that cannot be widened, on one rank
        tt = t.to(torch.uint8).view(torch.bits8) if rank == 1 else t
        _same_error_everywhere(lambda: _ce(torch.randn(rows, V_local), tt),
                               "vocab-parallel rank 1: target.dtype: got torch.bits8")
    elif what == "sparse":  # logits of another layout on one rank
        x = torch.randn(rows, V_local)
        _same_error_everywhere(lambda: _ce(x.to_sparse() if rank == 1 else x, t),
                               "vocab-parallel rank 1: logits.layout: got torch.sparse_coo")
    elif what == "transposed_3d":  # [s, b, V] on one rank, [b, s, V] on another: equal rows
        x, t3 = torch.randn(3, 2, V_local), t.view(3, 2)
        if rank == 1:
            x, t3 = x.transpose(0, 1).contiguous(), t3.transpose(0, 1).contiguous()
        _same_error_everywhere(lambda: _ce(x, t3), "vocab-parallel options: rank 1's target_shape=(2, 3) "
                               "differs from rank 0's target_shape=(3, 2)")
    # and the group is still usable afterwards: a good call agrees again
    loss = _ce(torch.randn(rows, V_local), t)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("what", ["rows", "V_local", "target", "target_values",
                                  "target_rows_swapped", "target_layouts", "dtype", "options",
                                  "options_hash_alike", "bad_option",
                                  "V_local_and_target", "grad_in_forward", "grad_in_forward_target",
                                  "check_flag", "overflow", "sparse", "transposed_3d", "bits8_target"])
def test_gloo_disagreement_raises_everywhere(world, what):
    run_world(world, _check_later_disagreement, what, timeout_s=30)


def _check_opt_out_skips_the_exchange(rank, world):
    calls = []
    real = dist.all_gather_into_tensor

    def counting(out, inp, group=None, **kw):
        calls.append(inp.numel())
        return real(out, inp, group=group, **kw)

    dist.all_gather_into_tensor = counting
    try:
        x = torch.randn(4, 16)
        t = torch.randint(0, 16 * world, (4,), generator=torch.Generator().manual_seed(3))  # one
        _ce(x, t)  # set of tokens on every rank
        checked = len(calls)
        calls.clear()
        _ce(x, t, check_shard_agreement=False)
        assert (checked, len(calls)) == (2, 1), (checked, len(calls))  # header + stats vs stats
    finally:
        dist.all_gather_into_tensor = real


def test_gloo_agreement_opt_out_skips_the_exchange():
    run_world(2, _check_opt_out_skips_the_exchange, timeout_s=30)


def test_target_checksum_matches_the_cpp_formula():
    """The agreement's targets checksum: the C++ test pins the same vector to the same value
    (tests/single_gpu/test_bad_inputs.cpp, TargetChecksumTestVector); layouts and index dtypes
    of equal values give equal sums."""
    from fusedloss._distributed import _target_checksum
    t = torch.tensor([5, -100, 0, 151935, 7])
    assert int(_target_checksum(t, "cpu")) & (2**64 - 1) == 0x7F5C27945F2FEAAA
    base = torch.stack([t, torch.zeros_like(t)], -1)  # a strided view of the same values
    for same in (base[:, 0], t.to(torch.int32), t.view(5, 1).expand(5, 3)[:, 1]):
        assert torch.equal(_target_checksum(same, "cpu"), _target_checksum(t, "cpu"))
    # with a loss_mask's row weights (the C++ test pins the same): -0 is 0, and a target and a
    # weight of the same bits cannot trade places
    w = torch.tensor([1.0, 0.0, -0.0, 0.5, 2.0])
    assert int(_target_checksum((t, w), "cpu")) & (2**64 - 1) == 0x3317C8ADCA28A5C0
    assert torch.equal(_target_checksum((t, w.abs()), "cpu"), _target_checksum((t, w), "cpu"))
    bits = lambda *v: torch.tensor(v, dtype=torch.int64).to(torch.int32).view(torch.float32)  # noqa: E731
    # every NaN (sign, payload, signalling) is the one quiet NaN (pinned in C++ too)
    nans = bits(0xFFC00001 - 2**32, 0x3F800000, 0x7F800001)
    assert int(_target_checksum((t[:3], nans), "cpu")) & (2**64 - 1) == 0x90776F2527E8F90C
    assert not torch.equal(_target_checksum((torch.tensor([5]), bits(0)), "cpu"),
                           _target_checksum((torch.tensor([0]), bits(5)), "cpu"))


def _check_compiled_rejection(rank, world, op, everywhere, use):
    # Traced with fullgraph=True, an argument rejected while tracing cannot reach the other
    # ranks there (no collective): every rank raises it when the graph runs, whatever the code
    # after the call does with the loss (a training step's backward; a per-token loss's view).
    V_local, rows, H = 32, 6, 8
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, V_local, generator=g, requires_grad=True)
    h = torch.randn(rows, H, generator=g, requires_grad=True)
    w = torch.randn(V_local, H, generator=g, requires_grad=True)
    t = torch.randint(0, V_local * world, (2, rows // 2), generator=g)
    bad = everywhere or rank == 1
    G = dist.group.WORLD
    if op == "cross_entropy":  # an option rejected while tracing
        loss_of = lambda: fusedloss.cross_entropy(
            x, t.view(-1), tp_group=G, reduction="none",
            smoothing_formula="bogus" if bad else "pytorch").view(t.shape)
        match = "smoothing_formula: got 'bogus'"
    else:  # the target's dtype, rejected while tracing
        loss_of = lambda: fusedloss.linear_cross_entropy(
            h, w, (t.float() if bad else t).view(-1), tp_group=G, reduction="none").view(t.shape)
        match = "target.dtype: got torch.float32"

    def step():
        loss = loss_of()
        if use == "backward":
            loss.sum().backward()
        return loss

    _same_error_everywhere(torch.compile(step, fullgraph=use != "backward", backend="aot_eager"),
                           f"vocab-parallel rank {0 if everywhere else 1}: ", match)


@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy"])
@pytest.mark.parametrize("everywhere", [False, True])
@pytest.mark.parametrize("use", ["view", "backward"])
def test_compiled_rejection_raises_everywhere(op, everywhere, use):
    run_world(2, _check_compiled_rejection, op, everywhere, use, timeout_s=60)


def _check_one_ranks_layouts(rank, world, op):
    # Rank 1 alone passes its tensors in every layout (views of a leaf) and dtype: each call
    # gives the bits that rank's contiguous copy gives, on every rank, writes nothing the caller
    # owns, and its gradient reaches the leaf as autograd maps the contiguous copy's through the
    # view (rows that share memory sum).
    from layouts import LAYOUTS, leaf
    rows, V_local, H = 6, 16, 8
    t = torch.randint(0, V_local * world, (rows,), generator=torch.Generator().manual_seed(5))
    G = dist.group.WORLD
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for layout in LAYOUTS:
            gen = torch.Generator().manual_seed(100 + rank)
            mine = layout if rank == 1 else "contiguous"
            if op == "cross_entropy":
                shapes = [(rows, V_local)]
                call = lambda x: fusedloss.cross_entropy(x[0], t, tp_group=G, reduction="none")
            else:
                shapes = [(rows, H), (V_local, H)]
                call = lambda x: fusedloss.linear_cross_entropy(x[0], x[1], t, tp_group=G,
                                                                reduction="none")
            made = [leaf(mine, s, dtype, "cpu", gen, step=3) for s in shapes]
            bases = [b for b, _ in made]
            views = [view(b) for b, view in made]
            before = [b.detach().clone() for b in bases]
            copies = [v.detach().clone().requires_grad_(True) for v in views]
            upstream = torch.rand(rows, generator=gen) + 0.5
            loss = call(views)
            (loss * upstream).sum().backward()
            expected = call(copies)
            (expected * upstream).sum().backward()
            where = f"{dtype} {layout}"
            assert torch.equal(loss, expected), where
            for b, old in zip(bases, before):
                assert torch.equal(b.detach(), old), f"{where}: the caller's tensor was written"
            for (b, view), c in zip(made, copies):
                want, = torch.autograd.grad(view(b), b, c.grad)
                torch.testing.assert_close(b.grad, want, rtol=1e-2 if dtype != torch.float32 else 1e-6,
                                           atol=1e-6, msg=where)


@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy"])
def test_one_ranks_layouts_give_its_contiguous_bits(op):
    run_world(2, _check_one_ranks_layouts, op, timeout_s=60)


def test_a_differing_option_is_named_and_so_is_a_different_call():
    from fusedloss._distributed import _differing_option
    assert (_differing_option(["a=1", "b=2"], ["a=1", "b=3"], 1)
            == "rank 1's b=2 differs from rank 0's b=3")
    # another op on each rank (the cross-entropy's options beside the fused head's): not
    # "rank 1's smoothing_formula='megatron' differs from rank 0's label_smoothing=0.0"
    msg = _differing_option(["ignore_index=-100", "smoothing_formula='megatron'"],
                            ["ignore_index=-100", "label_smoothing=0.0", "H=8"], 1)
    assert msg.startswith("rank 1 compared the options (ignore_index, smoothing_formula) where "
                          "rank 0 compared (ignore_index, label_smoothing, H): another call")


def _check_class_weight_with_smoothing(rank, world, seed, dtype, formula):
    """A per-class weight with label smoothing at TP 2: the loss of TP 1 and of float64, the
    shard's gradient, for every reduction; the partition scope refused on every rank alike."""
    from test_cross_entropy import weighted_reference
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(20, 64, generator=g) * 2).to(dtype)
    t = torch.randint(0, 64, (20,), generator=g)
    t[::4] = -100
    w = torch.rand(64, generator=g) + 0.25
    own = slice(rank * 32, (rank + 1) * 32)
    options = dict(weight=w, label_smoothing=0.1, smoothing_formula=formula)
    for reduction in ("mean", "sum", "none"):
        shard = x[:, own].clone().requires_grad_()
        loss = fusedloss.cross_entropy(shard, t, tp_group=dist.group.WORLD, reduction=reduction,
                                       **options)
        up = torch.rand(loss.shape, generator=g) + 0.5
        loss.backward(up)
        whole = x.clone().requires_grad_()
        single = fusedloss.cross_entropy(whole, t, reduction=reduction, **options)
        single.backward(up)
        x64 = x.double().requires_grad_()
        ref = weighted_reference(x64, t, w.double(), 0.1, reduction, formula)
        ref.backward(up.double())
        torch.testing.assert_close(loss, single, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
        # bf16: the op's gradient and the smoothing term's, each rounded once, then added
        atol = 1e-6 if dtype == torch.float32 else 2 ** -8 * x64.grad.abs().max().item()
        torch.testing.assert_close(shard.grad.double(), whole.grad[:, own].double(),
                                   rtol=1e-5, atol=min(atol, 1e-7) if dtype == torch.float32
                                   else atol)
        torch.testing.assert_close(shard.grad.double(), x64.grad[:, own],
                                   rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=atol)
    _same_error_everywhere(lambda: fusedloss.cross_entropy(
        x[:, own], t, tp_group=dist.group.WORLD, smoothing_scope="partition", **options),
        "weight: got a tensor with label_smoothing=0.1 and smoothing_scope='partition'")


@pytest.mark.parametrize("dtype, formula", [(torch.float32, "pytorch"), (torch.bfloat16, "pytorch"),
                                            (torch.float32, "megatron")])
def test_gloo_class_weight_with_smoothing(dtype, formula):
    run_world(2, _check_class_weight_with_smoothing, int(torch.randint(1 << 30, ())), dtype,
              formula)
