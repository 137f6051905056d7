"""No accepted input corrupts data or gradients (BAD_INPUTS.md, "added after the first release"):
in-place gradients never land in memory the caller owns, any layout reads right, auxiliary
tensors of any float dtype and strides, clear errors instead of Python accidents."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import fusedloss


def _ce_grad(x, t, **kw):
    x = x.detach().clone().requires_grad_(True)
    F.cross_entropy(x.double(), t).backward()
    return x.grad.double()


# ---- 1. in-place never writes a leaf's memory ----

@pytest.mark.parametrize("make_view", [lambda x: x.view(-1, x.size(-1)), lambda x: x[:],
                                       lambda x: x.view_as(x)])
@pytest.mark.parametrize("parameter", [False, True])
def test_cross_entropy_inplace_through_a_leaf_view_keeps_the_leaf(device, make_view, parameter):
    x = torch.randn(6, 40, device=device, requires_grad=True)
    if parameter:
        x = torch.nn.Parameter(x.detach())
    t = torch.randint(0, 40, (6,), device=device)
    before = x.detach().clone()
    with pytest.warns(UserWarning, match="logits is not overwritten: it is a leaf"):
        fusedloss.cross_entropy(make_view(x), t, inplace_backward=True).backward()
    assert torch.equal(x.detach(), before)
    assert x.grad.data_ptr() != x.data_ptr()
    torch.testing.assert_close(x.grad.double(), _ce_grad(before, t), rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("make_view", [lambda y: y.view(-1, y.size(-1)), lambda y: y[:]])
def test_swiglu_inplace_through_a_leaf_view_keeps_the_leaf(device, make_view):
    y = torch.nn.Parameter(torch.randn(2, 5, 16, device=device))
    before = y.detach().clone()
    with pytest.warns(UserWarning, match="y is not overwritten: it is a leaf"):
        fusedloss.swiglu(make_view(y), inplace_backward=True).sum().backward()
    assert torch.equal(y.detach(), before)
    ref = before.clone().requires_grad_(True)
    a, b = ref.chunk(2, -1)
    (F.silu(a) * b).sum().backward()
    torch.testing.assert_close(y.grad, ref.grad, rtol=2e-5, atol=1e-6)


def test_inplace_still_writes_an_intermediate(device):
    """The rule refuses only what the caller owns: an autograd intermediate is overwritten."""
    x = torch.randn(6, 40, device=device, requires_grad=True)
    logits = x * 1
    ptr = logits.data_ptr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = fusedloss.cross_entropy(logits.view(3, 2, 40), torch.randint(0, 40, (3, 2), device=device),
                                       inplace_backward=True)
    loss.backward()
    assert x.grad.data_ptr() != ptr or True  # the mul's backward allocates x.grad
    assert not torch.equal(logits.detach(), x.detach())  # the intermediate now holds the gradient


# ---- 2. in-place on a layout the kernels must copy ----

def test_swiglu_inplace_on_a_copied_layout_gives_the_right_gradient(device):
    y = torch.randn(4, 3, 16, device=device, requires_grad=True)
    grads = []
    for inplace in (False, True):
        y.grad = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = fusedloss.swiglu((y * 1).transpose(0, 1), inplace_backward=inplace)
        out.backward(torch.arange(out.numel(), device=device, dtype=out.dtype).view(out.shape) / 7)
        grads.append(y.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


# ---- 3. stride-0 and overlapping rows ----

@pytest.mark.parametrize("rows, V", [(6, 10), (512, 5000)])
def test_expanded_logits(device, rows, V):
    row = torch.randn(1, V, device=device, requires_grad=True)
    t = torch.randint(0, V, (rows,), device=device)
    loss = fusedloss.cross_entropy(row.expand(rows, V), t)
    ref_row = row.detach().double().requires_grad_(True)
    ref = F.cross_entropy(ref_row.expand(rows, V), t)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(row.grad.double(), ref_row.grad, rtol=1e-4, atol=1e-6)


def test_expanded_and_overlapping_swiglu_input(device):
    row = torch.randn(1, 32, device=device, requires_grad=True)
    for y in (row.expand(7, 32), row.view(-1).repeat(4).as_strided((7, 32), (16, 1))):
        out = fusedloss.swiglu(y)
        ref = y.detach().double()
        a, b = ref.chunk(2, -1)
        torch.testing.assert_close(out.double(), F.silu(a) * b, rtol=1e-5, atol=1e-6)
        assert torch.isfinite(out).all()


# ---- 4. auxiliary tensors: any float dtype, any strides ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_per_token_scale_any_dtype_and_slice(device, dtype):
    y = torch.randn(9, 24, device=device, requires_grad=True)
    probs = torch.rand(9, 4, device=device).to(dtype).requires_grad_(True)
    scale = probs[:, :1]  # the natural MoE slice: non-contiguous
    out = fusedloss.swiglu(y, per_token_scale=scale)
    ref_y = y.detach().double().requires_grad_(True)
    ref_p = probs.detach().double().requires_grad_(True)
    a, b = ref_y.chunk(2, -1)
    ref = F.silu(a) * b * ref_p[:, :1]
    tol = 2e-5 if dtype in (torch.float32, torch.float64) else 2e-2
    torch.testing.assert_close(out.double(), ref.detach(), rtol=tol, atol=tol)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g.double())
    assert probs.grad.dtype == dtype and probs.grad.shape == probs.shape
    torch.testing.assert_close(probs.grad.double(), ref_p.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(y.grad.double(), ref_y.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_bias_of_another_dtype_and_strided(device, bias_dtype):
    y = torch.randn(5, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
    full = (torch.randn(32, device=device) * 0.3).to(bias_dtype).requires_grad_(True)
    out = fusedloss.swiglu(y, full[::2])
    ref_y = y.detach().double().requires_grad_(True)
    ref_b = full.detach().double().requires_grad_(True)
    a, b = (ref_y + ref_b[::2]).chunk(2, -1)
    ref = F.silu(a) * b
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1.6e-2, atol=1e-2)
    out.sum().backward()  # an expanded grad_output
    ref.sum().backward()
    assert full.grad.dtype == bias_dtype
    torch.testing.assert_close(full.grad.double(), ref_b.grad, rtol=2e-2, atol=2e-2)


def test_targets_any_integer_dtype_and_strides(device):
    x = torch.randn(8, 50, device=device)
    t64 = torch.randint(0, 50, (8, 2), device=device)
    ref = fusedloss.cross_entropy(x, t64[:, 0].contiguous(), reduction="none")
    for t in (t64[:, 0], t64[:, 0].to(torch.int16), t64[:, 0].to(torch.uint8), t64[:1, 0].expand(8)):
        want = ref if t.stride(0) else fusedloss.cross_entropy(x, t.contiguous(), reduction="none")
        torch.testing.assert_close(fusedloss.cross_entropy(x, t, reduction="none"), want)


# ---- 6. the double-backward guard on the custom-op (traced) path ----

@pytest.mark.parametrize("op", ["cross_entropy", "swiglu"])
def test_double_backward_raises_on_the_custom_op_path(device, op):
    """The registered autograd (what torch.compile traces) carries the same guard as the eager
    Function: calling the custom op directly must raise fusedloss's error."""
    x = torch.randn(6, 16, device=device, requires_grad=True)
    t = torch.randint(0, 16, (6,), device=device)
    if op == "cross_entropy":
        out = torch.ops.fusedloss.cross_entropy_fwd(x, t, -100, 0.0, 0, 0, 0.0, 2, "", True, False)[0]
    else:
        out = torch.ops.fusedloss.swiglu_fwd(x, None, None, None, False, False)[0].sum()
    g, = torch.autograd.grad(out, x, create_graph=True)
    with pytest.raises(RuntimeError, match=f"fusedloss.{op}: differentiating its gradient"):
        (g * torch.randn_like(x)).sum().backward()


