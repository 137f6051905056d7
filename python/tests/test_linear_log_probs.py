"""fusedloss.linear_log_probs against float64 torch (log_softmax at a temperature, gathered;
entropy; arg-max): values, gradients of log_probs and entropy together, masking, chunking,
layouts, no_grad, gloo TP 2 and 4 (vocab- and sequence-parallel), bad inputs."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusedloss
from dist_util import run_world

_TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def reference(h, w, t, temperature=1.0, ignore_index=-100):
    """Float64 (log_probs, entropy, argmax) of the rows of h [N, H] against w [V, H]; ignored
    rows give 0 and 0."""
    y = (h.reshape(-1, h.size(-1)) @ w.t()) / temperature
    logp = torch.log_softmax(y, -1)
    t = t.reshape(-1)
    keep = t != ignore_index
    lp = logp.gather(1, torch.where(keep, t, 0)[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros_like(lp)
    return torch.where(keep, lp, zero), torch.where(keep, ent, zero), y.argmax(-1)


def _problem(device, dtype, shape=(37,), H=24, V=203, scale=2.0):
    h = torch.randn(*shape, H)
    w = torch.randn(V, H) * (scale / H ** 0.5)
    t = torch.randint(0, V, shape)
    return h.to(device, dtype), w.to(device, dtype), t.to(device)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _check(device, dtype, shape=(37,), V=203, temperature=1.0, workspace_bytes=None, mask=False):
    h, w, t = _problem(device, dtype, shape=shape, V=V)
    loss_mask = (torch.rand(t.shape, device=device) > 0.3) if mask else None
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = fusedloss.linear_log_probs(hh, ww, t, temperature=temperature, argmax=True,
                                     loss_mask=loss_mask, workspace_bytes=workspace_bytes)
    assert out.log_probs.shape == t.shape and out.entropy.shape == t.shape
    assert out.log_probs.dtype == out.entropy.dtype == torch.float32 and out.argmax.dtype == torch.int64
    a, b = torch.randn(t.shape, device=device), torch.randn(t.shape, device=device)
    (a * out.log_probs + b * out.entropy).sum().backward()

    h64, w64 = h.double().cpu().requires_grad_(), w.double().cpu().requires_grad_()
    tr = t.cpu() if loss_mask is None else torch.where(loss_mask.cpu(), t.cpu(), -100)
    lp, ent, am = reference(h64, w64, tr, temperature)
    (a.double().cpu().reshape(-1) * lp + b.double().cpu().reshape(-1) * ent).sum().backward()
    tol = _TOL[dtype]
    torch.testing.assert_close(out.log_probs.cpu().double().reshape(-1), lp.detach(),
                               rtol=tol, atol=tol * 10)
    torch.testing.assert_close(out.entropy.cpu().double().reshape(-1), ent.detach(),
                               rtol=tol, atol=tol * 10)
    if dtype == torch.float32:  # 16-bit logits may tie or swap near-equal maxima
        assert torch.equal(out.argmax.cpu().reshape(-1), am)
    assert hh.grad.dtype == dtype and ww.grad.dtype == dtype
    assert _rel(hh.grad.cpu(), h64.grad) <= tol * 2 and _rel(ww.grad.cpu(), w64.grad) <= tol * 2
    if mask:
        assert not out.log_probs[~loss_mask].any() and not out.entropy[~loss_mask].any()
        assert not hh.grad[~loss_mask].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_against_float64(device, dtype, temperature):
    _check(device, dtype, temperature=temperature)


@pytest.mark.parametrize("H, V", [(1, 203), (7, 203), (257, 50257), (1023, 4099)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_odd_and_unaligned_hidden_sizes_as_exact_as_torch(device, H, V, dtype):
    # rows of H elements off every 16-byte boundary (the GEMMs' operands and dhidden): each
    # gradient against float64 within torch's own error in the same dtype on the same device
    # (its linear, then log_softmax in fp32, as RL trainers compute log-probs), at temperature 0.7
    n = 96 if device == "cuda" else 24
    h, w, t = _problem(device, dtype, shape=(n,), H=H, V=V)
    a, b = torch.randn(n, device=device), torch.randn(n, device=device)

    def grads(fn):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = fn(hh, ww)
        (a * lp + b * ent).sum().backward()
        return hh.grad, ww.grad

    def torchs(hh, ww):
        logp = torch.log_softmax(F.linear(hh, ww).float() / 0.7, -1)
        return logp.gather(1, t[:, None])[:, 0], -(logp.exp() * logp).sum(-1)

    ours = grads(lambda hh, ww: fusedloss.linear_log_probs(hh, ww, t, temperature=0.7)[:2])
    theirs = grads(torchs)
    h64, w64 = h.double().cpu().requires_grad_(), w.double().cpu().requires_grad_()
    lp, ent, _ = reference(h64, w64, t.cpu(), 0.7)
    (a.double().cpu() * lp + b.double().cpu() * ent).sum().backward()
    for name, o, th, r in zip(("dhidden", "dweight"), ours, theirs, (h64.grad, w64.grad)):
        err, torch_err = _rel(o.cpu(), r), _rel(th.cpu(), r)
        assert err <= 1.5 * torch_err + _TOL[dtype] / 10, (name, err, torch_err)


@pytest.mark.parametrize("shape", [(37,), (5, 3), (1,)])
def test_chunks_and_layouts(device, shape):
    # 2 x 3 tokens' logits a chunk: many chunks, and the [s, b, H] form
    _check(device, torch.float32, shape=shape, workspace_bytes=2 * 3 * 208 * 4)


def test_loss_mask_and_ignore_index(device):
    _check(device, torch.float32, mask=True)
    h, w, t = _problem(device, torch.float32)
    t[::3] = -7
    hh = h.clone().requires_grad_()
    out = fusedloss.linear_log_probs(hh, w, t, ignore_index=-7)
    (out.log_probs + out.entropy).sum().backward()
    assert not out.log_probs[::3].any() and not hh.grad[::3].any() and hh.grad[1::3].any()


def test_views_give_the_contiguous_bits(device):
    h, w, t = _problem(device, torch.float32, shape=(12,), H=16, V=40)
    want = fusedloss.linear_log_probs(h, w, t, argmax=True)
    ht = h.t().contiguous().t()  # transposed storage
    wt = torch.cat([w, w], 1)[:, :16]  # a row stride of 32
    got = fusedloss.linear_log_probs(ht, wt, t.to(torch.int32), argmax=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_argmax_ties_take_the_smallest_id(device):
    h, w, t = _problem(device, torch.float32, shape=(6,), H=8, V=10)
    w[7] = w[3]  # columns 3 and 7 equal everywhere
    w[3] *= 0
    w[7] *= 0
    h[:] = 0  # every logit 0: the whole row ties
    out = fusedloss.linear_log_probs(h, w, t, argmax=True)
    assert torch.equal(out.argmax.cpu(), torch.zeros(6, dtype=torch.int64))
    assert torch.allclose(out.entropy, torch.full_like(out.entropy, float(torch.log(torch.tensor(10.0)))))


def test_options_select_outputs_and_no_grad_keeps_nothing(device):
    h, w, t = _problem(device, torch.float32)
    out = fusedloss.linear_log_probs(h, w, t, entropy=False)
    assert out.entropy is None and out.argmax is None
    hh = h.clone().requires_grad_()
    with torch.no_grad():
        out = fusedloss.linear_log_probs(hh, w, t)
    assert out.log_probs.grad_fn is None
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        out = fusedloss.linear_log_probs(hh, w, t)
    assert len(saved) == 5 and out.log_probs.grad_fn is not None  # inputs, tokens, lse, entropy
    # only one of the two differentiated: the other's upstream gradient is zero
    out.log_probs.sum().backward()
    h64 = h.double().cpu().requires_grad_()
    reference(h64, w.double().cpu(), t.cpu())[0].sum().backward()
    assert _rel(hh.grad.cpu(), h64.grad) <= 1e-4


def test_autocast_runs_the_gemms_in_its_dtype(device):
    h, w, t = _problem(device, torch.float32)
    with torch.autocast(h.device.type, dtype=torch.bfloat16):
        got = fusedloss.linear_log_probs(h, w, t)
    want = fusedloss.linear_log_probs(h.bfloat16(), w.bfloat16(), t)
    assert torch.equal(got.log_probs, want.log_probs)


def test_bad_inputs(device):
    h, w, t = _problem(device, torch.float32)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature: got"):
            fusedloss.linear_log_probs(h, w, t, temperature=bad)
    with pytest.raises(ValueError, match=r"weight: got shape \(203, 23\), expected \[V_local, 24\]"):
        fusedloss.linear_log_probs(h, w[:, :23], t)
    with pytest.raises(ValueError, match="weight.dtype: got torch.bfloat16, expected torch.float32"):
        fusedloss.linear_log_probs(h, w.bfloat16(), t)
    with pytest.raises(ValueError, match="tokens: got shape"):
        fusedloss.linear_log_probs(h, w, t[:-1])
    with pytest.raises(ValueError, match="loss_mask: got shape"):
        fusedloss.linear_log_probs(h, w, t, loss_mask=t[:-1])
    with pytest.raises(ValueError, match="dhidden_reduction: got 'scatter'"):
        fusedloss.linear_log_probs(h, w, t, dhidden_reduction="scatter")
    with pytest.raises(TypeError, match="entropy"):
        fusedloss.linear_log_probs(h, w, t, entropy="yes")


@pytest.mark.parametrize("bad", [203, -7])
def test_an_out_of_range_token_is_named_with_its_index_and_value(device, bad):
    # the CPU raises at the call; CUDA checks tokens in flight (no host sync): the row's log-prob
    # and entropy are NaN, the others right, and check_device_errors() names the token
    h, w, t = _problem(device, torch.float32)
    t[5] = bad
    named = rf"tokens\[5\]: got {bad}, expected in \[0, "
    if device == "cpu":
        with pytest.raises(ValueError, match=named + r"203\)"):
            fusedloss.linear_log_probs(h, w, t)
        return
    fusedloss.check_device_errors()  # nothing pending from earlier tests
    out = fusedloss.linear_log_probs(h, w, t, entropy=True)
    with pytest.raises(ValueError, match=named + r"vocab_global\) or ignore_index.*log-prob head"):
        fusedloss.check_device_errors()
    fusedloss.check_device_errors()  # cleared once reported
    assert out.log_probs[5].isnan() and out.entropy[5].isnan()
    rest = torch.arange(t.numel(), device=device) != 5
    assert out.log_probs[rest].isfinite().all() and out.entropy[rest].isfinite().all()


def test_cpp_api_merges_shards_like_one_call():
    """linear_log_probs_local_stats of each vocabulary shard, then log_probs_merge, give the
    unsharded results (the C++ split a trainer with its own collective uses)."""
    from fusedloss import _C
    from fusedloss._views import device_of, index, matrix
    h, w, t = _problem("cpu", torch.float32, shape=(9,), H=8, V=12)
    t[2] = -100
    _, tv = index(t, "tokens")
    n, world, V = 9, 3, 12
    stats = torch.empty(world * n * _C.LOG_PROB_STATS_BYTES, dtype=torch.uint8)
    for r in range(world):
        o = _C.LinearLogProbsOptions()
        o.vocab_start, o.vocab_global = r * V // world, V
        shard = w[r * V // world:(r + 1) * V // world]
        part = stats.narrow(0, r * n * _C.LOG_PROB_STATS_BYTES, n * _C.LOG_PROB_STATS_BYTES)
        _C.linear_log_probs_local_stats(matrix(h), matrix(shard), tv, o, part.data_ptr(), 0)
    o = _C.LinearLogProbsOptions()
    o.vocab_global = V
    lp, ent, lse = torch.empty(n), torch.empty(n), torch.empty(n)
    am = torch.empty(n, dtype=torch.int64)
    _C.log_probs_merge(stats.data_ptr(), world, n, tv, o, lp.data_ptr(), ent.data_ptr(),
                       am.data_ptr(), lse.data_ptr(), device_of(h), 0)
    want = fusedloss.linear_log_probs(h, w, t, argmax=True)
    torch.testing.assert_close(lp, want.log_probs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent, want.entropy, rtol=1e-6, atol=1e-6)
    assert torch.equal(am, want.argmax)
    with pytest.raises(ValueError, match="world: got 0"):
        _C.log_probs_merge(stats.data_ptr(), 0, n, tv, o, 0, 0, 0, lse.data_ptr(), device_of(h), 0)


def _tp(rank, world, dh_reduction):
    torch.manual_seed(1234)  # the same problem on every rank
    slices = dh_reduction == "reduce_scatter"
    h, w, t = _problem("cpu", torch.float32, shape=(3 * world, 2) if slices else (13,), V=48)
    V_local = w.size(0) // world
    shard = w[rank * V_local:(rank + 1) * V_local].clone().requires_grad_()
    mine = slice(rank * 3, (rank + 1) * 3) if slices else slice(None)
    hh = h[mine].clone().requires_grad_()
    out = fusedloss.linear_log_probs(hh, shard, t, temperature=0.8, argmax=True,
                                     tp_group=dist.group.WORLD, dhidden_reduction=dh_reduction)
    a, b = torch.randn(t.shape), torch.randn(t.shape)  # (seeded alike on every rank)
    (a * out.log_probs + b * out.entropy).sum().backward()
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    lp, ent, am = reference(h64, w64, t, 0.8)
    (a.double().reshape(-1) * lp + b.double().reshape(-1) * ent).sum().backward()
    torch.testing.assert_close(out.log_probs.double().reshape(-1), lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy.double().reshape(-1), ent.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(out.argmax.reshape(-1), am)
    every = [torch.empty_like(out.log_probs) for _ in range(world)]
    dist.all_gather(every, out.log_probs.contiguous())
    assert all(torch.equal(e, every[0]) for e in every)  # the same bits on every rank
    assert _rel(shard.grad, w64.grad[rank * V_local:(rank + 1) * V_local]) <= 1e-4
    dh = hh.grad.clone()
    if dh_reduction == "partial":
        dist.all_reduce(dh)
    assert _rel(dh, h64.grad[mine]) <= 1e-4


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dh_reduction", ["partial", "all_reduce", "reduce_scatter"])
def test_gloo_tp(world, dh_reduction):
    run_world(world, _tp, dh_reduction)


def _tp_disagreement(rank, world):
    h, w, t = _problem("cpu", torch.float32, shape=(6,), V=8)
    with pytest.raises(ValueError, match="temperature"):
        fusedloss.linear_log_probs(h, w, t, temperature=1.0 + rank, tp_group=dist.group.WORLD)


def test_gloo_tp_disagreement_raises_on_every_rank():
    run_world(2, _tp_disagreement)


def _tp_one_rank_wrong(rank, world):
    h, w, t = _problem("cpu", torch.float32, shape=(6,), V=8)
    bad = {"temperature": -1.0} if rank == 1 else {}
    with pytest.raises(ValueError, match="rank 1: temperature: got -1.0"):
        fusedloss.linear_log_probs(h, w, t, tp_group=dist.group.WORLD, **bad)
    t_bad = t.clone()
    if rank == 0:
        t_bad[0] = 99  # beyond every rank's shard
    with pytest.raises(ValueError, match=r"rank 0: tokens\[0\]: got 99, expected in \[0, 16\)"):
        fusedloss.linear_log_probs(h, w, t_bad, tp_group=dist.group.WORLD)


def test_gloo_tp_one_rank_wrong_raises_on_every_rank():
    run_world(2, _tp_one_rank_wrong)


def test_compile_fullgraph_matches_eager(device):
    h, w, t = _problem(device, torch.float32)
    op = torch.compile(lambda h, w, t: fusedloss.linear_log_probs(h, w, t, temperature=0.9),
                       fullgraph=True)

    def run(fn):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(hh, ww, t)
        (out.log_probs * 0.5 - out.entropy).sum().backward()
        return out.log_probs, out.entropy, hh.grad, ww.grad

    for got, want in zip(run(op), run(lambda h, w, t: fusedloss.linear_log_probs(h, w, t, temperature=0.9))):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_second_order_gradient_raises(device):
    h, w, t = _problem(device, torch.float32)
    hh = h.clone().requires_grad_()
    out = fusedloss.linear_log_probs(hh, w, t)
    (g,) = torch.autograd.grad(out.log_probs.sum(), hh, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()


def test_grpo_example_matches_torch():
    """examples/grpo_step.py: the GRPO step's loss and every gradient with the fused head equal
    the torch head's (it exits non-zero otherwise)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, os.path.join(root, "examples", "grpo_step.py"), "--vocab",
                           "500", "--hidden", "32", "--seq", "48", "--group", "4"],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "loss: torch" in done.stdout and "fusedloss" in done.stdout


def _tp_compiled(rank, world):
    torch.manual_seed(1234)
    h, w, t = _problem("cpu", torch.float32, shape=(10,), V=16)
    V_local = w.size(0) // world
    shard = w[rank * V_local:(rank + 1) * V_local]

    def head(h, w, t, temperature):
        return fusedloss.linear_log_probs(h, w, t, temperature=temperature,
                                          tp_group=dist.group.WORLD)

    compiled = torch.compile(head, fullgraph=True)
    got, want = compiled(h, shard, t, 0.9), head(h, shard, t, 0.9)
    torch.testing.assert_close(got.log_probs, want.log_probs, rtol=1e-6, atol=1e-6)
    # a rank alone with other options: the agreement inside the op raises on every rank
    with pytest.raises(ValueError, match="temperature"):
        compiled(h, shard, t, 0.9 if rank == 0 else 1.3)


def test_gloo_tp_compiled_agrees_inside_the_graph():
    run_world(2, _tp_compiled)
