"""fusedloss.linear_cross_entropy against float64 torch (F.linear + the cross-entropy written
from its definition): every option, both backward modes, chunking, layouts, torch.compile,
gloo TP 2 and 4, bad inputs."""
import contextlib
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusedloss
from dist_util import run_world
from test_cross_entropy import weighted_reference


def reference(h, w, t, *, smoothing_scope="global", workspace_bytes=None, backward_mode=None,
              dweight_accumulation=None, inplace_backward=None, ignore_index=-100, label_smoothing=0.0, smoothing_formula="pytorch",
              reduction="mean", z_loss=0.0, logit_softcap=None):
    """Float64 loss of hidden/weight leaves (gradients through autograd); at TP=1 the partition
    smoothing scope is the global one."""
    x = torch.nn.functional.linear(h.reshape(-1, h.size(-1)), w)
    return reference_from_logits(x, t, h.shape[:-1], ignore_index=ignore_index,
                                 label_smoothing=label_smoothing, smoothing_formula=smoothing_formula,
                                 reduction=reduction, z_loss=z_loss, logit_softcap=logit_softcap)


def reference_from_logits(x, t, shape, *, ignore_index=-100, label_smoothing=0.0,
                          smoothing_formula="pytorch", reduction="mean", z_loss=0.0, logit_softcap=None):
    """The loss of `reference` over its logits x [N, V] (before the softcap)."""
    if logit_softcap:
        x = logit_softcap * torch.tanh(x / logit_softcap)
    t = t.reshape(-1)
    V = x.size(1)
    a = label_smoothing
    if smoothing_formula == "megatron" and a > 0:
        a = a * V / (V - 1)
    lse = torch.logsumexp(x, -1)
    valid = t != ignore_index
    zt = x.gather(1, torch.where(valid, t, 0)[:, None])[:, 0]
    row = (1 - a) * (lse - zt) + a * (lse - x.mean(-1)) + z_loss * lse * lse
    row = torch.where(valid, row, torch.zeros_like(row))
    if reduction == "none":
        return row.view(shape)
    if reduction == "sum":
        return row.sum()
    return row.sum() / valid.sum().clamp(min=1)


_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _problem(device, dtype, shape=(37,), H=24, V=203, ignore_index=-100, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, H, generator=g)
    w = torch.randn(V, H, generator=g) * (2.0 / H ** 0.5)
    t = torch.randint(0, V, shape, generator=g)
    t.view(-1)[::5] = ignore_index
    return h.to(device, dtype), w.to(device, dtype), t.to(device)


def _check(device, dtype, *, shape=(37,), V=203, upstream=None, weight_view=None, **options):
    h, w, t = _problem(device, dtype, shape=shape, V=V, ignore_index=options.get("ignore_index", -100))
    hh = h.clone().requires_grad_(True)
    ww = (w if weight_view is None else weight_view(w)).detach().requires_grad_(True)
    loss = fusedloss.linear_cross_entropy(hh, ww, t, **options)
    ref_opts = {k: v for k, v in options.items()
                if k not in ("workspace_bytes", "backward_mode", "dweight_accumulation", "inplace_backward")}
    h64 = h.double().cpu().requires_grad_(True)
    w64 = ww.detach().double().cpu().requires_grad_(True)
    ref = reference(h64, w64, t.cpu(), **ref_opts)
    assert loss.shape == ref.shape and loss.dtype == torch.float32
    tol = _TOL[dtype]
    assert _rel(loss.detach().cpu(), ref.detach()) <= max(tol, 1e-5), (loss, ref)
    g = upstream(loss) if upstream else torch.rand_like(loss) + 0.5
    loss.backward(g)
    ref.backward(g.double().cpu())
    assert hh.grad.dtype == dtype and ww.grad.dtype == dtype
    assert hh.grad.shape == hh.shape and ww.grad.shape == ww.shape
    assert _rel(hh.grad.cpu(), h64.grad) <= tol
    assert _rel(ww.grad.cpu(), w64.grad) <= tol
    return loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduction, mode", [("mean", "auto"), ("sum", "auto"), ("mean", "recompute"),
                                             ("sum", "in_forward"), ("none", "auto")])
def test_matches_float64(device, dtype, reduction, mode):
    if dtype == torch.float16 and mode == "in_forward":  # refused: see the test below
        with pytest.raises(ValueError, match="backward_mode: got 'in_forward' with torch.float16 inputs"):
            _check(device, dtype, reduction=reduction, backward_mode=mode, shape=(9, 4))
        return
    _check(device, dtype, reduction=reduction, backward_mode=mode, shape=(9, 4))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fp16_gradients_keep_what_loss_scaling_keeps(device, reduction):
    # In fp16 the unit gradient of a mean over many tokens and a large vocabulary (p / N, ~1e-7
    # here) lies below fp16's range; a loss scale S lifts the real gradient S p / N into it.
    # "auto" must take the mode whose gradient meets S before fp16 stores it (recompute), and
    # be as exact as torch's fp16 linear + cross-entropy under the same scale.
    N, H, V, S = 1024, 16, 4096, 1024.0
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(N, H, generator=g) * 0.1).half().to(device)
    w = (torch.randn(V, H, generator=g) * 0.1).half().to(device)
    t = torch.randint(0, V, (N,), generator=g).to(device)
    h64, w64 = h.double().cpu().requires_grad_(), w.double().cpu().requires_grad_()
    reference(h64, w64, t.cpu(), reduction=reduction).backward()

    def error(loss_fn):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        (loss_fn(hh, ww) * S).backward()
        return max(_rel(hh.grad.float().cpu() / S, h64.grad), _rel(ww.grad.float().cpu() / S, w64.grad))

    if device == "cpu":  # torch's fp16 matmul on the CPU: compute it as the GPU would, fp32 math
        torch_loss = lambda hh, ww: F.cross_entropy((hh.float() @ ww.float().t()).half().float(), t,
                                                    reduction=reduction)
    else:
        torch_loss = lambda hh, ww: F.cross_entropy(F.linear(hh, ww).float(), t, reduction=reduction)
    ours = error(lambda hh, ww: fusedloss.linear_cross_entropy(hh, ww, t, reduction=reduction))
    assert ours <= 2 * error(torch_loss) + 1e-4, ours


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("options", [
    dict(label_smoothing=0.1), dict(label_smoothing=0.2, smoothing_formula="megatron"),
    dict(label_smoothing=0.1, smoothing_scope="partition"), dict(z_loss=1e-3),
    dict(logit_softcap=2.0), dict(logit_softcap=30.0, z_loss=1e-4, label_smoothing=0.05),
    dict(ignore_index=3), dict(workspace_bytes=2 * 3 * 208 * 4),  # 5 tokens per chunk
])
def test_every_option(device, reduction, options):
    _check(device, torch.float32, reduction=reduction, **options)


def test_chunk_of_one_token_and_odd_vocab(device):
    _check(device, torch.bfloat16, V=17, workspace_bytes=1, shape=(11,))
    _check(device, torch.float32, V=1, shape=(5,), reduction="none")


@pytest.mark.parametrize("knob, value", [
    ("FUSEDLOSS_LCE_BUFFERS", "1"), ("FUSEDLOSS_LCE_DHIDDEN", "group"),
    ("FUSEDLOSS_LCE_SIDE_STREAM", "0"), ("FUSEDLOSS_LCE_GEMM_ALGOS", "4"),
    ("FUSEDLOSS_LCE_TIMING", "1"), ("FUSEDLOSS_LCE_CE_ROWS", "3"), ("FUSEDLOSS_LCE_DH_PIECES", "3")])
@pytest.mark.parametrize("reduction, mode", [("mean", "in_forward"), ("none", "recompute")])
def test_pipeline_variants(device, monkeypatch, knob, value, reduction, mode):
    # the chunk pipeline's variants (src/core/lce_tuning.h), read at every call, over many
    # chunks; the phase times fill only when asked, and only on CUDA
    monkeypatch.setenv("FUSEDLOSS_LCE_BUFFERS", "2")  # the overlap and DHIDDEN=group run there
    monkeypatch.setenv(knob, value)
    fusedloss._C.linear_cross_entropy_phase_times(True)
    _check(device, torch.bfloat16, reduction=reduction, backward_mode=mode, shape=(45,),
           workspace_bytes=2 * 4 * 208 * 2)  # 3 tokens per chunk at 2 buffers, 7 at 1
    t = fusedloss._C.linear_cross_entropy_phase_times(True)
    timed = device == "cuda" and knob == "FUSEDLOSS_LCE_TIMING"
    loops = 1 if mode == "in_forward" else 2  # in_forward's backward only scales
    assert (t["loops"] >= loops and t["logits_ms"] > 0 and t["dweight_ms"] > 0) if timed else t["loops"] == 0


