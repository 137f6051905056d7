"""fusedloss.linear_cross_entropy with an LM-head bias, against torch in float64:
F.linear(h, w, b) then the cross-entropy; loss and the hidden, weight and bias gradients, every
reduction, the options that read the biased logit, both backward modes over several chunks,
bias views, a bias without a gradient, bad biases, vocab-parallel over gloo."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusedloss
from dist_util import run_world
from test_linear_cross_entropy import reference_from_logits

_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _rel(a, b):
    return ((a.double().cpu() - b).norm() / b.norm().clamp(min=1e-30)).item()


def _problem(device, dtype, N=37, H=24, V=203, seed=0, ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * (2.0 / H ** 0.5)
    b = torch.randn(V, generator=g)
    t = torch.randint(0, V, (N,), generator=g)
    t[::5] = ignore_index
    return h.to(device, dtype), w.to(device, dtype), b.to(device, dtype), t.to(device)


def _reference(h, w, b, t, reduction, **options):
    """float64: torch's own cross-entropy where it has the options, the test module's reference
    over F.linear's logits where it does not (soft-cap, z-loss)."""
    x = F.linear(h, w, b)
    if not options.get("logit_softcap") and not options.get("z_loss"):
        return F.cross_entropy(x, t, reduction=reduction, ignore_index=options.get("ignore_index", -100),
                               label_smoothing=options.get("label_smoothing", 0.0))
    return reference_from_logits(x, t, t.shape, reduction=reduction, **options)


def _check(device, dtype, reduction, bias_view=None, mode="auto", workspace_bytes=3000, **options):
    h, w, b, t = _problem(device, dtype, ignore_index=options.get("ignore_index", -100))
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    bb = (b if bias_view is None else bias_view(b)).detach().requires_grad_()
    loss = fusedloss.linear_cross_entropy(hh, ww, t, bb, reduction=reduction, backward_mode=mode,
                                          workspace_bytes=workspace_bytes, **options)
    h64, w64, b64 = (x.detach().double().cpu().requires_grad_() for x in (h, w, bb))
    ref = _reference(h64, w64, b64, t.cpu(), reduction, **options)
    tol = _TOL[dtype]
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert _rel(loss.detach(), ref.detach()) <= tol
    g = torch.rand_like(loss) + 0.5
    loss.backward(g)
    ref.backward(g.double().cpu())
    for got, want, name in ((hh.grad, h64.grad, "hidden"), (ww.grad, w64.grad, "weight"),
                            (bb.grad, b64.grad, "bias")):
        assert got is not None and got.dtype == dtype, name
        assert _rel(got, want) <= 4 * tol, (name, _rel(got, want))
    return bb


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("mode", ["auto", "recompute"])
def test_matches_torch(device, dtype, reduction, mode):
    _check(device, dtype, reduction, mode=mode)


@pytest.mark.parametrize("options", [dict(logit_softcap=3.0), dict(label_smoothing=0.1),
                                     dict(z_loss=1e-3), dict(ignore_index=7),
                                     dict(logit_softcap=2.0, label_smoothing=0.1, z_loss=1e-3)])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_options_see_the_biased_logits(device, reduction, options):
    _check(device, torch.float32, reduction, **options)
    _check(device, torch.float32, reduction, mode="recompute", **options)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_biased_logit_is_rounded_once(device, dtype):
    # Large positive logits (Liger's init: torch.rand weight and bias, |z| ~ 10): a logit
    # rounded twice (h @ W^T to the dtype, then + bias to the dtype again) is 1 ulp off, which
    # moves the per-row losses by ~5e-2 and dhidden by 10x torch's own error; rounded once, as
    # F.linear rounds it, the losses equal those of float64 over the once-rounded logits.
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ())))
    N, H, V = 8, 512, 512
    w = torch.rand(V, H, generator=g).to(dtype)
    b = torch.rand(V, generator=g).to(dtype)
    h = torch.randn(N, H, generator=g).to(dtype)
    t = torch.randint(0, V, (N,), generator=g)
    got = fusedloss.linear_cross_entropy(h.to(device), w.to(device), t.to(device), b.to(device),
                                         reduction="none")
    z = F.linear(h.double(), w.double(), b.double()).to(dtype).double()  # rounded once
    want = F.cross_entropy(z, t, reduction="none")
    twice = F.cross_entropy((F.linear(h.double(), w.double()).to(dtype).double() + b.double())
                            .to(dtype).double(), t, reduction="none")
    err = (got.double().cpu() - want).abs()
    # the GEMM's fp32 sum may round a logit that sits within an fp32 ulp of a tie the other way
    # from float64's: a few such logits, never the 1-ulp shift of every one
    assert err.mean().item() <= 1e-2 * (twice - want).abs().mean().item() + 1e-5, (
        err.mean().item(), (twice - want).abs().mean().item())


