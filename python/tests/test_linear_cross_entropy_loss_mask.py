"""fusedloss.linear_cross_entropy(..., reduction="none", loss_mask=m): the in-forward backward
for per-token losses that the caller reduces as c * sum(m * loss) (Megatron's loss_func), against
float64 torch; the backward's check of the upstream gradient; bad masks; torch.compile; gloo TP."""
import pytest
import torch
import torch.distributed as dist

import fusedloss
from dist_util import run_world
from test_linear_cross_entropy import _TOL, _problem, _rel, reference

_MASKS = {
    "bool": lambda shape, g: torch.rand(shape, generator=g) > 0.3,
    "float01": lambda shape, g: (torch.rand(shape, generator=g) > 0.3).float(),
    "int": lambda shape, g: (torch.rand(shape, generator=g) > 0.3).to(torch.int64),
    "weights": lambda shape, g: torch.where(torch.rand(shape, generator=g) > 0.3,
                                            torch.rand(shape, generator=g) * 3 - 1, 0.0),
    "strided": lambda shape, g: (torch.rand(*shape, 2, generator=g) > 0.3).float()[..., 1],
    "transposed": lambda shape, g: (torch.rand(*reversed(shape), generator=g) > 0.3).float().t(),
    "sliced": lambda shape, g: (torch.rand(shape[0], 2 * shape[1] + 1, generator=g) > 0.3)
    .to(torch.float16)[:, 1::2],
    "expanded": lambda shape, g: (torch.rand(1, shape[1], generator=g) > 0.3).double().expand(shape),
    "float64": lambda shape, g: (torch.rand(shape, generator=g) > 0.3).double(),
    "all_zero": lambda shape, g: torch.zeros(shape),
}


def _megatron_reduction(loss, mask, scale=3.0):
    """Megatron's loss_func: sum(loss * mask) over the tokens, divided by their count, times a
    loss scale."""
    mask = mask.to(loss.dtype)
    return (loss.reshape(-1) * mask.reshape(-1)).sum() / mask.sum().clamp(min=1) * scale


