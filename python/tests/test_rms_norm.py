"""fusedloss.rms_norm / RMSNorm against a float64 reference written from the definition: every
variant (eps, zero-centred gamma, weight dtypes, fused residual), every layout torch allows,
torch.compile fullgraph, determinism, bad inputs with clear errors, and a property test."""
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import fusedloss
from layouts import LAYOUTS, leaf

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(actual, expected, tol):
    expected = expected.detach().double().cpu()
    scale = expected.abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(actual.detach().double().cpu(), expected, rtol=tol, atol=tol * max(scale, 1e-6))


# weight layouts: (elements of the base per weight element, 0: one value expanded to all)
_WEIGHT_VIEWS = {"contiguous": 1, "sliced": 2, "expanded": 0}


def run(device, dtype=torch.float32, shape=(37, 256), wdtype=None, eps=1e-5, zc=False,
        residual=False, layout="contiguous", use_s=False, w_layout="contiguous", r_layout="contiguous"):
    gen = torch.Generator().manual_seed(1234)
    wdtype = wdtype or dtype
    H = shape[-1]
    xb, xview = leaf(layout, shape, dtype, device, gen, scale=2.0)
    # the weight: contiguous, every other element of a longer vector, or one value expanded
    per = _WEIGHT_VIEWS[w_layout]
    wview = {1: lambda b: b, 2: lambda b: b[::2], 0: lambda b: b.expand(H)}[per]
    w0 = torch.randn(max(H * per, 1), generator=gen, dtype=torch.float64) * 0.3 + (0.0 if zc else 1.0)
    wb = w0.to(wdtype).to(device).requires_grad_(True)
    w = wview(wb)
    x = xview(xb)
    r = None
    if residual:
        rb, rview = leaf(r_layout, shape, dtype, device, gen)
        r = rview(rb)
    out = fusedloss.rms_norm(x, w, eps=eps, zero_centered_gamma=zc, residual=r)
    # reference: float64 from the same stored values; s rounded to the dtype like the kernels
    x64b = xb.detach().double().cpu().requires_grad_(True)  # the reference runs on the CPU
    x64 = xview(x64b)
    w64b = wb.detach().double().cpu().requires_grad_(True)
    w64 = wview(w64b)
    if residual:
        r64b = rb.detach().double().cpu().requires_grad_(True)
        r64 = rview(r64b)
        s_stored = (x.detach().float() + r.detach().float()).to(dtype).double().cpu()
        # the gradient flows to x and r unchanged through the sum; the value is the stored one
        s64 = x64 + r64 + (s_stored - (x64 + r64)).detach()
    else:
        s64 = x64
    gamma = w64 + 1 if zc else w64
    y64 = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + eps) * gamma
    tol = TOL[dtype]
    y = out[0] if residual else out
    assert y.dtype == dtype and y.shape == torch.Size(shape)
    _close(y, y64, tol)
    gy = torch.randn(shape, generator=gen, dtype=torch.float64)
    loss, loss64 = (y.double() * gy.to(device)).sum(), (y64 * gy).sum()
    if residual:
        s = out[1]
        assert s.dtype == dtype and s.shape == torch.Size(shape)
        _close(s, s_stored, 0)
        if use_s:
            gs = torch.randn(shape, generator=gen, dtype=torch.float64)
            loss, loss64 = loss + (s.double() * gs.to(device)).sum(), loss64 + (s64 * gs).sum()
    loss.backward()
    loss64.backward()

    def check_dx(actual, expected):
        if H > 1:
            return _close(actual, expected, tol)
        # H = 1: dx = rstd dy gamma (1 - xhat^2) with xhat^2 ~ 1, measured against the terms
        t = (torch.rsqrt(s64.detach().pow(2) + eps) * gy * gamma.detach()).abs()
        terms = t.max().item() if t.numel() else 1.0
        torch.testing.assert_close(actual.double().cpu(), expected, rtol=0, atol=tol * max(terms, 1e-6))

    check_dx(xb.grad, x64b.grad)
    assert xb.grad.dtype == dtype
    assert wb.grad.dtype == wdtype and wb.grad.shape == wb.shape
    # returned in the weight's dtype; an expanded weight's H entries are then summed in it.
    # dw is a sum over rows of dy * xhat with dy rounded to the input's dtype: its error scales
    # with the sum of the terms' magnitudes, not with the sum (which may cancel: H = 1 rows,
    # xhat = +-1, fp16 dy).
    xhat64 = (s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + eps)).detach()
    terms = (gy * xhat64).abs().reshape(-1, H).sum(0).max().item() if gy.numel() else 0.0
    wtol = max(tol, TOL.get(wdtype, 2e-5)) * (H if per == 0 else 1)
    torch.testing.assert_close(wb.grad.double().cpu(), w64b.grad, rtol=wtol,
                               atol=wtol * max(terms, w64b.grad.abs().max().item(), 1e-6))
    if residual:
        check_dx(rb.grad, r64b.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_plain(device, dtype):
    run(device, dtype)


@pytest.mark.parametrize("dtype,wdtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                          (torch.float16, torch.float32), (torch.float32, torch.float16),
                                          (torch.bfloat16, torch.float16), (torch.float32, torch.float64)])