def test_loss_mask_and_one_chunk(device):
    # the row-weighted in-forward gradients (loss_mask), and one chunk of every token
    h, w, b, t = _problem(device, torch.float32)
    mask = (torch.arange(t.numel(), device=device) % 3 != 0).float()
    hh, ww, bb = (x.clone().requires_grad_() for x in (h, w, b))
    loss = fusedloss.linear_cross_entropy(hh, ww, t, bias=bb, reduction="none", loss_mask=mask,
                                          workspace_bytes=2000)
    (loss * mask).sum().div(7.0).backward()
    h64, w64, b64 = (x.double().cpu().requires_grad_() for x in (h, w, b))
    ref = F.cross_entropy(F.linear(h64, w64, b64), t.cpu(), reduction="none")
    assert _rel(loss.detach(), ref.detach()) <= 1e-5
    (ref * mask.double().cpu()).sum().div(7.0).backward()
    for got, want in ((hh.grad, h64.grad), (ww.grad, w64.grad), (bb.grad, b64.grad)):
        assert _rel(got, want) <= 4e-5
    _check(device, torch.float32, "mean", workspace_bytes=None)


@pytest.mark.parametrize("view", ["sliced", "expanded", "strided"])
def test_bias_views_read_never_written(device, view):
    V = 203
    make = {"sliced": lambda b: torch.cat([b, b])[V:],                      # offset storage
            "expanded": lambda b: b[:1].expand(V),                           # stride 0
            "strided": lambda b: torch.stack([b, -b], 1)[:, 0]}[view]        # stride 2
    h, w, b, t = _problem(device, torch.float32)
    bv = make(b)
    before = bv.clone()
    loss = fusedloss.linear_cross_entropy(h, w, t, bv, reduction="sum", workspace_bytes=3000)
    ref = F.cross_entropy(F.linear(h.double(), w.double(), bv.double()), t, reduction="sum")
    assert _rel(loss, ref.cpu()) <= 1e-5
    assert torch.equal(bv, before)
    _check(device, torch.float32, "mean", bias_view=make)


def test_bias_without_grad(device, monkeypatch):
    # the loss sees it; no bias gradient is computed or returned
    h, w, b, t = _problem(device, torch.float32)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    for mode in ("auto", "recompute"):
        loss = fusedloss.linear_cross_entropy(hh, ww, t, b, backward_mode=mode, workspace_bytes=3000)
        ref = F.cross_entropy(F.linear(h.double(), w.double(), b.double()), t)
        assert _rel(loss.detach(), ref.cpu()) <= 1e-5
        loss.backward()
        assert b.grad is None and hh.grad is not None
    # only the bias needs a gradient: it still gets one
    bb = b.clone().requires_grad_()
    fusedloss.linear_cross_entropy(h, w, t, bb, workspace_bytes=3000).backward()
    b64 = b.double().cpu().requires_grad_()
    F.cross_entropy(F.linear(h.double().cpu(), w.double().cpu(), b64), t.cpu()).backward()
    assert _rel(bb.grad, b64.grad) <= 4e-5


def test_none_is_todays_op_bit_for_bit(device):
    h, w, b, t = _problem(device, torch.bfloat16)
    for reduction in ("none", "mean"):
        a = fusedloss.linear_cross_entropy(h, w, t, reduction=reduction)
        c = fusedloss.linear_cross_entropy(h, w, t, None, reduction=reduction)
        assert torch.equal(a, c)
        zero = fusedloss.linear_cross_entropy(h, w, t, torch.zeros_like(b), reduction=reduction)
        assert torch.equal(a, zero)  # + 0 leaves every stored logit as it was


def test_compiled_matches_eager(device):
    h, w, b, t = _problem(device, torch.float32)

    def step(hh, ww, bb):
        return fusedloss.linear_cross_entropy(hh, ww, t, bb, reduction="sum", workspace_bytes=3000)

    grads = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        leaves = [x.clone().requires_grad_() for x in (h, w, b)]
        fn(*leaves).backward()
        grads.append([x.grad for x in leaves])
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