@pytest.mark.parametrize("knob, value", [("FUSEDLOSS_LCE_BUFFERS", "4"),
                                         ("FUSEDLOSS_LCE_GEMM_ALGOS", "many")])
def test_pipeline_variant_refused(device, monkeypatch, knob, value):
    monkeypatch.setenv(knob, value)
    h, w, t = _problem(device, torch.float32)
    with pytest.raises(ValueError, match=f"{knob}: got \"{value}\", expected"):
        fusedloss.linear_cross_entropy(h, w, t)


def test_layouts(device):
    # a weight slice with a row stride, a transposed weight (copied), expanded hidden rows
    _check(device, torch.float32, weight_view=lambda w: torch.cat([w, w], 1)[:, : w.size(1)])
    _check(device, torch.float32, weight_view=lambda w: w.t().contiguous().t())
    h, w, t = _problem(device, torch.float32, shape=(6,))
    hh = h[:1].expand(6, -1).requires_grad_(False)
    loss = fusedloss.linear_cross_entropy(hh, w, t)
    ref = reference(hh.double().cpu(), w.double().cpu(), t.cpu())
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())


def test_upstream_gradients(device):
    # in_forward: the saved unit gradients scaled by a non-unit scalar
    _check(device, torch.float32, upstream=lambda l: torch.tensor(3.0, device=l.device))
    _check(device, torch.float32, reduction="none", upstream=lambda l: torch.randn_like(l))