def test_weight_dtype_differs(device, dtype, wdtype):
    run(device, dtype, wdtype=wdtype)


@pytest.mark.parametrize("eps", [1e-6, 0.25])
@pytest.mark.parametrize("zc", [False, True])
def test_eps_and_zero_centered_gamma(device, eps, zc):
    run(device, eps=eps, zc=zc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_s", [False, True])
def test_fused_residual(device, dtype, use_s):
    run(device, dtype, residual=True, use_s=use_s)


def test_megatron_3d_layout(device):
    run(device, shape=(16, 2, 96))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(6, 40), (3, 2, 9)])
def test_layouts(device, layout, shape):
    run(device, shape=shape, layout=layout)


@pytest.mark.parametrize("shape", [(0, 8), (5, 1), (1, 1)])
def test_edge_shapes(device, shape):
    run(device, shape=shape)


def test_rows_of_zeros_are_finite(device):
    x = torch.zeros(4, 64, device=device, requires_grad=True)
    w = torch.ones(64, device=device, requires_grad=True)
    y = fusedloss.rms_norm(x, w)
    y.backward(torch.randn_like(y))
    assert torch.equal(y, torch.zeros_like(y))
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


def test_matches_torch_rms_norm(device):
    x = torch.randn(33, 128, device=device)
    w = torch.randn(128, device=device)
    torch.testing.assert_close(fusedloss.rms_norm(x, w, eps=1e-6),
                               torch.nn.functional.rms_norm(x, (128,), w, eps=1e-6), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_eps_none_is_torchs_default(device, dtype):
    """eps=None adds what torch's rms_norm adds for eps=None (the fp32 epsilon for every dtype),
    in the function and in the module, so a torch.nn.RMSNorm() swapped out keeps its values;
    small activations show any other eps (1e-5 moves them by ~1)."""
    x = (torch.randn(9, 64, device=device) * 1e-3).to(dtype)
    w = torch.randn(64, device=device, dtype=dtype)
    want = torch.nn.functional.rms_norm(x.float(), (64,), w.float()).to(dtype)
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fusedloss.rms_norm(x, w, eps=None), want, **tol)
    torch.testing.assert_close(torch.nn.functional.rms_norm(x, (64,), w), want, **tol)
    ref = torch.nn.RMSNorm(64, device=device, dtype=dtype)
    mine = fusedloss.RMSNorm(64, eps=None, device=device, dtype=dtype)
    mine.load_state_dict(ref.state_dict())
    torch.testing.assert_close(mine(x), ref(x), **tol)
    assert "eps=None" in repr(mine)
    assert (fusedloss.rms_norm(x, w).float() - want.float()).abs().max() > 0.1  # the 1e-5 default


def test_deterministic(device):
    x = torch.randn(700, 256, device=device, dtype=torch.bfloat16)
    w = torch.randn(256, device=device, dtype=torch.float32)
    g = torch.randn(700, 256, device=device, dtype=torch.bfloat16)
    results = []
    for _ in range(2):
        xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        fusedloss.rms_norm(xx, ww).backward(g)
        results.append((xx.grad, ww.grad))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_module(device):
    m = fusedloss.RMSNorm(64, eps=1e-6, device=device)
    assert torch.equal(m.weight, torch.ones(64, device=device))
    mz = fusedloss.RMSNorm(64, zero_centered_gamma=True, device=device, dtype=torch.bfloat16)
    assert torch.equal(mz.weight, torch.zeros(64, device=device, dtype=torch.bfloat16))
    x = torch.randn(5, 64, device=device)
    torch.testing.assert_close(m(x), torch.nn.RMSNorm(64, eps=1e-6, device=device)(x), rtol=2e-5, atol=2e-5)
    xb = x.bfloat16()
    torch.testing.assert_close(mz(xb).float(), torch.nn.RMSNorm(64, eps=1e-5, device=device)(xb.float()),
                               rtol=2e-2, atol=2e-2)
    y, s = m(x, residual=x)
    torch.testing.assert_close(s, 2 * x)
    assert "zero_centered_gamma=True" in repr(mz)


def test_compile_fullgraph(device):
    m = fusedloss.RMSNorm(96, device=device)
    x = torch.randn(8, 96, device=device, requires_grad=True)

    def f(x, r):
        y, s = fusedloss.rms_norm(x, m.weight, 1e-5, False, r)
        return (m(x) * 2).sum() + (y * s).sum()

    r = torch.randn(8, 96, device=device, requires_grad=True)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    out = compiled(x, r)
    out.backward()
    gx, gw, gr = x.grad.clone(), m.weight.grad.clone(), r.grad.clone()
    x.grad = m.weight.grad = r.grad = None
    f(x, r).backward()
    torch.testing.assert_close(out, f(x, r))
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, m.weight.grad)
    torch.testing.assert_close(gr, r.grad)


