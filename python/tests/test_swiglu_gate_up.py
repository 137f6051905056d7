"""fusedloss.swiglu's two-tensor form swiglu(gate, up) and Falcon-H1's gate and down multipliers,
against float64 references of Hugging Face's and Liger's math (act_fn(gate) * up;
FalconH1MLP: up * silu(gate * gate_multiplier), times down_multiplier)."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fusedloss

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def reference(gate, up, bias=None, w=None, clamp=None, gm=1.0, dm=1.0):
    """float64: out = silu(gm (gate + b_gate)) clamped, times (up + b_up) clamped, w, dm."""
    a = gate + bias[: gate.size(-1)] if bias is not None else gate
    u = up + bias[gate.size(-1):] if bias is not None else up
    a = a * gm
    if clamp is not None:
        a = a.clamp(max=clamp)
        u = u.clamp(-clamp, clamp)
    out = F.silu(a) * u
    out = out * w.reshape(*out.shape[:-1], 1) if w is not None else out
    return out * dm


def _leaf64(t):
    return t.detach().double().requires_grad_(True)


def check(out, grads, ref_inputs, ref_out, g, dtype):
    """out and the op's gradients against the float64 reference's, for upstream g."""
    tol = TOL[dtype]
    scale = max(1.0, ref_out.abs().max().item() if ref_out.numel() else 1.0)
    torch.testing.assert_close(out.double().cpu(), ref_out.detach().cpu(), rtol=tol, atol=tol * scale)
    ref_g = torch.autograd.grad(ref_out, ref_inputs, g.double(), allow_unused=True)
    for got, want in zip(grads, ref_g):
        if want is None:
            continue
        gmax = want.abs().max().item() if want.numel() else 1.0
        torch.testing.assert_close(got.double().cpu(), want.cpu(), rtol=tol, atol=tol * max(gmax, 1e-6))


def run_two(device, dtype=torch.float32, shape=(33, 96), layout="separate", bias=False, weights=False,
            clamp=None, gm=1.0, dm=1.0, fp8=False, inplace=False):
    n = shape[-1]
    if layout == "halves":  # y.chunk(2, -1) of one fused projection's output
        y = (torch.randn(*shape[:-1], 2 * n, dtype=torch.float64) * 2).to(dtype).to(device).requires_grad_(True)
        src = y * 1 if inplace else y
        gate, up = src.chunk(2, -1)
        leaves = [y]
        gate0, up0 = (t.detach() for t in y.chunk(2, -1))
    else:
        g0 = (torch.randn(shape, dtype=torch.float64) * 2).to(dtype).to(device).requires_grad_(True)
        u0 = (torch.randn(shape, dtype=torch.float64) * 2).to(dtype).to(device).requires_grad_(True)
        gate, up = (g0 * 1, u0 * 1) if inplace else (g0, u0)
        if layout == "transposed":  # any strides: read as they are or copied, never wrong
            gate, up = gate.transpose(0, 1).contiguous().transpose(0, 1), up.t().contiguous().t()
        leaves = [g0, u0]
        gate0, up0 = g0.detach(), u0.detach()
    rows = gate.numel() // n
    b = (torch.randn(2 * n) * 0.3).to(dtype).to(device).requires_grad_(True) if bias else None
    w = (torch.rand(rows, 1) + 0.1).to(device).requires_grad_(True) if weights else None
    out = fusedloss.swiglu(gate, up, bias=b, per_token_scale=w, clamp_value=clamp, gate_multiplier=gm,
                           down_multiplier=dm, fp8_input_store=fp8, inplace_backward=inplace)
    assert out.shape == gate.shape and out.dtype == dtype
    gate64, up64 = _leaf64(gate0), _leaf64(up0)
    b64 = _leaf64(b) if b is not None else None
    w64 = _leaf64(w) if w is not None else None
    ref_fwd = reference(gate64, up64, b64, w64, clamp, gm, dm)
    if fp8:  # the backward sees the e4m3 copies; their gradient is gate's and up's
        gate64, up64 = _leaf64(gate0.to(torch.float8_e4m3fn)), _leaf64(up0.to(torch.float8_e4m3fn))
    ref_bwd = reference(gate64, up64, b64, w64, clamp, gm, dm)
    g = torch.randn_like(out)
    out.backward(g)
    tol = TOL[dtype]
    torch.testing.assert_close(out.double().cpu(), ref_fwd.detach().cpu(), rtol=tol,
                               atol=tol * max(1.0, ref_fwd.abs().max().item()))
    ref_grads = torch.autograd.grad(ref_bwd, [gate64, up64] + [t for t in (b64, w64) if t is not None],
                                    g.double())
    got = ([leaves[0].grad] if layout == "halves" else [leaves[0].grad, leaves[1].grad]) + \
        [t.grad for t in (b, w) if t is not None]
    want = ([torch.cat(ref_grads[:2], -1)] if layout == "halves" else list(ref_grads[:2])) + list(ref_grads[2:])
    for gt, wt in zip(got, want):
        gmax = wt.abs().max().item() if wt.numel() else 1.0
        torch.testing.assert_close(gt.double().cpu(), wt.cpu(), rtol=tol, atol=tol * max(gmax, 1e-6))
    for t in (b, w):
        if t is not None:
            assert t.grad.dtype == t.dtype and t.grad.shape == t.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["separate", "halves", "transposed"])
def test_two_tensor_form(device, dtype, layout):
    run_two(device, dtype, layout=layout)


def test_two_tensor_3d_and_every_option(device):
    for layout in ("separate", "halves"):
        run_two(device, shape=(4, 5, 24), layout=layout, bias=True, weights=True)
        run_two(device, torch.bfloat16, layout=layout, clamp=1.0)
        run_two(device, torch.float16, layout=layout, fp8=True, weights=True)
        run_two(device, layout=layout, inplace=True, bias=True, gm=2.0, dm=0.5)


@pytest.mark.parametrize("n", [1, 3, 7, 9])
def test_two_tensor_small_and_odd_n(device, n):
    run_two(device, torch.float16, shape=(5, n), layout="halves")
    run_two(device, shape=(5, n), layout="separate", inplace=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gm,dm", [(0.5, 2.0), (3.0, -0.25), (1.0, 1.0)])
def test_falcon_h1_multipliers_fused_and_two_tensor(device, dtype, gm, dm):
    """FalconH1MLP's up * silu(gate * gate_multiplier), times down_multiplier, in both forms."""
    run_two(device, dtype, layout="separate", gm=gm, dm=dm, weights=True)
    run_two(device, dtype, layout="halves", gm=gm, dm=dm, bias=True)
    y = (torch.randn(17, 2 * 40, dtype=torch.float64) * 2).to(dtype).to(device).requires_grad_(True)
    b = (torch.randn(80) * 0.3).to(device).requires_grad_(True)
    w = (torch.rand(17, 1) + 0.1).to(device).requires_grad_(True)
    out = fusedloss.swiglu(y, b, per_token_scale=w, gate_multiplier=gm, down_multiplier=dm)
    y64, b64, w64 = _leaf64(y), _leaf64(b), _leaf64(w)
    ref = reference(*y64.chunk(2, -1), b64, w64, None, gm, dm)
    g = torch.randn_like(out)
    out.backward(g)
    check(out, [y.grad, b.grad, w.grad], [y64, b64, w64], ref, g, dtype)


