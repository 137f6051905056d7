"""fusedloss.rms_norm's two call forms: torch.nn.functional.rms_norm's (x, normalized_shape,
weight=None, eps=None) and the weight-first (x, weight, eps=1e-5, ...), against float64
references; the eps defaults; the errors that name a call fitting neither form."""
import pytest
import torch
import torch.nn.functional as F

import fusedloss

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
FP32_EPS = torch.finfo(torch.float32).eps


def reference(x, dims, weight, eps):
    """float64 RMSNorm over the trailing len(dims) dims."""
    axes = tuple(range(x.dim() - len(dims), x.dim()))
    y = x * torch.rsqrt(x.pow(2).mean(axes, keepdim=True) + eps)
    return y * weight if weight is not None else y


def _close(got, want, dtype):
    tol = TOL[dtype]
    scale = max(1.0, want.abs().max().item() if want.numel() else 1.0)
    torch.testing.assert_close(got.double().cpu(), want.detach().double().cpu(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape_arg", [64, (64,), [64], torch.Size([64]), (4, 64)])
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_f_rms_norm_form(device, dtype, shape_arg, with_weight, eps):
    """rms_norm(x, normalized_shape, weight, eps) is F.rms_norm's call: values and every gradient
    against float64, and the same as F.rms_norm itself; weight=None is gamma = 1."""
    dims = (shape_arg,) if isinstance(shape_arg, int) else tuple(shape_arg)
    x = (torch.randn(3, 4, 64, dtype=torch.float64) * 2).to(dtype).to(device).requires_grad_(True)
    w = (torch.rand(dims, dtype=torch.float64) + 0.5).to(dtype).to(device).requires_grad_(True) if with_weight else None
    y = fusedloss.rms_norm(x, shape_arg, w, eps)
    assert y.shape == x.shape and y.dtype == dtype
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True) if w is not None else None
    ref = reference(x64, dims, w64, FP32_EPS if eps is None else eps)
    _close(y, ref, dtype)
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g.double())
    _close(x.grad, x64.grad, dtype)
    if w is not None:
        assert w.grad.shape == w.shape and w.grad.dtype == w.dtype
        _close(w.grad, w64.grad, dtype)
    # torch's own op takes the same call
    torch_y = F.rms_norm(x.detach().float(), dims, None if w is None else w.detach().float(), eps)
    _close(y.float(), torch_y.double(), dtype)