def test_bad_bias(device):
    h, w, b, t = _problem(device, torch.float32)
    with pytest.raises(ValueError, match=r"bias: got shape \(202,\), expected \[203\]"):
        fusedloss.linear_cross_entropy(h, w, t, b[:-1])
    with pytest.raises(ValueError, match=r"bias: got shape \(1, 203\), expected \[203\]"):
        fusedloss.linear_cross_entropy(h, w, t, b[None])
    with pytest.raises(ValueError, match="bias.dtype: got torch.bfloat16, expected torch.float32"):
        fusedloss.linear_cross_entropy(h, w, t, b.bfloat16())
    with pytest.raises(ValueError, match="bias.dtype: got torch.float64"):
        fusedloss.linear_cross_entropy(h, w, t, b.double())
    with pytest.raises((ValueError, TypeError), match="bias"):
        fusedloss.linear_cross_entropy(h, w, t, [0.0] * 203)
    if torch.cuda.is_available():
        other = b.cpu() if device == "cuda" else b.cuda()
        with pytest.raises(ValueError, match="bias"):
            fusedloss.linear_cross_entropy(h, w, t, other)


# ---- vocab-parallel over gloo ----

def _check_tp(rank, world, reduction, options, dh_reduction):
    slices = dh_reduction == "reduce_scatter"
    N, V = 4 * world, 64 * world
    h, w, b, t = _problem("cpu", torch.float32, N=N, V=V)
    V_local = V // world
    own = slice(rank * V_local, (rank + 1) * V_local)
    mine = slice(rank * 4, (rank + 1) * 4) if slices else slice(None)
    hh = h[mine].clone().requires_grad_()
    ww, bb = w[own].clone().requires_grad_(), b[own].clone().requires_grad_()
    loss = fusedloss.linear_cross_entropy(hh, ww, t, bb, tp_group=dist.group.WORLD,
                                          reduction=reduction, dhidden_reduction=dh_reduction,
                                          workspace_bytes=2000, **options)
    one = [x.clone().requires_grad_() for x in (h, w, b)]  # TP = 1, the same op
    whole = fusedloss.linear_cross_entropy(*one[:2], t, one[2], reduction=reduction,
                                           workspace_bytes=2000, **options)
    torch.testing.assert_close(loss, whole, rtol=1e-5, atol=1e-6)
    h64, w64, b64 = (x.double().requires_grad_() for x in (h, w, b))
    ref = _reference(h64, w64, b64, t, reduction,
                     **{k: v for k, v in options.items() if k != "backward_mode"})
    assert _rel(loss.detach(), ref.detach()) <= 1e-5
    g = torch.rand_like(loss) + 0.5
    dist.broadcast(g, 0)
    loss.backward(g)
    whole.backward(g)
    ref.backward(g.double())
    dh = hh.grad.clone()
    if dh_reduction == "partial":
        dist.all_reduce(dh)
    torch.testing.assert_close(dh, one[0].grad[mine], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ww.grad, one[1].grad[own], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(bb.grad, one[2].grad[own], rtol=1e-4, atol=1e-6)  # its own shard
    assert _rel(bb.grad, b64.grad[own]) <= 4e-5


@pytest.mark.parametrize("reduction, options, dh_reduction", [
    ("mean", {}, "partial"), ("none", dict(label_smoothing=0.1), "all_reduce"),
    ("sum", dict(logit_softcap=3.0, backward_mode="recompute"), "partial"),
    ("mean", dict(z_loss=1e-3), "reduce_scatter"),
    ("sum", dict(backward_mode="recompute"), "reduce_scatter")])
def test_gloo_tp_equals_tp1(reduction, options, dh_reduction):
    run_world(2, _check_tp, reduction, options, dh_reduction)


def _check_tp_bias_on_one_rank(rank, world, mode):
    from test_vocab_parallel import _same_error_everywhere
    h, w, b, t = _problem("cpu", torch.float32, N=8, V=64 * world)
    own = slice(rank * 64, (rank + 1) * 64)
    bias = b[own] if rank == 0 else None
    _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(
        h.clone().requires_grad_(), w[own], t, bias, tp_group=dist.group.WORLD, backward_mode=mode),
        "rank 1's bias=False differs from rank 0's bias=True")


@pytest.mark.parametrize("mode", ["auto", "recompute"])
def test_gloo_tp_bias_on_one_rank_raises_everywhere(mode):
    run_world(2, _check_tp_bias_on_one_rank, mode, timeout_s=30)


def _check_tp_bad_bias_on_one_rank(rank, world):
    from test_vocab_parallel import _same_error_everywhere
    h, w, b, t = _problem("cpu", torch.float32, N=8, V=64 * world)
    own = slice(rank * 64, (rank + 1) * 64)
    bias = b[own] if rank == 0 else b[own][:-1]  # rank 1 alone passes a bias one short
    _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(
        h.clone().requires_grad_(), w[own], t, bias, tp_group=dist.group.WORLD), "bias")


def test_gloo_tp_bad_bias_on_one_rank_raises_everywhere():
    run_world(2, _check_tp_bad_bias_on_one_rank, timeout_s=30)