def test_falcon_h1_mlp_as_transformers_writes_it(device):
    """FalconH1MLP.forward (transformers' modeling_falcon_h1.py), mlp_bias=False, with the
    activation swapped: the same loss and every gradient as the unfused module."""
    torch.manual_seed(0)
    H, I, gm, dm = 16, 40, 0.75, 1.5
    gate_proj, up_proj, down_proj = (torch.nn.Linear(*s, bias=False, dtype=torch.float64).to(device)
                                     for s in ((H, I), (H, I), (I, H)))
    x = torch.randn(3, 7, H, dtype=torch.float64, device=device)

    def falcon(act):
        for m in (gate_proj, up_proj, down_proj):
            m.zero_grad()
        return down_proj(act(gate_proj(x), up_proj(x))) * dm

    ref = falcon(lambda g, u: u * F.silu(g * gm))
    ref.square().sum().backward()
    ref_grads = [m.weight.grad.clone() for m in (gate_proj, up_proj, down_proj)]
    fused = falcon(lambda g, u: fusedloss.swiglu(g.float(), u.float(), gate_multiplier=gm).double())
    # down_multiplier inside the op: the projection is linear (no bias), so scaling its input
    # is scaling its output
    fused2 = down_proj(fusedloss.swiglu(gate_proj(x).float(), up_proj(x).float(), gate_multiplier=gm,
                                        down_multiplier=dm).double())
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused2, ref, rtol=1e-5, atol=1e-5)
    for m in (gate_proj, up_proj, down_proj):
        m.zero_grad()
    fused2.square().sum().backward()
    for m, want in zip((gate_proj, up_proj, down_proj), ref_grads):
        torch.testing.assert_close(m.weight.grad, want, rtol=1e-4, atol=1e-5)