def test_keywords_and_defaults(device):
    x = torch.randn(5, 32, device=device) * 1e-3  # small activations show any other eps
    w = torch.rand(32, device=device) + 0.5
    torch.testing.assert_close(fusedloss.rms_norm(x, normalized_shape=(32,), weight=w),
                               F.rms_norm(x, (32,), w), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(fusedloss.rms_norm(x, (32,)), F.rms_norm(x, (32,)), rtol=2e-5, atol=2e-5)
    # the weight-first form keeps its 1e-5 default
    torch.testing.assert_close(fusedloss.rms_norm(x, w), F.rms_norm(x, (32,), w, 1e-5), rtol=2e-5, atol=2e-5)
    assert torch.equal(fusedloss.rms_norm(x, w), fusedloss.rms_norm(x, w, 1e-5))
    assert torch.equal(fusedloss.rms_norm(x, weight=w), fusedloss.rms_norm(x, w, 1e-5))
    # the module's default is torch.nn.RMSNorm's
    m = fusedloss.RMSNorm(32, device=device)
    assert m.eps is None and "eps=None" in repr(m)
    torch.testing.assert_close(m(x), torch.nn.RMSNorm(32, device=device)(x), rtol=2e-5, atol=2e-5)


def test_residual_and_zero_centered_gamma_in_the_f_form(device):
    x = torch.randn(3, 4, 16, device=device, requires_grad=True)
    r = torch.randn(3, 4, 16, device=device, requires_grad=True)
    w = (torch.randn(4, 16, device=device) * 0.1).requires_grad_(True)
    y, s = fusedloss.rms_norm(x, (4, 16), w, 1e-6, zero_centered_gamma=True, residual=r)
    x64, r64, w64 = (t.detach().double().requires_grad_(True) for t in (x, r, w))
    s64 = x64 + r64
    ref = reference(s64, (4, 16), w64 + 1, 1e-6)
    _close(y, ref, torch.float32)
    _close(s, s64, torch.float32)
    (y.square().sum() + s.sum()).backward()
    (ref.square().sum() + s64.sum()).backward()
    for got, want in ((x, x64), (r, r64), (w, w64)):
        _close(got.grad, want.grad, torch.float32)
    # no weight: gamma = 1 whatever zero_centered_gamma says of a weight
    torch.testing.assert_close(fusedloss.rms_norm(x, 16, zero_centered_gamma=True), F.rms_norm(x, (16,)),
                               rtol=2e-5, atol=2e-5)


def test_f_form_layouts_and_compile(device):
    """Transposed and sliced inputs over several normalised dims; compiled with fullgraph."""
    base = torch.randn(16, 6, 8, device=device, requires_grad=True)
    x = base.transpose(0, 1)[:, ::2]  # [6, 8, 8], unflattenable trailing dims
    w = torch.rand(8, 8, device=device, requires_grad=True)
    y = fusedloss.rms_norm(x, (8, 8), w)
    b64, w64 = base.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    ref = reference(b64.transpose(0, 1)[:, ::2], (8, 8), w64, FP32_EPS)
    _close(y, ref, torch.float32)
    y.sum().backward()
    ref.sum().backward()
    _close(base.grad, b64.grad, torch.float32)
    _close(w.grad, w64.grad, torch.float32)
    f = torch.compile(lambda x, w: fusedloss.rms_norm(x, (x.size(-1),), w, None), fullgraph=True,
                      backend="aot_eager")
    x2 = torch.randn(4, 8, device=device)
    torch.testing.assert_close(f(x2, w[0]), F.rms_norm(x2, (8,), w[0]), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("call,error,match", [
    # a tensor where normalized_shape goes (the weight-first form mixed with F.rms_norm's names)
    (lambda x, w: fusedloss.rms_norm(x, normalized_shape=w), TypeError,
     r"normalized_shape: got a tensor of shape \(8,\).*expected ints.*rms_norm\(x, normalized_shape, weight\)"),
    (lambda x, w: fusedloss.rms_norm(x, torch.tensor([8])), ValueError,
     r"weight.dtype: got torch.int64, expected a floating-point dtype \(a weight \[H\]; "
     r"normalized_shape, F.rms_norm's second argument, takes ints as a tuple"),
    # a float where the weight goes (eps third, as in the weight-first form)
    (lambda x, w: fusedloss.rms_norm(x, (8,), 1e-6), TypeError,
     r"weight: got 1e-06 \(float\), expected a tensor of shape normalized_shape or None \(eps is the "
     r"fourth argument in F.rms_norm's order\)"),
    # a shape where eps goes (F.rms_norm's order with the weight first)
    (lambda x, w: fusedloss.rms_norm(x, w, (8,)), TypeError,
     r"eps: got \(8,\) \(tuple\), expected a float.*rms_norm\(x, normalized_shape, weight, eps\)"),
    (lambda x, w: fusedloss.rms_norm(x, w, w), TypeError, r"eps: got a tensor of shape \(8,\)"),
    (lambda x, w: fusedloss.rms_norm(x, (4,), w), ValueError,
     r"normalized_shape: got \(4,\), expected x's trailing dims \(x has shape \(3, 8\)\)"),
    (lambda x, w: fusedloss.rms_norm(x, (3, 8), w), ValueError,
     r"weight: got shape \(8,\), expected normalized_shape \(3, 8\)"),
    (lambda x, w: fusedloss.rms_norm(x, (2, 3, 8)), ValueError, r"normalized_shape: got \(2, 3, 8\)"),
    (lambda x, w: fusedloss.rms_norm(x, ()), ValueError, r"normalized_shape: got \(\)"),
    (lambda x, w: fusedloss.rms_norm(x, (8.0,)), TypeError, r"normalized_shape: got \(8.0,\) \(tuple\), expected ints"),
    (lambda x, w: fusedloss.rms_norm(x, None), TypeError, r"normalized_shape: got None \(NoneType\)"),
    (lambda x, w: fusedloss.rms_norm(x, 1e-5), TypeError, r"normalized_shape: got 1e-05 \(float\)"),
    (lambda x, w: fusedloss.rms_norm(x), TypeError, r"weight: got None.*or give normalized_shape"),
    (lambda x, w: fusedloss.rms_norm(x, (8,), w, 1e-5, False), TypeError,
     "expected at most 4 in this form.*zero_centered_gamma and residual go by keyword"),
    (lambda x, w: fusedloss.rms_norm(x, w, 1e-5, False, None, 1), TypeError, "expected at most 5"),
    (lambda x, w: fusedloss.rms_norm(x, w, 1e-5, eps=1e-6), TypeError, "eps given twice"),
    (lambda x, w: fusedloss.rms_norm(x, w, epsilon=1e-6), TypeError, r"unknown keyword arguments \['epsilon'\]"),
    (lambda x, w: fusedloss.rms_norm(x, (8,), w, 0.0), ValueError, r"eps: got 0(\.0)?, expected a finite value > 0"),
])
def test_bad_calls_name_the_argument_and_both_forms(device, call, error, match):
    x = torch.randn(3, 8, device=device)
    w = torch.ones(8, device=device)
    before = x.clone()
    with pytest.raises(error, match=match):
        call(x, w)
    assert torch.equal(x, before)