@pytest.mark.parametrize("mode", ["in_forward", "recompute"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dweight_accumulation_and_inplace(device, mode, dtype):
    if dtype == torch.float16 and mode == "in_forward":
        mode = "auto"  # in_forward is refused for fp16; auto takes recompute there
    # the weight's own dtype: one rounding per pair of chunks (here 12 pairs of 3 tokens)
    _check(device, dtype, backward_mode=mode, dweight_accumulation="weight_dtype",
           workspace_bytes=2 * 3 * 208 * 4, upstream=lambda l: torch.tensor(0.7, device=l.device))
    _check(device, dtype, backward_mode=mode, inplace_backward=False)


@pytest.mark.parametrize("mode", ["auto", "recompute"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_default_accumulation_follows_the_weight_gradient_dtype(device, mode, dtype):
    """dweight_accumulation="auto" (the default) sums a 16-bit weight's gradient in its own
    dtype (the bits of "weight_dtype"; no fp32 [V, H]) and an fp32 weight's in fp32."""
    h, w, t = _problem(device, dtype, shape=(40,), V=203, seed=int(torch.randint(1 << 30, ())))
    upstream = torch.rand((), device=device) + 0.5

    def grads(**options):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        fusedloss.linear_cross_entropy(hh, ww, t, backward_mode=mode, workspace_bytes=2 * 8 * 208 * 4,
                                       **options).backward(upstream)
        return hh.grad, ww.grad

    same = grads(dweight_accumulation="weight_dtype" if dtype != torch.float32 else "fp32")
    for got, want in zip(grads(), same):
        assert torch.equal(got, want)
    h64, w64 = h.double().cpu().requires_grad_(), w.double().cpu().requires_grad_()
    reference(h64, w64, t.cpu()).backward(upstream.double().cpu())
    assert _rel(same[1].cpu(), w64.grad) <= _TOL[dtype]


def test_default_in_forward_keeps_no_fp32_weight_gradient(device):
    """The default bf16 call saves its unit weight gradient in bf16 (scaled in place by the
    backward, no fp32 [V, H] copy); dweight_accumulation="fp32" keeps an fp32 one."""
    h, w, t = _problem(device, torch.bfloat16)
    for options, dtype in (({}, torch.bfloat16), ({"dweight_accumulation": "fp32"}, torch.float32)):
        saved = []
        ww = w.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
            loss = fusedloss.linear_cross_entropy(h.clone().requires_grad_(), ww, t, **options)
        big = [x for x in saved if x.shape == w.shape and x.data_ptr() != ww.data_ptr()]
        assert [x.dtype for x in big] == [dtype], options
        loss.backward()


@pytest.mark.parametrize("mode, reduction", [("in_forward", "mean"), ("recompute", "mean"),
                                             ("recompute", "none")])
@pytest.mark.parametrize("accumulation", ["fp32", "weight_dtype"])
def test_weight_grad_accumulator(device, mode, reduction, accumulation):
    """The weight's gradient added into an fp32 buffer (Megatron's main_grad), never rounded to
    bf16: rounded, it is the gradient autograd returns without the buffer; added to what the
    buffer held; autograd's own weight gradient is zeros."""
    h, w, t = _problem(device, torch.bfloat16, shape=(6, 5), V=203)
    opts = dict(backward_mode=mode, reduction=reduction, dweight_accumulation=accumulation)
    upstream = torch.rand(t.shape if reduction == "none" else (), device=device) + 0.5

    def run(accumulator=None):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fusedloss.linear_cross_entropy(hh, ww, t, weight_grad_accumulator=accumulator, **opts)
        loss.backward(upstream)
        return hh.grad, ww.grad

    dh, dw = run()
    zero = torch.zeros(w.shape, dtype=torch.float32, device=device)
    dh_acc, dw_zeros = run(zero)
    assert torch.equal(dh_acc, dh)
    assert dw_zeros.dtype == w.dtype and dw_zeros.shape == w.shape and not dw_zeros.any()
    assert not torch.equal(zero.to(torch.bfloat16).float(), zero)  # not rounded to bf16
    if accumulation == "fp32" and mode == "in_forward":
        assert torch.equal(zero.to(torch.bfloat16), dw)  # the same fp32 sum, one rounding later
    else:  # recompute computes a 16-bit dweight by vocabulary blocks and the buffer's not (other
        # GEMM shapes: the bf16 logits and their gradient may round apart); weight_dtype rounds
        # every pair of chunks. The same gradient up to bf16 roundings of its terms, which an
        # element that cancels out does not bound: the measure is the norm's.
        assert _rel(zero.to(torch.bfloat16), dw) <= 2 ** -7
    h64 = h.double().cpu().requires_grad_()
    w64 = w.double().cpu().requires_grad_()
    ref = reference(h64, w64, t.cpu(), reduction=reduction)
    ref.backward(upstream.double().cpu())
    assert _rel(zero.cpu(), w64.grad) <= _TOL[torch.bfloat16]
    held = torch.randn(w.shape, device=device)
    added = held.clone()
    run(added)
    torch.testing.assert_close(added, held + zero, rtol=1e-6, atol=1e-6)


def test_weight_grad_accumulator_late_or_unused(device):
    """A callable is asked at the backward (a buffer bound late); when it returns None, or the
    weight needs no gradient, the gradient goes where it would without one."""
    h, w, t = _problem(device, torch.bfloat16, shape=(6, 5), V=203)

    def run(accumulator, weight_grad=True):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_(weight_grad)
        fusedloss.linear_cross_entropy(hh, ww, t, weight_grad_accumulator=accumulator).backward()
        return hh.grad, ww.grad

    direct = torch.zeros(w.shape, device=device)
    run(direct)
    late, asked = torch.zeros(w.shape, device=device), []
    dh, dw = run(lambda: asked.append(1) or late)
    assert asked == [1] and torch.equal(late, direct) and not dw.any()
    plain_dh, plain_dw = run(None)
    dh, dw = run(lambda: None)
    assert torch.equal(dh, plain_dh) and torch.equal(dw, plain_dw)
    untouched = torch.zeros(w.shape, device=device)
    dh, dw = run(untouched, weight_grad=False)
    assert dw is None and not untouched.any() and torch.equal(dh, plain_dh)
    with pytest.raises(ValueError, match="weight_grad_accumulator: got torch.bfloat16"):
        run(lambda: late.bfloat16())  # checked when asked


def test_weight_grad_accumulator_refused(device):
    h, w, t = _problem(device, torch.float32)
    acc = torch.zeros(w.shape, device=device)
    ww = w.clone().requires_grad_()
    bad = [(acc.bfloat16(), "weight_grad_accumulator: got torch.bfloat16"),
           (acc[:-1], r"expected torch.float32 \(203, 24\)"),
           (acc.clone().requires_grad_(), "requires grad"),
           (torch.zeros(24, 203, device=device).t(), "strides"),
           (ww.detach(), "overlaps weight's memory")]
    for a, match in bad:
        with pytest.raises(ValueError, match=match):
            fusedloss.linear_cross_entropy(h, ww, t, weight_grad_accumulator=a)
    rows = torch.randn(203, 24, device=device)  # hidden = its first 37 rows
    with pytest.raises(ValueError, match="overlaps hidden's memory"):
        fusedloss.linear_cross_entropy(rows[:37], ww, t, weight_grad_accumulator=rows)
    with pytest.raises(TypeError, match="weight_grad_accumulator"):
        fusedloss.linear_cross_entropy(h, w, t, weight_grad_accumulator=acc.tolist())
    # where the custom ops serve (compile, fake tensors, torch.func): refused by name
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import vmap
    with FakeTensorMode(allow_non_fake_inputs=True):
        fh, fw = torch.randn(37, 24, device=device), torch.randn(203, 24, device=device, requires_grad=True)
        for a in (torch.zeros(203, 24, device=device), lambda: None):
            with pytest.raises(RuntimeError, match="weight_grad_accumulator is not supported under"):
                fusedloss.linear_cross_entropy(fh, fw, t, weight_grad_accumulator=a)
    with pytest.raises(RuntimeError, match="weight_grad_accumulator is not supported under"):
        vmap(lambda x: fusedloss.linear_cross_entropy(x, ww, t, weight_grad_accumulator=acc))(h[None])
    compiled = torch.compile(lambda: fusedloss.linear_cross_entropy(h, ww, t, weight_grad_accumulator=acc),
                             fullgraph=True)
    with pytest.raises(Exception, match="weight_grad_accumulator is not supported under"):
        compiled()


@pytest.mark.parametrize("how", ["no_grad", "no_input_requires_grad", "inference_mode"])
def test_forward_alone_when_no_gradient_follows(device, how, monkeypatch):
    """A sum/mean call that nothing will differentiate runs the forward alone (1 GEMM): no
    dhidden [N, H] and fp32 dweight [V, H] computed and kept for nothing. (The Python node's
    decision; test_native.py checks the C++ node's by the memory it allocates.)"""
    lce = sys.modules["fusedloss.linear_cross_entropy"]
    monkeypatch.setattr(lce, "_EAGER", None)
    h, w, t = _problem(device, torch.float32)
    expected = fusedloss.linear_cross_entropy(h, w, t, backward_mode="recompute")
    calls = []
    real = lce._absent  # the empty dhidden/dweight views of a forward that keeps no gradients
    monkeypatch.setattr(lce, "_absent", lambda *a: calls.append("absent") or real(*a))
    hh, ww = (h.clone().requires_grad_(), w.clone().requires_grad_()) if how != "no_input_requires_grad" else (h, w)
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(how)
    for mode in ("auto", "in_forward"):
        with ctx() if ctx else contextlib.nullcontext():
            loss = fusedloss.linear_cross_entropy(hh, ww, t, backward_mode=mode)
        torch.testing.assert_close(loss, expected)
        assert not loss.requires_grad
    assert calls == ["absent", "absent"]  # no dhidden or dweight buffer: the forward alone
    loss = fusedloss.linear_cross_entropy(h.clone().requires_grad_(), w, t)  # a gradient follows
    assert len(calls) == 2 and loss.requires_grad  # in_forward: the gradients' buffers


def test_second_backward(device):
    h, w, t = _problem(device, torch.float32)
    for inplace in (True, False):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fusedloss.linear_cross_entropy(hh, ww, t, inplace_backward=inplace)
        loss.backward(retain_graph=True)
        first = (hh.grad.clone(), ww.grad.clone())
        if inplace:  # the saved gradients were scaled where they are: a second pass raises
            with pytest.raises(RuntimeError, match="second backward.*scaled the gradients its "
                               r"forward saved in place \(the inputs are untouched\)"):
                loss.backward()
            torch.testing.assert_close(hh.detach(), h)  # as the message says
        else:
            loss.backward()
            torch.testing.assert_close(hh.grad, 2 * first[0])
            torch.testing.assert_close(ww.grad, 2 * first[1])


def test_all_ignored_and_zero_rows(device):
    h, w, t = _problem(device, torch.float32, shape=(4,))
    t.fill_(-100)
    hh, ww = h.requires_grad_(), w.requires_grad_()
    loss = fusedloss.linear_cross_entropy(hh, ww, t)
    assert loss.item() == 0.0
    loss.backward()
    assert hh.grad.abs().max().item() == 0 and ww.grad.abs().max().item() == 0
    z = torch.zeros(0, 8, device=device, requires_grad=True)
    w2 = torch.randn(5, 8, device=device, requires_grad=True)
    loss = fusedloss.linear_cross_entropy(z, w2, torch.zeros(0, dtype=torch.long, device=device))
    loss.backward()
    assert loss.item() == 0.0 and w2.grad.abs().max().item() == 0


# Inputs as a caller may hold them: transposed hidden ([H, N] storage), a weight that is the
# transpose of an [H, V] tensor, and [b, s, H] seen as Megatron's [s, b, H] (with its targets).
_COMPILE_LAYOUTS = {
    "contiguous": lambda h, w, t: (h, w, t),
    "hidden_transposed": lambda h, w, t: (h.t().contiguous().t(), w, t),
    "weight_transposed": lambda h, w, t: (h, w.t().contiguous().t(), t),
    "bsh_as_sbh": lambda h, w, t: (h.view(-1, 1, h.size(-1)).expand(-1, 2, -1).transpose(0, 1)
                                   .contiguous().transpose(0, 1), w, t.view(-1, 1).expand(-1, 2)),
}


@pytest.mark.parametrize("layout", list(_COMPILE_LAYOUTS))
@pytest.mark.parametrize("reduction, options", [("mean", {}), ("none", {}),
                                                ("mean", dict(inplace_backward=False))])
def test_compile_fullgraph(device, reduction, options, layout):
    # the compiled backward's gradients against the eager ones (a fake kernel whose strides
    # differ from the real op's fails AOTAutograd's check here)
    h, w, t = _COMPILE_LAYOUTS[layout](*_problem(device, torch.float32))

    def step(h, w):
        return fusedloss.linear_cross_entropy(h, w, t, reduction=reduction, z_loss=1e-4, **options).sum()

    torch._dynamo.reset()  # one code object compiled per case: no recompile limit across them
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    grads = []
    for fn in (step, compiled):
        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
        hh.grad = ww.grad = None
        out = fn(hh, ww)
        out.backward()
        grads.append((out.detach(), hh.grad.clone(), ww.grad.clone()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_compile_inductor_checks_the_backward_strides(device):
    # Inductor asserts that each op's outputs have the strides its fake kernel promised: the
    # backward's gradients come out contiguous whatever the inputs' layout, and so must the
    # fake's (aot_eager above does not check strides). Caches off: a graph compiled against
    # another fake must not stand in.
    h, w, t = _problem(device, torch.float32, shape=(12,), V=30)
    h = h.t().contiguous().t().requires_grad_()
    w = w.t().contiguous().t().requires_grad_()
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        compiled = torch.compile(lambda h, w: fusedloss.linear_cross_entropy(h, w, t, reduction="none").sum(),
                                 fullgraph=True)
        compiled(h, w).backward()
    h64, w64 = h.detach().double().cpu().requires_grad_(), w.detach().double().cpu().requires_grad_()
    reference(h64, w64, t.cpu(), reduction="none").sum().backward()
    assert _rel(h.grad.cpu(), h64.grad) <= 1e-5 and _rel(w.grad.cpu(), w64.grad) <= 1e-5


def test_tf32_follows_torch(device):
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        h, w, t = _problem(device, torch.float32)
        loss = fusedloss.linear_cross_entropy(h, w, t)
        ref = reference(h.double().cpu(), w.double().cpu(), t.cpu())
        assert abs(loss.item() - ref.item()) <= 5e-3 * abs(ref.item())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden_dtype", [torch.float32, "autocast"])
@pytest.mark.parametrize("compiled", [False, True])
def test_autocast_runs_the_gemms_in_its_dtype(device, autocast_dtype, hidden_dtype, compiled):
    """Under torch.autocast the op is F.linear + F.cross_entropy there: fp32 operands (and the
    autocast model's bf16 hidden with its fp32 head weight) run the GEMMs in the autocast dtype,
    the loss is fp32, hidden's gradient comes back in its dtype through the cast, and the fp32
    weight's gradient is summed in fp32 and never rounded to the autocast dtype."""
    h, w, t = _problem(device, torch.float32)
    hidden_dtype = autocast_dtype if hidden_dtype == "autocast" else hidden_dtype
    op = torch.compile(fusedloss.linear_cross_entropy, fullgraph=True) if compiled else \
        fusedloss.linear_cross_entropy

    def run(hidden, weight, autocast, **options):
        hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast(h.device.type, dtype=autocast_dtype, enabled=autocast):
            loss = op(hidden, weight, t, **options)
        loss.backward()
        return loss, hidden.grad, weight.grad

    loss, dh, dw = run(h.to(hidden_dtype), w, True)
    assert (loss.dtype, dh.dtype, dw.dtype) == (torch.float32, hidden_dtype, torch.float32)
    cast_loss, cast_dh, cast_dw = run(h.to(autocast_dtype), w.to(autocast_dtype), False,
                                      dweight_accumulation="fp32")
    assert torch.equal(loss, cast_loss), (loss.item(), cast_loss.item())
    assert torch.equal(dh, cast_dh.to(dh.dtype)), (dh.float() - cast_dh.float()).abs().max().item()
    # the fp32 sum itself: not representable in the autocast dtype, and closer to float64 than
    # its rounding (the cast call's gradient, where both sum alike: bf16 runs in_forward)
    assert not torch.equal(dw.to(autocast_dtype).float(), dw), "dweight was rounded"
    h64 = h.to(autocast_dtype).double().cpu().requires_grad_()
    w64 = w.to(autocast_dtype).double().cpu().requires_grad_()
    reference(h64, w64, t.cpu()).backward()
    assert _rel(dw.cpu(), w64.grad) < _rel(cast_dw.cpu(), w64.grad), (
        _rel(dw.cpu(), w64.grad), _rel(cast_dw.cpu(), w64.grad))
    if autocast_dtype == torch.bfloat16:
        assert torch.equal(dw.to(autocast_dtype), cast_dw), (
            (dw.to(autocast_dtype).float() - cast_dw.float()).abs().max().item())
    with torch.autocast(h.device.type, dtype=autocast_dtype):  # the unfused ops agree
        ref = F.cross_entropy(F.linear(h.to(hidden_dtype), w), t)
    assert abs(loss.item() - ref.item()) <= 1e-3 * abs(ref.item()), (loss.item(), ref.item())


@pytest.mark.parametrize("layout", ["transposed", "sliced", "offset", "expanded", "overlapping"])
@pytest.mark.parametrize("leaf_itself", [False, True])
def test_autocast_reads_every_layout(device, layout, leaf_itself):
    """Under autocast, hidden and weight in every layout (views of fp32 leaves, or the leaves
    themselves where the layout allows) give what the explicitly cast views give, and the
    gradients reach the fp32 leaves."""
    from layouts import leaf
    gen = torch.Generator().manual_seed(7)
    t = torch.randint(0, 40, (12,), device=device)
    hb, hv = leaf(layout, (12, 16), torch.float32, device, gen)
    wb, wv = leaf("contiguous" if leaf_itself else layout, (40, 16), torch.float32, device, gen, 0.3)

    def run(autocast):
        h, w = hb.detach().clone().requires_grad_(), wb.detach().clone().requires_grad_()
        seen = []  # the gradient the op hands to the weight view, before the view's backward
        with torch.autocast(h.device.type, dtype=torch.bfloat16, enabled=autocast):
            hh, ww = hv(h), (w if leaf_itself else wv(w))
            ww.register_hook(seen.append)
            loss = fusedloss.linear_cross_entropy(hh, ww, t) if autocast else \
                fusedloss.linear_cross_entropy(hh.bfloat16(), ww.bfloat16(), t,
                                               dweight_accumulation="fp32")
        loss.backward()
        return loss, h.grad, seen[0], w.grad

    (loss, dh, dw, leaf_dw), (cast_loss, cast_dh, cast_dw, _) = run(True), run(False)
    assert torch.equal(loss, cast_loss) and torch.equal(dh, cast_dh)
    # the fp32 weight's gradient leaves the op as the fp32 sum, which the cast call rounds to
    # bf16 before its view's backward; the view's backward then takes it to the leaf
    assert dw.dtype == leaf_dw.dtype == torch.float32 and torch.equal(dw.bfloat16(), cast_dw.bfloat16())
    assert leaf_dw.shape == wb.shape


def test_autocast_on_one_rank_only_raises_on_every_rank():
    run_world(2, _autocast_on_rank_0)


def _autocast_on_rank_0(rank, world):
    h, w = torch.randn(6, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True)
    t = torch.randint(0, 10, (6,))
    with pytest.raises(ValueError, match=r"rank 1's dtype='torch.float32' differs from rank 0's "
                                         r"dtype='torch.bfloat16'"):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=rank == 0):
            fusedloss.linear_cross_entropy(h, w, t, tp_group=dist.group.WORLD)


def test_autocast_with_a_weight_grad_accumulator(device):
    """The accumulator gets the fp32 gradient of the autocast GEMMs; autograd's zeros for the
    weight reach its fp32 leaf expanded from one element (not an fp32 [V, H] of zeros)."""
    h, w, t = _problem(device, torch.float32)
    ww, acc, seen = w.clone().requires_grad_(), torch.zeros(w.shape, device=device), []
    ww.register_hook(lambda g: seen.append(g.stride()))
    with torch.autocast(h.device.type, dtype=torch.bfloat16):
        fusedloss.linear_cross_entropy(h, ww, t, weight_grad_accumulator=acc).backward()
    wb = w.bfloat16().requires_grad_()
    fusedloss.linear_cross_entropy(h.bfloat16(), wb, t, dweight_accumulation="fp32").backward()
    assert seen == [(0, 0)] and not ww.grad.any()
    torch.testing.assert_close(acc, wb.grad.float(), rtol=1e-2, atol=1e-4)


def test_bad_inputs(device):
    h, w, t = _problem(device, torch.float32)
    with pytest.raises(ValueError, match=r"weight: got shape \(203, 23\), expected \[V_local, 24\]"):
        fusedloss.linear_cross_entropy(h, w[:, :23], t)
    with pytest.raises(ValueError, match="weight.dtype: got torch.bfloat16, expected torch.float32"):
        fusedloss.linear_cross_entropy(h, w.bfloat16(), t)
    with pytest.raises(ValueError, match="hidden.dtype"):
        fusedloss.linear_cross_entropy(h.double(), w.double(), t)
    with pytest.raises(ValueError, match="target: got shape"):
        fusedloss.linear_cross_entropy(h, w, t[:-1])
    with pytest.raises(ValueError, match="target.dtype"):
        fusedloss.linear_cross_entropy(h, w, t.float())
    with pytest.raises(ValueError, match="backward_mode: got 'in_forward' with reduction='none' and "
                       "no loss_mask, expected 'recompute' or 'auto'"):
        fusedloss.linear_cross_entropy(h, w, t, reduction="none", backward_mode="in_forward")
    with pytest.raises(ValueError, match="logit_softcap: got -1"):
        fusedloss.linear_cross_entropy(h, w, t, logit_softcap=-1.0)
    with pytest.raises(ValueError, match="workspace_bytes"):
        fusedloss.linear_cross_entropy(h, w, t, workspace_bytes=0)
    with pytest.raises(TypeError, match="workspace_bytes"):
        fusedloss.linear_cross_entropy(h, w, t, workspace_bytes=1.5)
    with pytest.raises(ValueError, match="backward_mode"):
        fusedloss.linear_cross_entropy(h, w, t, backward_mode="sometimes")
    with pytest.raises(ValueError, match="dweight_accumulation"):
        fusedloss.linear_cross_entropy(h, w, t, dweight_accumulation="bf16")
    with pytest.raises(ValueError, match="dhidden_reduction: got 'scatter'"):
        fusedloss.linear_cross_entropy(h, w, t, dhidden_reduction="scatter")
    # a device torch.autocast does not know: named by the argument checks, not autocast's lookup
    with pytest.raises(ValueError, match="hidden.device: got meta, expected a cpu or cuda tensor"):
        fusedloss.linear_cross_entropy(h.to("meta"), w.to("meta"), t.to("meta"))
    if device == "cpu":
        bad = t.clone()
        bad[2] = 203
        with pytest.raises(ValueError, match=r"target\[2\]: got 203"):
            fusedloss.linear_cross_entropy(h, w, bad)
    if torch.cuda.is_available():
        other = "cuda" if device == "cpu" else "cpu"
        with pytest.raises(ValueError, match="weight.device"):
            fusedloss.linear_cross_entropy(h, w.to(other), t)
        with pytest.raises(ValueError, match="target.device"):
            fusedloss.linear_cross_entropy(h, w, t.to(other))


# ---- vocab-parallel over gloo ----

def _check_tp(rank, world, reduction, options, dh_reduction, device="cpu"):
    # reduce_scatter: hidden [s, b, H] sliced along s (sequence parallel), 3 tokens of s a rank
    slices = dh_reduction == "reduce_scatter"
    h, w, t = _problem(device, torch.float32, shape=(3 * world, 2) if slices else (13,), V=192)
    V_local = w.size(0) // world
    shard = w[rank * V_local:(rank + 1) * V_local].clone().requires_grad_(True)
    mine = slice(rank * 3, (rank + 1) * 3) if slices else slice(None)  # this rank's hidden rows
    hh = h[mine].clone().requires_grad_(True)
    loss = fusedloss.linear_cross_entropy(hh, shard, t, tp_group=dist.group.WORLD, reduction=reduction,
                                          dhidden_reduction=dh_reduction, **options)
    h64, w64 = h.double().cpu().requires_grad_(True), w.double().cpu().requires_grad_(True)
    ref = reference(h64, w64, t.cpu(), reduction=reduction, **options)
    torch.testing.assert_close(loss.double().cpu(), ref.detach(), rtol=1e-5, atol=1e-6)
    every = [torch.empty_like(loss) for _ in range(world)]
    dist.all_gather(every, loss.contiguous())
    assert all(torch.equal(e, every[0]) for e in every)  # the same bits on every rank
    g = torch.rand_like(loss) + 0.5
    dist.broadcast(g, 0)
    loss.backward(g)
    ref.backward(g.double().cpu())
    # Each gradient element is a dot product (over the vocabulary for dhidden, over the tokens for
    # dweight) whose terms cancel, so fp32 leaves rounding in proportion to the sum of the terms'
    # magnitudes, not to the result: bound it by |dlogits| @ |weight| and |dlogits|^T @ |hidden|.
    # Seen on the CPU: up to 7 units of it (fp32 lse and exp feed every term); the GPU's
    # 2-instruction exponential adds a few of its own.
    rows64 = h64.detach().reshape(-1, h.size(-1))
    x64 = F.linear(rows64, w64.detach()).requires_grad_(True)
    ref_opts = {k: v for k, v in options.items() if k not in ("workspace_bytes", "backward_mode")}
    reference_from_logits(x64, t.cpu().reshape(-1), h.shape[:-1], reduction=reduction,
                          **ref_opts).backward(g.double().cpu())
    units = (64 if device == "cpu" else 128) * 2.0 ** -24
    dlogits = x64.grad.abs()
    _assert_within_rounding(shard.grad, w64.grad[rank * V_local:(rank + 1) * V_local],
                            (dlogits.t() @ rows64.abs())[rank * V_local:(rank + 1) * V_local], units)
    dh = hh.grad.clone()
    if dh_reduction == "partial":
        dist.all_reduce(dh)
    _assert_within_rounding(dh, h64.grad[mine],
                            (dlogits @ w64.detach().abs()).view(h.shape)[mine], units)


def _assert_within_rounding(actual, expected, magnitude, units):
    """|actual - expected| <= 1e-5 |expected| + units * magnitude, element by element."""
    error = (actual.double().cpu() - expected).abs()
    allowed = 1e-5 * expected.abs() + units * magnitude
    worst = (error / allowed).argmax()
    assert (error <= allowed).all(), (
        f"element {worst.item()}: |{actual.reshape(-1)[worst].item()} - {expected.reshape(-1)[worst].item()}|"
        f" = {error.reshape(-1)[worst].item():.3g} > {allowed.reshape(-1)[worst].item():.3g}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("reduction, options, dh_reduction", [
    ("mean", {}, "partial"), ("none", dict(label_smoothing=0.1, z_loss=1e-3), "all_reduce"),
    ("sum", dict(logit_softcap=3.0, workspace_bytes=1), "partial"),
    ("mean", dict(backward_mode="recompute", label_smoothing=0.1), "all_reduce"),
    ("mean", dict(label_smoothing=0.1), "reduce_scatter"),
    ("none", dict(z_loss=1e-3, workspace_bytes=1), "reduce_scatter"),
    ("sum", dict(backward_mode="recompute", logit_softcap=3.0), "reduce_scatter")])
def test_gloo_tp(world, reduction, options, dh_reduction):
    run_world(world, _check_tp, reduction, options, dh_reduction)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA backend: no CUDA device")
@pytest.mark.parametrize("reduction, options", [
    ("mean", {}), ("sum", {}), ("mean", dict(workspace_bytes=1)), ("none", dict(label_smoothing=0.1)),
    ("sum", dict(workspace_bytes=1, logit_softcap=3.0))])
def test_gloo_tp_cuda(reduction, options):
    # CUDA tensors through gloo, both ranks on one GPU: the CUDA chunk loop, the in-forward form
    # (sum/mean: the all-gather runs per chunk through the callback) and the recompute form.
    run_world(2, _check_tp, reduction, options, "partial", "cuda", backend="gloo-cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA backend: no CUDA device")
@pytest.mark.parametrize("reduction, options", [("mean", {}), ("none", dict(workspace_bytes=1))])
def test_gloo_tp_cuda_token_slices(reduction, options):
    # sequence parallel on CUDA tensors: the slices' all-gather and the gradient's
    # reduce-scatter through the group
    run_world(2, _check_tp, reduction, options, "reduce_scatter", "cuda", backend="gloo-cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA backend: no CUDA device")
def test_callback_stream_is_the_callers():
    """The callback communicator runs its copies on the stream the C++ side names: handle 0 is
    the default stream itself (torch.cuda.ExternalStream(0) would be a fresh pool stream, with
    no ordering against the kernels that produced the data), a side stream is that stream."""
    from fusedloss._distributed import _torch_stream
    dev = torch.device("cuda", torch.cuda.current_device())
    default = torch.cuda.default_stream(dev)
    assert _torch_stream(0, dev) == default and _torch_stream(0, dev).cuda_stream == 0
    side, other = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        assert _torch_stream(side.cuda_stream, dev).cuda_stream == side.cuda_stream
        assert _torch_stream(0, dev).cuda_stream == 0  # the default stream, not the current one
        assert _torch_stream(other.cuda_stream, dev).cuda_stream == other.cuda_stream  # external


def _check_tp_in_forward_callback(rank, world, buffers):
    # the per-chunk callback communicator of the in-forward form: its copies must run on the
    # stream the C++ loop names (on an unordered stream the loss came out infinite on some runs)
    import os
    os.environ["FUSEDLOSS_LCE_BUFFERS"] = buffers  # 2: the callback runs on the loop's side stream
    for reduction, options in [("sum", {}), ("mean", dict(workspace_bytes=1)),
                               ("sum", dict(workspace_bytes=1, logit_softcap=3.0))]:
        for _ in range(3):  # the unordered stream failed on some runs, not all
            _check_tp(rank, world, reduction, dict(options, backward_mode="in_forward"), "partial",
                      "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA backend: no CUDA device")
@pytest.mark.parametrize("buffers", ["1", "2"])
def test_gloo_tp_cuda_in_forward_callback(buffers):
    run_world(2, _check_tp_in_forward_callback, buffers, backend="gloo-cuda")


def _check_tp_disagreement(rank, world, what):
    from test_vocab_parallel import _same_error_everywhere
    h, w, t = _problem("cpu", torch.float32, shape=(8,), V=64 * world)
    shard = w[rank * 64:(rank + 1) * 64].clone()
    G = dist.group.WORLD
    if what == "dhidden_reduction":  # the backward's all-reduce on one rank only: a hang before
        red = "all_reduce" if rank == 1 else "partial"
        _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(
            h, shard, t, tp_group=G, dhidden_reduction=red),
            "vocab-parallel options: rank 1's dhidden_reduction='all_reduce' differs from rank 0's dhidden_reduction='partial'")
    elif what == "hidden_width":  # H differs with rows and V_local equal: the dhidden
        hh, ww = (torch.cat([h, h], -1), torch.cat([shard, shard], -1)) if rank == 1 else (h, shard)
        _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(  # all-reduce would mismatch
            hh, ww, t, tp_group=G, dhidden_reduction="all_reduce"),
            "vocab-parallel options: rank 1's H=48 differs from rank 0's H=24")
    elif what == "accumulator_kind":  # a callable on one rank: its backward alone would agree
        buf = torch.zeros_like(shard)
        acc = (lambda: buf) if rank == 0 else buf
        ww = shard.clone().requires_grad_()
        _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(
            h, ww, t, tp_group=G, weight_grad_accumulator=acc),
            "rank 1's weight_grad_accumulator='a tensor' differs from rank 0's weight_grad_accumulator='a callable'")
    elif what == "softcap_hash_alike":  # values hash() does not tell apart (mod 2**61 - 1)
        cap = 3.0 * 2.0 ** 61 if rank == 1 else 3.0
        _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(
            h, shard, t, tp_group=G, logit_softcap=cap),
            f"rank 1's logit_softcap={3.0 * 2.0 ** 61!r} differs from rank 0's logit_softcap=3.0")
    elif what == "dtype":
        hh, ww = (h.bfloat16(), shard.bfloat16()) if rank == 1 else (h, shard)
        _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(hh, ww, t, tp_group=G),
                               "rank 1's dtype='torch.bfloat16' differs from rank 0's dtype='torch.float32'")
    elif what == "grad_state":  # one rank with nothing to differentiate would skip the backward
        hh = h.clone().requires_grad_(rank == 0)  # (its collectives: dhidden's all-reduce, the
        _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(  # accumulator's agreement)
            hh, shard, t, tp_group=G, reduction="none"),
            "vocab-parallel options: rank 1's backward_mode='none (no gradient follows: the forward "
            "alone)' differs from rank 0's backward_mode='recompute'")
    elif what in ("target_values", "target_values_recompute"):  # another token on one rank
        other = t.clone()
        if rank == 1:
            other[5] = (int(t[5]) + 1) % (64 * world)
        mode = "recompute" if what.endswith("recompute") else "auto"
        _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(
            h, shard, other, tp_group=G, backward_mode=mode),
            "vocab-parallel targets: rank 1's differ from rank 0's")
    elif what == "group_error_type":  # the process group's own exception, raised inside the
        class GroupDown(RuntimeError):  # C++ chunk loop's callback, arrives as it was raised
            pass

        real = dist.all_gather_into_tensor

        def failing(*args, **kw):
            raise GroupDown("simulated collective timeout")

        dist.all_gather_into_tensor = failing
        try:
            with pytest.raises(GroupDown, match="simulated collective timeout"):
                fusedloss.linear_cross_entropy(h, shard, t, tp_group=G, backward_mode="in_forward",
                                               check_shard_agreement=False)
        finally:
            dist.all_gather_into_tensor = real
    elif what == "check_flag":
        kw = dict(check_shard_agreement=1) if rank == 1 else {}
        _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(h, shard, t, tp_group=G, **kw),
                               "vocab-parallel rank 1: check_shard_agreement: got 1 (int)")
    elif what in ("uint64_target", "bits8_target"):  # refused on that rank inside the agreement,
        tt = t  # not after it (where the others already wait)
        if rank == 1:
            tt = t.to(torch.uint64) if what == "uint64_target" else t.to(torch.uint8).view(torch.bits8)
        _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(h, shard, tt, tp_group=G),
                               f"vocab-parallel rank 1: target.dtype: got torch.{what[:-7]}")
    elif what == "fp16_in_forward":  # rank 1 alone in fp16 asks for in_forward: refused there,
        hh, ww = (h.half(), shard.half()) if rank == 1 else (h.clone(), shard)
        hh.requires_grad_()
        _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(  # inside the agreement
            hh, ww, t, tp_group=G, backward_mode="in_forward"),
            "vocab-parallel rank 1: backward_mode: got 'in_forward' with torch.float16 inputs")
    elif what == "softcap_float32":  # a value float32 cannot hold, on rank 1 alone
        cap = 1e-300 if rank == 1 else 30.0
        _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(h, shard, t, tp_group=G, logit_softcap=cap),
                               "vocab-parallel rank 1: logit_softcap: got 1e-300, which is 0 in float32")
    elif what == "accumulator_at_backward":  # a callable's bad buffer on one rank, with all_reduce
        acc = torch.zeros(64 + (1 if rank == 1 else 0), h.size(1))
        hh, ww = h.clone().requires_grad_(), shard.clone().requires_grad_()
        loss = fusedloss.linear_cross_entropy(hh, ww, t, tp_group=G, dhidden_reduction="all_reduce",
                                              weight_grad_accumulator=lambda: acc)
        _same_error_everywhere(loss.backward, "vocab-parallel rank 1: weight_grad_accumulator: got "
                               "torch.float32 (65, 24)")
    elif what == "token_slice_target":  # rank 1's slice has 5 rows, so its target (8) covers
        hh = torch.cat([h[:4], h[:1]]) if rank == 1 else h[:4]  # 10 tokens: refused there, and
        _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(  # raised in the gather's
            hh, shard, t, tp_group=G, dhidden_reduction="reduce_scatter"),  # agreement
            "vocab-parallel rank 1: target: got shape (8,), expected (10,) (the tokens of 2 ranks' "
            "slices of hidden along dim 0")
    elif what == "token_slice_grad":  # only ranks with a hidden gradient would reduce-scatter it
        hh = h[rank * 4:(rank + 1) * 4].clone().requires_grad_(rank == 0)
        ww = shard.clone().requires_grad_()
        _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(
            hh, ww, t, tp_group=G, dhidden_reduction="reduce_scatter"),
            "rank 1's hidden_requires_grad=False differs from rank 0's hidden_requires_grad=True")
    elif what == "token_slices_on_one_rank":  # the gather's agreement against the op's
        hh, red = (h[:4], "reduce_scatter") if rank == 0 else (h, "partial")
        _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(
            hh, shard, t, tp_group=G, dhidden_reduction=red),
            "vocab-parallel options: rank 1 compared the options (ignore_index",
            "where rank 0 compared (dhidden_reduction, hidden_slice_shape",
            "rank 1's dhidden_reduction='partial' where rank 0's is 'reduce_scatter'")
    elif what in ("token_slice_dtype", "token_slice_width"):  # the gather's own agreement
        hh, ww = h[rank * 4:(rank + 1) * 4], shard
        if rank == 1:
            hh, ww = ((hh.bfloat16(), ww.bfloat16()) if what == "token_slice_dtype" else
                      (torch.cat([hh, hh], -1), torch.cat([ww, ww], -1)))
        _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(
            hh, ww, t, tp_group=G, dhidden_reduction="reduce_scatter"),
            "rank 1's dtype='torch.bfloat16' differs from rank 0's dtype='torch.float32'"
            if what == "token_slice_dtype" else
            "rank 1's hidden_slice_shape=(4, 48) differs from rank 0's hidden_slice_shape=(4, 24)")
    elif what == "inplace_backward":  # a second backward would raise on rank 0 alone, before
        hh, ww = h.clone().requires_grad_(), shard.clone().requires_grad_()  # the all-reduce
        _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(
            hh, ww, t, tp_group=G, dhidden_reduction="all_reduce", inplace_backward=rank == 0,
            dweight_accumulation="weight_dtype"),
            "rank 1's inplace_backward=False differs from rank 0's inplace_backward=True")
    # the group is still usable: a good call agrees again
    assert torch.isfinite(fusedloss.linear_cross_entropy(h, shard, t, tp_group=G))