def _check_masked(device, dtype, mask_kind, shape=(9, 4), seed=0, **options):
    h, w, t = _problem(device, dtype, shape=shape, seed=seed)
    mask = _MASKS[mask_kind](shape, torch.Generator().manual_seed(seed + 1)).to(device)
    mask_before = mask.clone()
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fusedloss.linear_cross_entropy(hh, ww, t, reduction="none", loss_mask=mask, **options)
    _megatron_reduction(loss, mask).backward()
    fusedloss.check_device_errors()
    h64, w64 = h.double().cpu().requires_grad_(), w.double().cpu().requires_grad_()
    ref_opts = {k: v for k, v in options.items() if k in ("label_smoothing", "z_loss", "logit_softcap")}
    ref = reference(h64, w64, t.cpu(), reduction="none", **ref_opts)
    _megatron_reduction(ref, mask.cpu()).backward()
    tol = _TOL[dtype]
    assert _rel(loss.detach().cpu(), ref.detach()) <= max(tol, 1e-5)  # the loss is not masked
    if mask_kind == "all_zero":
        assert not hh.grad.any() and not ww.grad.any()
    else:
        assert _rel(hh.grad.cpu(), h64.grad) <= tol and _rel(ww.grad.cpu(), w64.grad) <= tol
    assert torch.equal(mask, mask_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_kind", list(_MASKS))
def test_masked_loss_matches_float64(device, dtype, mask_kind):
    _check_masked(device, dtype, mask_kind)


@pytest.mark.parametrize("options", [dict(workspace_bytes=1), dict(inplace_backward=False),
                                     dict(dweight_accumulation="weight_dtype"),
                                     dict(label_smoothing=0.1, z_loss=1e-3, logit_softcap=4.0),
                                     dict(backward_mode="in_forward"),
                                     dict(backward_mode="recompute")])
def test_masked_loss_with_options(device, options):
    _check_masked(device, torch.bfloat16, "float01", **options)


def _upstream_check_fails(device, backward):
    """The in-forward backward refuses an upstream gradient that is not c * loss_mask: the host
    raises; CUDA gives NaN gradients and raises at check_device_errors()."""
    why = r"grad_loss\[\d+\].*loss_mask.*expected c \* row_weight.*recompute"
    if device == "cpu":
        with pytest.raises(ValueError, match=why):
            backward()
        return
    backward()
    with pytest.raises(ValueError, match=why):
        fusedloss.check_device_errors()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_upstream_gradient_not_proportional_to_the_mask(device, dtype):
    h, w, t = _problem(device, dtype, shape=(9, 4))
    mask = torch.ones(9, 4, device=device)
    mask[2, 1] = 0
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fusedloss.linear_cross_entropy(hh, ww, t, reduction="none", loss_mask=mask)
    _upstream_check_fails(device, lambda: loss.mean().backward())  # ignores the mask
    if device != "cpu":
        assert hh.grad.isnan().all() and ww.grad.isnan().all()
    # fp16 takes recompute: any upstream gradient, the mask unread
    h16, w16 = h.to(torch.float16).requires_grad_(), w.to(torch.float16).requires_grad_()
    fusedloss.linear_cross_entropy(h16, w16, t, reduction="none", loss_mask=mask).mean().backward()
    h64, w64 = h16.detach().double().cpu().requires_grad_(), w16.detach().double().cpu().requires_grad_()
    reference(h64, w64, t.cpu(), reduction="none").mean().backward()
    assert _rel(h16.grad.cpu(), h64.grad) <= _TOL[torch.float16]


def test_non_finite_upstream_gradient_gives_nan_gradients(device):
    h, w, t = _problem(device, torch.float32, shape=(12,))
    mask = torch.ones(12, device=device)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fusedloss.linear_cross_entropy(hh, ww, t, reduction="none", loss_mask=mask)
    g = torch.ones_like(loss)
    g[3] = float("inf")
    loss.backward(g)
    fusedloss.check_device_errors()  # not the mask's error: the gradient overflowed upstream
    assert hh.grad.isnan().all() and ww.grad.isnan().all()


def test_bad_masks(device):
    h, w, t = _problem(device, torch.float32, shape=(9, 4))
    h.requires_grad_()
    mask = torch.ones(9, 4, device=device)
    call = lambda **kw: fusedloss.linear_cross_entropy(h, w, t, **kw)
    with pytest.raises(ValueError, match=r"loss_mask: got a tensor with reduction='mean', expected reduction='none'"):
        call(loss_mask=mask)
    with pytest.raises(ValueError, match=r"loss_mask: got shape \(4, 9\), expected target's shape \(9, 4\)"):
        call(reduction="none", loss_mask=mask.t())
    with pytest.raises(ValueError, match="loss_mask: got a tensor that requires grad"):
        call(reduction="none", loss_mask=mask.clone().requires_grad_())
    with pytest.raises(ValueError, match="loss_mask.dtype: got torch.complex64"):
        call(reduction="none", loss_mask=mask.to(torch.complex64))
    with pytest.raises(TypeError, match="loss_mask: got list"):
        call(reduction="none", loss_mask=[1.0] * 36)
    with pytest.raises(ValueError, match="backward_mode: got 'in_forward' with reduction='none' and no loss_mask"):
        call(reduction="none", backward_mode="in_forward")
    if device == "cuda":
        with pytest.raises(ValueError, match="loss_mask.device: got cpu"):
            call(reduction="none", loss_mask=mask.cpu())


def test_mask_changed_before_the_backward_raises(device):
    # the mask is saved for the backward's check (not copied when already fp32 and contiguous):
    # an in-place change in between is autograd's version error, not a wrong gradient
    h, w, t = _problem(device, torch.float32, shape=(12,))
    h.requires_grad_()
    mask = torch.ones(12, device=device)
    loss = fusedloss.linear_cross_entropy(h, w, t, reduction="none", loss_mask=mask)
    mask[0] = 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _megatron_reduction(loss, mask).backward()


def test_compile_fullgraph(device):
    h, w, t = _problem(device, torch.float32, shape=(9, 4))
    mask = (torch.rand(9, 4, generator=torch.Generator().manual_seed(3)) > 0.3).float().to(device)

    def step(h, w, m):
        return _megatron_reduction(
            fusedloss.linear_cross_entropy(h, w, t, reduction="none", loss_mask=m), m)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    grads = []
    for fn in (step, compiled):
        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
        out = fn(hh, ww, mask)
        out.backward()
        grads.append((out.detach(), hh.grad.clone(), ww.grad.clone()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def _check_tp_masked(rank, world, dh_reduction):
    h, w, t = _problem("cpu", torch.float32, shape=(13,), V=192)
    mask = (torch.rand(13, generator=torch.Generator().manual_seed(5)) > 0.3).float()
    V_local = w.size(0) // world
    shard = w[rank * V_local:(rank + 1) * V_local].clone().requires_grad_(True)
    hh = h.clone().requires_grad_(True)
    loss = fusedloss.linear_cross_entropy(hh, shard, t, tp_group=dist.group.WORLD, reduction="none",
                                          loss_mask=mask, dhidden_reduction=dh_reduction,
                                          workspace_bytes=1)
    _megatron_reduction(loss, mask).backward()
    h64, w64 = h.double().requires_grad_(True), w.double().requires_grad_(True)
    _megatron_reduction(reference(h64, w64, t, reduction="none"), mask).backward()
    dh = hh.grad.clone()
    if dh_reduction == "partial":
        dist.all_reduce(dh)
    assert _rel(dh, h64.grad) <= 1e-5
    assert _rel(shard.grad, w64.grad[rank * V_local:(rank + 1) * V_local]) <= 1e-5


@pytest.mark.parametrize("dh_reduction", ["partial", "all_reduce"])
def test_gloo_tp(dh_reduction):
    run_world(2, _check_tp_masked, dh_reduction)


def _check_tp_mask_on_one_rank(rank, world):
    from test_vocab_parallel import _same_error_everywhere
    h, w, t = _problem("cpu", torch.float32, shape=(8,), V=64 * world)
    shard = w[rank * 64:(rank + 1) * 64].clone().requires_grad_()
    mask = torch.ones(8) if rank == 1 else None  # the modes' collectives would not pair
    _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(
        h, shard, t, tp_group=dist.group.WORLD, reduction="none", loss_mask=mask),
        "vocab-parallel options: rank 1's loss_mask=True differs from rank 0's loss_mask=False")
    # another mask on rank 1 would weight its gradients otherwise: compared with the targets
    mask = torch.ones(8)
    mask[3] = 0.0 if rank == 1 else 1.0
    _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(
        h, shard, t, tp_group=dist.group.WORLD, reduction="none", loss_mask=mask),
        "vocab-parallel targets: rank 1's differ from rank 0's (a checksum of their values, and "
        "of the loss_mask)")
    # a mask only rank 1 gets wrong: its error, on every rank
    bad = torch.ones(7) if rank == 1 else torch.ones(8)
    _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(
        h, shard, t, tp_group=dist.group.WORLD, reduction="none", loss_mask=bad),
        "vocab-parallel rank 1: loss_mask: got shape (7,), expected target's shape (8,)")
    # the same values in another layout and dtype on rank 1 alone (expanded, stride 0): agreed
    same = torch.ones(1, dtype=torch.bool).expand(8) if rank == 1 else torch.ones(8)
    loss = fusedloss.linear_cross_entropy(h, shard, t, tp_group=dist.group.WORLD, reduction="none",
                                          loss_mask=same)
    loss.sum().backward()
    mask[3] = 1.0  # equal masks agree, -0.0 and 0.0 too (one weight)
    mask[5] = -0.0 if rank == 1 else 0.0
    loss = fusedloss.linear_cross_entropy(h, shard, t, tp_group=dist.group.WORLD, reduction="none",
                                          loss_mask=mask)
    (loss * mask).sum().backward()