def test_halves_of_one_buffer_are_the_fused_form_bit_for_bit(device):
    """gate, up = y.chunk(2, -1): the same kernels, the same bits as swiglu(y), and no copy."""
    for dtype in (torch.float32, torch.bfloat16):
        y = torch.randn(9, 2, 2 * 24, dtype=dtype, device=device, requires_grad=True)
        b = torch.randn(48, device=device, requires_grad=True)
        out = fusedloss.swiglu(y, b, gate_multiplier=1.25, down_multiplier=0.5)
        g = torch.randn_like(out)
        dy, db = torch.autograd.grad(out, (y, b), g)
        out2 = fusedloss.swiglu(*y.chunk(2, -1), bias=b, gate_multiplier=1.25, down_multiplier=0.5)
        dy2, db2 = torch.autograd.grad(out2, (y, b), g)
        assert torch.equal(out, out2) and torch.equal(dy, dy2) and torch.equal(db, db2)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_no_copy_of_gate_and_up(device):
    """Neither two separate tensors nor the halves of one buffer are copied (no cat, clone,
    copy or contiguous of them) by the forward; the in-place backward writes the gradients into
    gate's and up's own memory (the halves': the fused buffer's)."""
    x = torch.randn(8, 2 * 32, device=device, requires_grad=True)
    fusedloss.swiglu(x[:, :32], x[:, 32:])  # first use: the op probes torch's fp8 cast once
    for make in (lambda h: h.chunk(2, -1), lambda h: (h[:, :32] * 1, h[:, 32:] * 1)):
        h = x * 1
        gate, up = make(h)
        with _Ops() as ops:
            out = fusedloss.swiglu(gate, up, inplace_backward=True)
        assert ops.names and all(n.startswith("empty") for n in ops.names), ops.names  # allocations only
        g = torch.randn_like(out)
        gate_before, up_before = gate.detach().clone(), up.detach().clone()
        out.backward(g)
        ref_g, ref_u = gate_before.double().requires_grad_(), up_before.double().requires_grad_()
        dg, du = torch.autograd.grad(reference(ref_g, ref_u), (ref_g, ref_u), g.double())
        torch.testing.assert_close(gate.detach().double(), dg, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(up.detach().double(), du, rtol=2e-5, atol=2e-5)
        x.grad = None


def test_two_tensor_in_place_refuses_shared_and_owned_memory(device):
    """One tensor as gate and up, or a leaf: the gradients go to new buffers (warned), right."""
    t = (torch.randn(6, 10, device=device, requires_grad=True))
    h = t * 1
    with pytest.warns(UserWarning, match="gate and up share memory"):
        out = fusedloss.swiglu(h, h, inplace_backward=True)
    out.sum().backward()
    t64 = _leaf64(t)
    reference(t64, t64).sum().backward()
    torch.testing.assert_close(t.grad.double(), t64.grad, rtol=2e-5, atol=2e-5)
    g0 = torch.randn(6, 10, device=device, requires_grad=True)
    u0 = torch.randn(6, 10, device=device, requires_grad=True)
    before = g0.detach().clone(), u0.detach().clone()
    with pytest.warns(UserWarning, match="not overwritten"):
        fusedloss.swiglu(g0, u0, inplace_backward=True).sum().backward()
    assert torch.equal(g0.detach(), before[0]) and torch.equal(u0.detach(), before[1])


def test_two_tensor_in_place_second_backward_raises(device):
    x = torch.randn(4, 16, device=device, requires_grad=True)
    gate, up = (x * 1).chunk(2, -1)
    out = fusedloss.swiglu(gate, up, inplace_backward=True)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward .* inplace_backward=True"):
        out.sum().backward()


def test_module_two_tensor_form(device):
    m = fusedloss.SwiGLU(gate_multiplier=2.0, down_multiplier=0.5)
    gate, up = torch.randn(5, 8, device=device), torch.randn(5, 8, device=device)
    torch.testing.assert_close(m(gate, up), (F.silu(gate * 2.0) * up * 0.5), rtol=2e-5, atol=2e-5)
    assert "gate_multiplier=2.0" in repr(m)
    with pytest.raises(ValueError, match="gate_multiplier: got inf"):
        fusedloss.SwiGLU(gate_multiplier=float("inf"))


def test_two_tensor_through_custom_ops(device):
    """Under torch.compile's fake tensors and the traced path: the custom ops' fake functions
    agree with the kernels' shapes (torch.library.opcheck)."""
    gate = torch.randn(6, 8, device=device, requires_grad=True)
    up = torch.randn(6, 8, device=device, requires_grad=True)
    op = torch.ops.fusedloss.swiglu_gate_up_fwd.default
    torch.library.opcheck(op, (gate, up, None, None, None, 1.5, 0.5, False, False),
                          test_utils=("test_faketensor",))
    compiled = torch.compile(lambda g, u: fusedloss.swiglu(g, u, gate_multiplier=1.5), fullgraph=True,
                             backend="aot_eager")
    out = compiled(gate, up)
    out.sum().backward()
    g64, u64 = _leaf64(gate), _leaf64(up)
    reference(g64, u64, gm=1.5).sum().backward()
    torch.testing.assert_close(gate.grad.double(), g64.grad, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(up.grad.double(), u64.grad, rtol=2e-5, atol=2e-5)


def test_bad_inputs(device):
    y = torch.randn(4, 8, device=device)
    gate, up = y.chunk(2, -1)
    b = torch.randn(8, device=device)
    with pytest.raises(ValueError, match=r"swapped\? The fused form is swiglu\(y, bias\)"):
        fusedloss.swiglu(b, y)
    with pytest.raises(ValueError, match=r"up: got shape \(4, 3\), expected gate's shape \(4, 4\)"):
        fusedloss.swiglu(gate, up[:, :3])
    with pytest.raises(ValueError, match=r"up: got shape \(3, 4\), expected gate's shape \(4, 4\).*"
                                         r"bias of shape \(4,\)"):
        fusedloss.swiglu(gate, up[:3])
    with pytest.raises(ValueError, match=r"per-token scale \[T, 1\] goes by keyword"):
        fusedloss.swiglu(y, torch.ones(4, 1, device=device))
    with pytest.raises(ValueError, match=r"up.dtype: got torch.float16, expected gate's torch.float32"):
        fusedloss.swiglu(gate, up.half())
    with pytest.raises(TypeError, match="bias given twice"):
        fusedloss.swiglu(y, b, bias=b)
    with pytest.raises(TypeError, match="second argument: got list, expected a torch.Tensor"):
        fusedloss.swiglu(y, [1.0] * 8)
    with pytest.raises(TypeError, match="first argument: got list"):
        fusedloss.swiglu([1.0], y)
    with pytest.raises(ValueError, match=r"bias: got shape \(4,\), expected \(8,\) = \[2n\] \(the gate's bias"):
        fusedloss.swiglu(gate, up, bias=b[:4])
    with pytest.raises(ValueError, match=r"per_token_scale: got shape \(3, 1\), expected \(4, 1\)"):
        fusedloss.swiglu(gate, up, per_token_scale=torch.ones(3, 1, device=device))
    with pytest.raises(ValueError, match=r"gate: got shape \(4, 0\), expected \[..., n\] with n >= 1"):
        fusedloss.swiglu(y[:, :0], y[:, :0])
    with pytest.raises(ValueError, match=r"y: got shape \(4, 7\).*swiglu\(gate, up\)"):
        fusedloss.swiglu(y[:, :7])
    for name, value, pattern in (("gate_multiplier", float("nan"), "gate_multiplier: got nan, expected a finite"),
                                 ("down_multiplier", float("inf"), "down_multiplier: got inf, expected a finite"),
                                 ("gate_multiplier", "2", "gate_multiplier: got '2' \\(str\\)")):
        with pytest.raises((ValueError, TypeError), match=pattern):
            fusedloss.swiglu(gate, up, **{name: value})
        with pytest.raises((ValueError, TypeError), match=pattern):
            fusedloss.swiglu(y, **{name: value})
    with pytest.raises(ValueError, match="fp8_input_store=True: the fp8 store frees the input"):
        fusedloss.swiglu(gate, up, fp8_input_store=True, inplace_backward=True)
    if device == "cuda":
        with pytest.raises(ValueError, match="up.device: got cpu, expected cuda"):
            fusedloss.swiglu(gate, up.cpu())
    # nothing was written before the errors
    assert torch.equal(torch.cat([gate, up], -1), y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the plain calls warn about nothing
        fusedloss.swiglu(gate, up)
        fusedloss.swiglu(y, b)