@pytest.mark.parametrize("what", ["dhidden_reduction", "dtype", "grad_state", "target_values",
                                  "target_values_recompute", "group_error_type", "check_flag",
                                  "uint64_target", "bits8_target", "accumulator_at_backward",
                                  "fp16_in_forward", "softcap_float32", "hidden_width",
                                  "accumulator_kind", "softcap_hash_alike", "token_slice_target",
                                  "token_slice_grad", "token_slices_on_one_rank",
                                  "inplace_backward", "token_slice_dtype", "token_slice_width"])
def test_gloo_tp_disagreement_raises_everywhere(what):
    run_world(2, _check_tp_disagreement, what, timeout_s=30)


def _check_tp_mismatch(rank, world):
    h, w, t = _problem("cpu", torch.float32, shape=(8,), V=64 * world)
    V_local = 64 + (1 if rank == 1 else 0)
    with pytest.raises(ValueError, match="V_local"):
        fusedloss.linear_cross_entropy(h, torch.randn(V_local, h.size(1)), t, tp_group=dist.group.WORLD)
    # one rank chunks differently (the in-forward form's per-chunk collectives would not pair
    # with the others'; a gradient must follow, or the forward alone runs)
    with pytest.raises(ValueError, match="chunking"):
        fusedloss.linear_cross_entropy(h.clone().requires_grad_(), torch.randn(64, h.size(1)), t,
                                       tp_group=dist.group.WORLD,
                                       workspace_bytes=2 * 64 * 4 * (3 if rank else 4))
    # one rank's own bad argument raises on every rank
    ww = torch.randn(64, h.size(1) - (1 if rank == 0 else 0))
    with pytest.raises(ValueError, match="rank 0"):
        fusedloss.linear_cross_entropy(h, ww, t, tp_group=dist.group.WORLD)
    # one rank's weight gradient buffer of another dtype: refused on every rank, nothing written
    w = torch.randn(64, h.size(1), requires_grad=True)
    acc = torch.zeros(64, h.size(1), dtype=torch.bfloat16 if rank == 1 else torch.float32)
    with pytest.raises(ValueError, match="vocab-parallel rank 1: weight_grad_accumulator: got torch.bfloat16"):
        fusedloss.linear_cross_entropy(h, w, t, tp_group=dist.group.WORLD, weight_grad_accumulator=acc)
    assert not acc.any()


