"""fusedloss.swiglu against a float64 reference of Megatron's math, every variant."""
import pytest
import torch
import torch.nn.functional as F

import fusedloss


def reference(y, bias=None, w=None, clamp=None, y_bwd=None):
    """float64 forward from y; backward (autograd) through y_bwd (the e4m3 copy, if any)."""
    def f(v, b, ww):
        v = v + b if b is not None else v
        a, u = v.chunk(2, -1)
        if clamp is not None:
            a = a.clamp(max=clamp)
            u = u.clamp(-clamp, clamp)
        out = F.silu(a) * u
        return out * ww if ww is not None else out
    v = (y_bwd if y_bwd is not None else y).detach().double().requires_grad_(True)
    b = bias.detach().double().requires_grad_(True) if bias is not None else None
    ww = w.detach().double().requires_grad_(True) if w is not None else None
    out_fwd = f(y.detach().double(), b.detach() if b is not None else None, ww.detach() if ww is not None else None)
    return out_fwd, f(v, b, ww), v, b, ww


TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def run(device, dtype=torch.float32, shape=(33, 2 * 96), bias=False, weights=False, clamp=None,
        fp8=False, in_place=False):
    y0 = (torch.randn(shape, dtype=torch.float64) * 2).to(dtype).to(device)
    rows = y0.numel() // shape[-1]
    b = (torch.randn(shape[-1]) * 0.3).to(dtype).to(device).requires_grad_(True) if bias else None
    w = (torch.rand(rows, 1) + 0.1).to(device).requires_grad_(True) if weights else None
    y = y0.clone().requires_grad_(True)
    inp = y * 1 if in_place else y
    out = fusedloss.swiglu(inp, b, per_token_scale=w, clamp_value=clamp, fp8_input_store=fp8, inplace_backward=in_place)
    y_bwd = y0.to(torch.float8_e4m3fn).to(dtype) if fp8 else None
    ref_out, ref_graph, v, rb, rw = reference(y0, b, w.view(-1, 1) if w is not None else None, clamp, y_bwd)
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    g = torch.randn_like(out)
    out.backward(g)
    ref_graph.backward(g.double())
    torch.testing.assert_close(y.grad.double(), v.grad, rtol=tol, atol=tol * (v.grad.abs().max().item() if v.numel() else 1.0))
    if bias:
        torch.testing.assert_close(b.grad.double(), rb.grad, rtol=tol, atol=tol * rb.grad.abs().max().item())
    if weights:
        torch.testing.assert_close(w.grad.double(), rw.grad, rtol=tol, atol=tol * rw.grad.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_plain(device, dtype):
    run(device, dtype)


def test_megatron_3d_layout(device):
    run(device, shape=(16, 2, 2 * 40))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias(device, dtype):
    run(device, dtype, bias=True, shape=(300, 64))


def test_weighted(device):
    run(device, weights=True)


@pytest.mark.parametrize("clamp", [0.5, 3.0])
def test_clamp(device, clamp):
    run(device, clamp=clamp, weights=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamp_keeps_nan_as_torch(device, dtype):
    # torch.clamp keeps a NaN; fminf / fmaxf would have turned it into the bound
    y = torch.randn(6, 2 * 8, device=device, dtype=dtype)
    y[0, 1] = y[1, 9] = y[2, 3] = y[2, 11] = float("nan")  # gate, up, both of one column
    y[3, 2] = y[4, 10] = float("inf")
    y[5, 4] = y[5, 12] = -float("inf")
    got = fusedloss.swiglu(y, clamp_value=2.0)
    want, *_ = reference(y, clamp=2.0)
    assert torch.equal(got.isnan().cpu(), want.isnan()), (got, want)
    torch.testing.assert_close(got.double().cpu(), want, rtol=TOL[dtype], atol=TOL[dtype],
                               equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_input_store(device, dtype):
    run(device, dtype, fp8=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place(device, dtype):
    run(device, dtype, in_place=True, bias=True)


@pytest.mark.parametrize("n", [1, 3, 7])
def test_small_and_odd_n(device, n):
    run(device, shape=(5, 2 * n))
    run(device, shape=(0, 2 * n))


def test_in_place_second_backward_raises(device):
    y = torch.randn(8, 32, device=device, requires_grad=True)
    out = fusedloss.swiglu(y * 1, inplace_backward=True).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        out.backward()


@pytest.mark.parametrize("alias", ["bias", "per_token_scale", "grad_out"])
def test_in_place_with_inputs_that_are_views_of_y(device, alias):
    """The in-place backward overwrites y while it reads the bias, the scale and the upstream
    gradient: passed as views of y's own memory they must still be read as they were."""
    y0 = torch.randn(6, 8, dtype=torch.float64, device=device)
    up = torch.randn(6, 4, dtype=torch.float64, device=device)

    def grad_of_y(fused):
        leaf = y0.clone().requires_grad_(True) if not fused else y0.float().requires_grad_(True)
        y = leaf * 1  # an intermediate: eligible for the in-place backward
        kw = {}
        if alias == "bias":
            kw["bias"] = y[0]
        elif alias == "per_token_scale":
            kw["per_token_scale"] = y.view(-1)[:6].view(6, 1)
        if fused:
            out = fusedloss.swiglu(y, kw.get("bias"), per_token_scale=kw.get("per_token_scale"),
                                   inplace_backward=True)
        else:
            v = y + kw["bias"] if "bias" in kw else y
            a, u = v.chunk(2, -1)
            out = F.silu(a) * u * (kw["per_token_scale"] if "per_token_scale" in kw else 1)
        # grad_out: y's first 24 elements as a contiguous [6, 4] view (one that needs no copy)
        g = up.to(out.dtype) if alias != "grad_out" else y.detach().reshape(-1)[:24].view(6, 4)
        if alias == "grad_out" and not fused:
            g = g.clone()
        out.backward(g)
        return leaf.grad

    torch.testing.assert_close(grad_of_y(True).double(), grad_of_y(False), rtol=1e-5, atol=1e-5)


def test_module_checks_the_option_pair_at_construction():
    with pytest.raises(ValueError, match="inplace_backward=True with fp8_input_store=True"):
        fusedloss.SwiGLU(fp8_input_store=True, inplace_backward=True)
    with pytest.raises(ValueError, match="inplace_backward=True with fp8_input_store=True"):
        fusedloss.SwiGLU(fp8_input_store=True, in_place=True)
    fusedloss.SwiGLU(fp8_input_store=True)


def test_bad_inputs(device):
    y = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match=r"y: got shape \(4, 7\)"):
        fusedloss.swiglu(torch.randn(4, 7, device=device))
    with pytest.raises(ValueError, match=r"bias: got shape \(6,\)"):
        fusedloss.swiglu(y, torch.randn(6, device=device))
    with pytest.raises(ValueError, match=r"per_token_scale: got shape \(3, 1\)"):
        fusedloss.swiglu(y, per_token_scale=torch.rand(3, 1, device=device))
    # T scales in another row order than y's ([b, s, 1] for an [s, b, 2n] y), or without the
    # trailing 1: refused, not read flattened
    y3 = torch.randn(2, 3, 8, device=device)
    for shape in [(3, 2, 1), (6,), (2, 3), (6, 1, 1)]:
        with pytest.raises(ValueError, match=r"per_token_scale: got shape .* expected \(6, 1\) = \[T, 1\] "
                                             r"or \(2, 3, 1\)"):
            fusedloss.swiglu(y3, per_token_scale=torch.rand(shape, device=device))
    for shape in [(6, 1), (2, 3, 1)]:  # both read in y's row order
        w = torch.rand(shape, device=device)
        ref = torch.nn.functional.silu(y3[..., :4]) * y3[..., 4:] * w.view(2, 3, 1)
        torch.testing.assert_close(fusedloss.swiglu(y3, per_token_scale=w), ref)
    with pytest.raises(ValueError, match="inplace_backward=True with fp8_input_store=True"):
        fusedloss.swiglu(y, fp8_input_store=True, inplace_backward=True)
    with pytest.raises(ValueError, match="y.dtype: got torch.float64"):
        fusedloss.swiglu(y.double())


def test_fp8_store_rounds_like_torch_at_every_boundary(device):
    """The e4m3 copy (backward reads only it) must round as torch's float8_e4m3fn cast does:
    ties to even, subnormals, the largest finite 448 and NaN from 480 up. Recovered exactly
    from d_gate = g * silu'(1) * up8 with gate 1.0 (exact in e4m3)."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = e4m3[torch.isfinite(e4m3)].unique()
    mids = (finite[:-1] + finite[1:]) / 2  # ties: must go to the even neighbour
    probes = torch.cat([finite, mids, mids.nextafter(torch.tensor(-1e9)), mids.nextafter(torch.tensor(1e9)),
                        torch.tensor([464.0, 479.9, 480.0, 1e4, 2.0 ** -10, 2.0 ** -11])])
    up = torch.cat([probes, -probes])
    y = torch.stack([torch.ones_like(up), up], dim=1).to(device).requires_grad_(True)  # n = 1
    fusedloss.swiglu(y, fp8_input_store=True).backward(torch.ones(up.numel(), 1, device=device))
    s = torch.sigmoid(torch.tensor(1.0, dtype=torch.float64))
    dsilu1 = s * (1 + (1 - s))
    up8 = up.to(torch.float8_e4m3fn).double()
    torch.testing.assert_close(y.grad[:, 0].cpu().double(), dsilu1 * up8, rtol=1e-6, atol=0.0,
                               equal_nan=True)