def test_gloo_tp_mask_on_one_rank_raises_everywhere():
    run_world(2, _check_tp_mask_on_one_rank)


def _check_tp_bad_upstream_on_one_rank(rank, world, dh_reduction, weight_only):
    # Rank 1 backwards loss.mean(), an upstream gradient that is not c * loss_mask: only its
    # backward can tell (the forward agreed). It raises; rank 0, already in the dhidden
    # all-reduce (or the token slices' reduce-scatter), gets NaN from it instead of waiting there
    # (run_world's timeout would fail it).
    h, w, t = _problem("cpu", torch.float32, shape=(8,), V=64 * world)
    shard = w[rank * 64:(rank + 1) * 64].clone().requires_grad_()
    hh = (h[rank * 4:(rank + 1) * 4] if dh_reduction == "reduce_scatter" else h).clone().requires_grad_()
    mask = torch.tensor([1.0, 0, 1, 1, 0, 1, 1, 1])
    loss = fusedloss.linear_cross_entropy(hh, shard, t, tp_group=dist.group.WORLD, reduction="none",
                                          loss_mask=mask, dhidden_reduction=dh_reduction)
    # weight_only: autograd skips what only the hidden gradient needs (the token slices' gather
    # node), yet every rank still meets in the dhidden collective
    inputs = [shard] if weight_only else None
    if rank == 1:
        with pytest.raises(ValueError, match=r"grad_loss\[1\]: got .* where row_weight\[1\]") as e:
            loss.mean().backward(inputs=inputs)
        if hasattr(e.value, "__notes__"):
            collective = dh_reduction.replace("_", "-")
            assert f"joined the dhidden {collective} with NaN" in e.value.__notes__[0]
    else:
        _megatron_reduction(loss, mask).backward(inputs=inputs)
        assert weight_only or torch.isnan(hh.grad).all()
    # the group still pairs its collectives: the next call agrees and runs on both ranks
    loss = fusedloss.linear_cross_entropy(h, shard.detach(), t, tp_group=dist.group.WORLD,
                                          reduction="sum")
    assert torch.isfinite(loss)