def test_gloo_tp_mismatch():
    run_world(2, _check_tp_mismatch)


def _check_tp_token_slices_compiled(rank, world):
    # sequence parallel under torch.compile fullgraph: the gather is a custom op too; the
    # compiled loss and gradients are the eager ones (recompute, and in_forward's in-place scale)
    h, w, t = _problem("cpu", torch.float32, shape=(2 * world, 3), V=32 * world)
    shard = w[rank * 32:(rank + 1) * 32]
    for reduction in ("none", "mean"):
        def step(hh, ww):
            loss = fusedloss.linear_cross_entropy(hh, ww, t, tp_group=dist.group.WORLD,
                                                  dhidden_reduction="reduce_scatter",
                                                  reduction=reduction)
            return (loss * torch.linspace(0.5, 1.5, loss.numel()).view(loss.shape)).sum()

        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        results = []
        for fn in (step, compiled):
            hh = h[rank * 2:(rank + 1) * 2].clone().requires_grad_()
            ww = shard.clone().requires_grad_()
            loss = fn(hh, ww)
            loss.backward()
            results.append((loss.detach(), hh.grad, ww.grad))
        for eager, traced in zip(*results):
            torch.testing.assert_close(traced, eager, rtol=0, atol=0)


def test_gloo_tp_token_slices_compiled():
    run_world(2, _check_tp_token_slices_compiled)