def test_double_backward_raises(device):
    x = torch.randn(4, 16, device=device, requires_grad=True)
    w = torch.ones(16, device=device, requires_grad=True)
    (gx,) = torch.autograd.grad(fusedloss.rms_norm(x, w).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        gx.sum().backward()


@pytest.mark.parametrize("call,error,match", [
    (lambda x, w: fusedloss.rms_norm(x, w[:7]), ValueError, r"weight: got shape \(7,\), expected \(8,\)"),
    (lambda x, w: fusedloss.rms_norm(x, w.view(2, 4)), ValueError, r"weight: got shape \(2, 4\)"),
    (lambda x, w: fusedloss.rms_norm(x, w, eps=0.0), ValueError, r"eps: got 0(\.0)?, expected a finite value > 0"),
    (lambda x, w: fusedloss.rms_norm(x, w, eps=-1.0), ValueError, r"eps: got -1(\.0)?,"),
    (lambda x, w: fusedloss.rms_norm(x, w, eps=float("nan")), ValueError, "eps: got nan, expected a finite value > 0"),
    (lambda x, w: fusedloss.rms_norm(x, w, eps=float("inf")), ValueError, "eps: got inf"),
    (lambda x, w: fusedloss.rms_norm(x, w, eps="1e-5"), TypeError, "eps"),
    (lambda x, w: fusedloss.rms_norm(x.long(), w), ValueError, "x.dtype: got torch.int64"),
    (lambda x, w: fusedloss.rms_norm(x, w.long()), ValueError, "weight.dtype: got torch.int64"),
    # a list is normalized_shape (F.rms_norm's form), never a weight
    (lambda x, w: fusedloss.rms_norm(x, [1.0] * 8), TypeError,
     r"normalized_shape: got \[1.0, .*expected ints.*a weight is a tensor, not a list"),
    (lambda x, w: fusedloss.rms_norm(x[:, :0], w[:0]), ValueError, r"x: got shape \(4, 0\)"),
    (lambda x, w: fusedloss.rms_norm(x, w, residual=x.half()), ValueError, "residual: got shape"),
    (lambda x, w: fusedloss.rms_norm(x, w, residual=x[:2]), ValueError, "residual: got shape"),
    (lambda x, w: fusedloss.rms_norm(x, w, zero_centered_gamma=1), TypeError, "zero_centered_gamma"),
    (lambda x, w: fusedloss.RMSNorm(0), ValueError, "hidden_size: got 0"),
    (lambda x, w: fusedloss.RMSNorm(8.0), TypeError, "hidden_size"),
    (lambda x, w: fusedloss.RMSNorm(8, eps=0), ValueError, r"eps: got 0(\.0)?,"),
])
def test_bad_inputs(call, error, match):
    x, w = torch.randn(4, 8), torch.ones(8)
    with pytest.raises(error, match=match):
        call(x, w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_mismatch():
    with pytest.raises(ValueError, match="weight.device"):
        fusedloss.rms_norm(torch.randn(4, 8, device="cuda"), torch.ones(8))


# ---- property test: shapes, layouts, dtypes, options ----

DEVICE = os.environ.get("FUSEDLOSS_PROPERTY_DEVICE", "cpu")
EXAMPLES = int(os.environ.get("FUSEDLOSS_PROPERTY_EXAMPLES", "40"))


@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_property(data):
    draw = data.draw
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    wdtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
    # short rows, and rows long enough for the CUDA kernels that give a thread 2 to 8 vectors
    # (the backward holds their weights across rows; fp16 holds 2 of 4, fp32 4 of 8); fp32 8200
    # (17 warps) stays one block and the forward reads it twice; 12288 / 16384 fp32 and 24576
    # 16-bit rows are split over a cluster of 2 in the backward (sm_90)
    cols = draw(st.one_of(st.integers(1, 70),
                          st.sampled_from([520, 1032, 2056, 4104, 8200, 12288, 16384, 24576])))
    rows = draw(st.integers(0, 9))
    shape = (rows, cols) if draw(st.booleans()) else (draw(st.integers(1, 3)), rows, cols)
    n = 1
    for d in shape[:-1]:
        n *= d
    layout = draw(st.sampled_from(LAYOUTS)) if n > 1 else "contiguous"
    residual = draw(st.booleans())
    run(DEVICE, dtype, shape=shape, wdtype=wdtype, eps=draw(st.sampled_from([1e-6, 1e-5, 0.1])),
        zc=draw(st.booleans()), residual=residual, layout=layout, use_s=draw(st.booleans()),
        w_layout=draw(st.sampled_from(sorted(_WEIGHT_VIEWS))),
        r_layout=draw(st.sampled_from(LAYOUTS)) if residual and n > 1 else "contiguous")