@pytest.mark.parametrize("op", ["cross_entropy", "swiglu"])
def test_double_backward_raises_under_compile(device, op):
    """Under torch.compile the compiled region refuses double backward as a whole (AOTAutograd),
    before any op's backward runs: an error either way, never a silently wrong gradient."""
    x = torch.randn(6, 16, device=device, requires_grad=True)
    t = torch.randint(0, 16, (6,), device=device)

    def f(x):
        return fusedloss.cross_entropy(x, t) if op == "cross_entropy" else fusedloss.swiglu(x).sum()

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    g, = torch.autograd.grad(out, x, create_graph=True)
    with pytest.raises(RuntimeError, match=f"fusedloss.{op}: differentiating its gradient|"
                                           "does not currently support double backward"):
        (g * torch.randn_like(x)).sum().backward()


# ---- 7. clamped SwiGLU at the bound: the running torch's rule ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamp_gradient_at_the_bound_follows_torch(device, dtype):
    c = 1.5
    vals = torch.tensor([c, -c, c, 0.25, -c, c, 2.0, -2.0], dtype=dtype)
    y = torch.stack([vals, vals.flip(0)], 0).repeat(3, 1).to(device).requires_grad_(True)  # n = 4
    out = fusedloss.swiglu(y, clamp_value=c)
    ref_y = y.detach().double().requires_grad_(True)
    a, b = ref_y.chunk(2, -1)
    ref = F.silu(a.clamp(max=c)) * b.clamp(min=-c, max=c)
    g = torch.ones_like(out)
    out.backward(g)
    ref.backward(g.double())
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(y.grad.double(), ref_y.grad, rtol=tol, atol=tol)