def _check_tp_token_slice_layouts(rank, world):
    # the slice as a transposed view, a view expanded along b (stride 0) and a slice of a wider
    # tensor: the loss and both gradients are those of the same values passed contiguous, and
    # the caller's tensor is not written
    h, w, t = _problem("cpu", torch.float32, shape=(2 * world, 3), V=32 * world)
    shard = w[rank * 32:(rank + 1) * 32]
    mine = h[rank * 2:(rank + 1) * 2]

    def run(hh):
        hh = hh.detach().requires_grad_()
        ww = shard.clone().requires_grad_()
        before = hh.detach().clone()
        loss = fusedloss.linear_cross_entropy(hh, ww, t, tp_group=dist.group.WORLD,
                                              dhidden_reduction="reduce_scatter", reduction="none")
        (loss * torch.linspace(0.5, 1.5, loss.numel()).view(loss.shape)).sum().backward()
        assert torch.equal(hh.detach(), before)
        # the slice's gradient is its own memory, not a view of every rank's [world * n, H]
        assert hh.grad.untyped_storage().nbytes() == hh.grad.numel() * hh.grad.element_size()
        return loss.detach(), hh.grad, ww.grad

    expected = run(mine.contiguous())
    views = {"transposed": mine.transpose(0, 1).contiguous().transpose(0, 1),
             "sliced": torch.cat([mine, mine], -1)[..., :mine.size(-1)]}
    for name, view in views.items():
        assert not view.is_contiguous(), name
        for got, want in zip(run(view), expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    # the same row repeated along b: a stride-0 view, and the values it repeats
    expanded = mine[:, :1].expand(mine.shape)
    for got, want in zip(run(expanded), run(expanded.contiguous())):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_gloo_tp_token_slice_layouts():
    run_world(2, _check_tp_token_slice_layouts)


def _check_tp_token_slices_match_partial(rank, world):
    # reduce_scatter against "partial" on the gathered hidden, its dhidden summed here and this
    # rank's rows taken: the paths that write dhidden apart (an accumulator, a tensor or a
    # callable, with and without a loss_mask; the in-place scale in bf16; recompute)
    n = 3
    h, w, t = _problem("cpu", torch.float32, shape=(n * world, 2), H=16, V=32 * world)
    mask = (torch.rand(t.shape, generator=torch.Generator().manual_seed(1)) > 0.3).float()
    cases = [dict(acc="tensor"), dict(acc="callable", mask=True), dict(dtype=torch.bfloat16),
             dict(reduction="none", backward_mode="recompute"), dict(mask=True)]
    for case in cases:
        case = dict(case)
        acc, masked = case.pop("acc", None), case.pop("mask", False)
        dtype = case.pop("dtype", torch.float32)
        got = []
        for red in ("reduce_scatter", "partial"):
            hh = (h[rank * n:(rank + 1) * n] if red == "reduce_scatter" else h).to(dtype)
            hh = hh.clone().requires_grad_()
            ww = w[rank * 32:(rank + 1) * 32].to(dtype).clone().requires_grad_()
            buf = torch.zeros(ww.shape)
            kw = dict(case)
            if acc is not None:
                kw["weight_grad_accumulator"] = buf if acc == "tensor" else (lambda b=buf: b)
            if masked:
                kw.update(loss_mask=mask, reduction="none")
            loss = fusedloss.linear_cross_entropy(hh, ww, t, tp_group=dist.group.WORLD,
                                                  dhidden_reduction=red, **kw)
            scale = mask if masked else torch.linspace(0.5, 1.5, loss.numel()).view(loss.shape)
            (loss * scale).sum().backward()
            dh = hh.grad.float()
            if red == "partial":
                dist.all_reduce(dh)
                dh = dh[rank * n:(rank + 1) * n]
            got.append((loss.detach(), dh, buf if acc is not None else ww.grad.float()))
        for a, b in zip(*got):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 if dtype == torch.float32 else 1e-2,
                                       msg=lambda m: f"{case} acc={acc} mask={masked}: {m}")