@pytest.mark.parametrize("dh_reduction, weight_only", [("all_reduce", False), ("all_reduce", True),
                                                       ("reduce_scatter", False),
                                                       ("reduce_scatter", True)])
def test_gloo_tp_bad_upstream_on_one_rank_does_not_hang(dh_reduction, weight_only):
    run_world(2, _check_tp_bad_upstream_on_one_rank, dh_reduction, weight_only, timeout_s=30)


def test_empty_batch(device):
    h, w, t = _problem(device, torch.bfloat16, shape=(0, 4))
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fusedloss.linear_cross_entropy(hh, ww, t, reduction="none", loss_mask=torch.ones(0, 4, device=device))
    assert loss.shape == (0, 4)
    loss.sum().backward()
    assert hh.grad.shape == h.shape and not ww.grad.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_grad_accumulator(device, dtype):
    # Megatron's main_grad under gradient-accumulation fusion: the masked in-forward gradient,
    # scaled, is added to the fp32 buffer; autograd gets zeros for the weight
    h, w, t = _problem(device, dtype, shape=(9, 4))
    mask = (torch.rand(9, 4, generator=torch.Generator().manual_seed(7)) > 0.3).float().to(device)
    main_grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(8)).to(device)
    before = main_grad.clone()
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fusedloss.linear_cross_entropy(hh, ww, t, reduction="none", loss_mask=mask,
                                          weight_grad_accumulator=main_grad)
    _megatron_reduction(loss, mask).backward()
    h64, w64 = h.double().cpu().requires_grad_(), w.double().cpu().requires_grad_()
    _megatron_reduction(reference(h64, w64, t.cpu(), reduction="none"), mask.cpu()).backward()
    tol = _TOL[dtype]
    assert _rel((main_grad - before).cpu(), w64.grad) <= tol
    assert _rel(hh.grad.cpu(), h64.grad) <= tol
    assert not ww.grad.any()


def test_runs_in_forward_is_the_ops_rule():
    # what a caller running the op's agreement in its place (the Megatron head) must predict:
    # the in-forward mode (a collective per token chunk, the mask read) or not
    from fusedloss.linear_cross_entropy import runs_in_forward
    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(16, 8, requires_grad=True)
    assert runs_in_forward("auto", h, w, 4, True)
    assert runs_in_forward("auto", h.bfloat16(), w.bfloat16(), 4, True)
    assert not runs_in_forward("auto", h, w, 4, False)  # per-row losses: recompute
    assert not runs_in_forward("recompute", h, w, 4, True)
    assert not runs_in_forward("auto", h.half(), w.half(), 4, True)  # fp16: recompute
    with torch.autocast("cpu", dtype=torch.float16):  # the op computes in autocast's dtype
        assert not runs_in_forward("auto", h, w, 4, True)
    assert not runs_in_forward("auto", h, w, 0, True)  # no rows to weight
    assert runs_in_forward("auto", h.detach(), w, 4, True)  # the weight alone wants a gradient
    assert not runs_in_forward("auto", h.detach(), w.detach(), 4, True)
    with torch.no_grad():
        assert not runs_in_forward("auto", h, w, 4, True)