# ---- 8. clear errors, never a Python accident ----

@pytest.mark.parametrize("call, error, match", [
    (lambda d: fusedloss.cross_entropy(torch.randn(4, 0, device=d), torch.zeros(4, dtype=torch.long, device=d)),
     ValueError, r"logits: got shape \(4, 0\)"),
    (lambda d: fusedloss.cross_entropy(torch.randn(4, 5, device=d), [1, 2, 3, 4]),
     TypeError, "target: got list, expected a torch.Tensor"),
    (lambda d: fusedloss.cross_entropy(torch.randn(4, 5, device=d), torch.zeros(4, dtype=torch.long, device=d),
                                       ignore_index=1.5), TypeError, "ignore_index: got 1.5"),
    (lambda d: fusedloss.cross_entropy(torch.randn(4, 5, device=d), torch.zeros(4, device=d)),
     ValueError, "target.dtype: got torch.float32, expected an integer dtype"),
    (lambda d: fusedloss.CrossEntropyLoss(reduction="avg"), ValueError, "reduction: got 'avg'"),
    (lambda d: fusedloss.CrossEntropyLoss(label_smoothing=2.0), ValueError, "label_smoothing: got 2"),
    (lambda d: fusedloss.CrossEntropyLoss(reduktion="sum"), TypeError, "unknown options"),
    (lambda d: fusedloss.cross_entropy(torch.randn(4, 5, device=d), torch.zeros(4, dtype=torch.long, device=d),
                                       tp_group="x"), TypeError, "tp_group: got 'x'"),
    (lambda d: fusedloss.cross_entropy(torch.randn(4, 5, device=d), torch.zeros(4, dtype=torch.long, device=d),
                                       label_smoothing="0.1"), TypeError, "label_smoothing: got '0.1'"),
    (lambda d: fusedloss.swiglu(torch.randn(4, 0, device=d)), ValueError, r"y: got shape \(4, 0\)"),
    (lambda d: fusedloss.swiglu([[1.0, 2.0]]), TypeError, "y: got list"),
    (lambda d: fusedloss.swiglu(torch.randn(4, 8, device=d), per_token_scale=torch.ones(4, dtype=torch.long, device=d)),
     ValueError, "per_token_scale.dtype: got torch.int64"),
    (lambda d: fusedloss.swiglu(torch.randn(4, 8, device=d), clamp_value=float("nan")),
     ValueError, "clamp_value: got nan"),
    (lambda d: fusedloss.swiglu(torch.randn(4, 8, device=d), clamp_value="big"),
     TypeError, "clamp_value: got 'big'"),
])
def test_clear_errors(device, call, error, match):
    with pytest.raises(error, match=match):
        call(device)


def test_zero_rows(device):
    x = torch.randn(0, 7, device=device, requires_grad=True)
    loss = fusedloss.cross_entropy(x, torch.zeros(0, dtype=torch.long, device=device))
    assert loss.item() == 0.0
    loss.backward()
    assert x.grad.shape == (0, 7)


def test_deprecated_in_place_spelling_still_works_and_warns(device):
    y = torch.randn(4, 8, device=device, requires_grad=True)
    with pytest.warns(DeprecationWarning, match="use inplace_backward="):
        out = fusedloss.swiglu(y * 1, in_place=True)
    out.sum().backward()
    assert y.grad is not None