def test_gloo_tp_token_slices_match_partial():
    run_world(2, _check_tp_token_slices_match_partial)


def _check_tp_token_slices_out_of_memory_in_backward(rank, world):
    # rank 1 runs out of memory for the reduce-scatter's own rows, after its output buffers:
    # it joins the reduce-scatter with NaN and raises; rank 0 gets NaN instead of waiting
    lce = sys.modules["fusedloss.linear_cross_entropy"]  # (the package's name is the function)
    h, w, t = _problem("cpu", torch.float32, shape=(2 * world,), V=32 * world)
    hh = h[rank * 2:(rank + 1) * 2].clone().requires_grad_()
    ww = w[rank * 32:(rank + 1) * 32].clone().requires_grad_()
    loss = fusedloss.linear_cross_entropy(hh, ww, t, tp_group=dist.group.WORLD,
                                          dhidden_reduction="reduce_scatter")
    real = lce.own_rows_buffer
    if rank == 1:
        def failing(*args):
            raise torch.OutOfMemoryError("simulated: no memory for the own rows")
        lce.own_rows_buffer = failing
    try:
        if rank == 1:
            with pytest.raises(torch.OutOfMemoryError, match="simulated"):
                loss.backward()
        else:
            loss.backward()
            assert torch.isnan(hh.grad).all()
    finally:
        lce.own_rows_buffer = real
    assert torch.isfinite(fusedloss.linear_cross_entropy(  # the group still pairs its calls
        h[rank * 2:(rank + 1) * 2], w[rank * 32:(rank + 1) * 32], t, tp_group=dist.group.WORLD,
        dhidden_reduction="reduce_scatter"))


def test_gloo_tp_token_slices_out_of_memory_in_backward():
    run_world(2, _check_tp_token_slices_out_of_memory_in_backward, timeout_s=30)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("label_smoothing, formula, bias", [
    (0.0, "pytorch", False), (0.1, "pytorch", False), (0.1, "pytorch", True),
    (0.2, "megatron", True)])
def test_class_weight_matches_torch(device, reduction, dtype, label_smoothing, formula, bias):
    """class_weight is F.cross_entropy's weight: each row scaled by its class's weight, 'mean'
    over the counted rows' weights, with label smoothing torch's weighted smoothing term (for
    Megatron's formula its label distribution weighted alike), a bias included; gradients of
    hidden, weight and bias against float64."""
    h, w, t = _problem(device, dtype, seed=int(torch.randint(1 << 30, ())))
    t[::5] = -100
    cw = torch.rand(w.size(0), device=device) + 0.25
    b = (torch.randn(w.size(0)) if bias else torch.zeros(w.size(0))).to(device, dtype)
    hh, ww, bb = (x.clone().requires_grad_() for x in (h, w, b))
    loss = fusedloss.linear_cross_entropy(hh, ww, t, bb if bias else None, reduction=reduction,
                                          class_weight=cw, label_smoothing=label_smoothing,
                                          smoothing_formula=formula)
    up = torch.rand_like(loss) + 0.5
    loss.backward(up)
    h64, w64, b64 = (x.double().cpu().requires_grad_() for x in (h, w, b))
    ref = weighted_reference(F.linear(h64, w64, b64), t.cpu(), cw.double().cpu(), label_smoothing,
                             reduction, formula)
    ref.backward(up.double().cpu())
    if bias:
        assert _rel(bb.grad.cpu(), b64.grad) <= _TOL[dtype]
    tol = _TOL[dtype]
    torch.testing.assert_close(loss.double().cpu(), ref.detach(), rtol=tol, atol=tol)
    assert _rel(hh.grad.cpu(), h64.grad) <= tol and _rel(ww.grad.cpu(), w64.grad) <= tol
    # every row ignored: 'mean' is 0 with zero gradients (torch gives NaN)
    if reduction == "mean":
        hh = h.clone().requires_grad_()
        loss = fusedloss.linear_cross_entropy(hh, w, torch.full_like(t, -100), class_weight=cw)
        loss.backward()
        assert loss.item() == 0.0 and not hh.grad.any()


def test_class_weight_bad_inputs(device):
    h, w, t = _problem(device, torch.float32)
    cw = torch.ones(w.size(0), device=device)
    with pytest.raises(ValueError, match=r"class_weight: got torch.float32 \(202,\), expected a "
                                         r"floating-point \[203\]"):
        fusedloss.linear_cross_entropy(h, w, t, class_weight=cw[1:])
    with pytest.raises(ValueError, match="class_weight: got a tensor with label_smoothing=0.1 and "
                                         "z_loss="):
        fusedloss.linear_cross_entropy(h, w, t, class_weight=cw, label_smoothing=0.1, z_loss=1e-3)
    with pytest.raises(ValueError, match="class_weight: got a tensor with a loss_mask"):
        fusedloss.linear_cross_entropy(h, w, t, reduction="none", class_weight=cw,
                                       loss_mask=torch.ones_like(t))
    with pytest.raises(ValueError, match="class_weight: got a tensor with label_smoothing=0.1 and "
                                         "weight_grad_accumulator=a tensor"):
        fusedloss.linear_cross_entropy(h, w.clone().requires_grad_(), t, class_weight=cw,
                                       label_smoothing=0.1,
                                       weight_grad_accumulator=torch.zeros(w.shape, device=device))
    with pytest.raises(ValueError, match="class_weight: got a tensor that requires grad"):
        fusedloss.linear_cross_entropy(h, w, t, class_weight=cw.clone().requires_grad_())


def _tp_class_weight(rank, world):
    torch.manual_seed(7)
    h, w, t = _problem("cpu", torch.float32, shape=(13,), V=192)
    cw = torch.rand(192) + 0.5
    V_local = w.size(0) // world
    shard = w[rank * V_local:(rank + 1) * V_local].clone().requires_grad_()
    hh = h.clone().requires_grad_()
    loss = fusedloss.linear_cross_entropy(hh, shard, t, class_weight=cw, tp_group=dist.group.WORLD,
                                          dhidden_reduction="all_reduce")
    loss.backward()
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    ref = F.cross_entropy(F.linear(h64, w64), t, weight=cw.double())
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert _rel(hh.grad, h64.grad) <= 1e-5
    assert _rel(shard.grad, w64.grad[rank * V_local:(rank + 1) * V_local]) <= 1e-5
    bad = cw[:-1] if rank == 1 else cw
    with pytest.raises(ValueError, match=r"rank 1: class_weight: got torch.float32 \(191,\)"):
        fusedloss.linear_cross_entropy(h, shard, t, class_weight=bad, tp_group=dist.group.WORLD)
    # Megatron's per-shard smoothing scope has no weighted form across ranks: refused on every
    # rank alike, naming both arguments
    from test_vocab_parallel import _same_error_everywhere
    _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(
        h, shard, t, class_weight=cw, label_smoothing=0.1, smoothing_scope="partition",
        tp_group=dist.group.WORLD), "class_weight: got a tensor with label_smoothing=0.1 and "
        "smoothing_scope='partition' at a tp_group of more than one rank")


def test_gloo_tp_class_weight():
    run_world(2, _tp_class_weight)


def _tp_class_weight_with_smoothing(rank, world, seed, dtype, formula):
    """TP 2 against TP 1 and float64: the weighted smoothing term's shard parts summed over the
    group, hidden's gradient as each dhidden_reduction asks, every reduction, a bias."""
    h, w, t = _problem("cpu", dtype, shape=(12,), V=96, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    cw = torch.rand(96, generator=g) + 0.25
    b = torch.randn(96, generator=g).to(dtype)
    own = slice(rank * 48, (rank + 1) * 48)
    options = dict(class_weight=cw, label_smoothing=0.1, smoothing_formula=formula)
    tol = _TOL[dtype]
    for reduction in ("mean", "sum", "none"):
        for dh in ("partial", "all_reduce", "reduce_scatter"):
            mine = slice(rank * 6, (rank + 1) * 6) if dh == "reduce_scatter" else slice(None)
            hh = h[mine].clone().requires_grad_()
            ww, bb = w[own].clone().requires_grad_(), b[own].clone().requires_grad_()
            loss = fusedloss.linear_cross_entropy(hh, ww, t, bb, reduction=reduction,
                                                  tp_group=dist.group.WORLD,
                                                  dhidden_reduction=dh, **options)
            up = torch.rand(loss.shape, generator=g) + 0.5
            loss.backward(up)
            one = [x.clone().requires_grad_() for x in (h, w, b)]
            single = fusedloss.linear_cross_entropy(*one[:2], t, one[2], reduction=reduction,
                                                    **options)
            single.backward(up)
            r64 = [x.double().requires_grad_() for x in (h, w, b)]
            ref = weighted_reference(F.linear(*r64), t, cw.double(), 0.1, reduction, formula)
            ref.backward(up.double())
            torch.testing.assert_close(loss, single, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(loss.double(), ref.detach(), rtol=tol, atol=tol)
            dh_full = hh.grad if dh != "partial" else hh.grad.clone()
            if dh == "partial":  # this rank's partial sum: the group's sum is the gradient
                dist.all_reduce(dh_full)
            assert _rel(dh_full, r64[0].grad[mine]) <= tol, (reduction, dh)
            assert _rel(ww.grad, r64[1].grad[own]) <= tol, (reduction, dh)
            assert _rel(bb.grad, r64[2].grad[own]) <= tol, (reduction, dh)
            assert _rel(ww.grad, one[1].grad[own]) <= tol and _rel(dh_full, one[0].grad[mine]) <= tol


@pytest.mark.parametrize("dtype, formula", [(torch.float32, "pytorch"), (torch.bfloat16, "pytorch"),
                                            (torch.float32, "megatron")])
def test_gloo_tp_class_weight_with_smoothing(dtype, formula):
    run_world(2, _tp_class_weight_with_smoothing, int(torch.randint(1 << 30, ())), dtype, formula)
