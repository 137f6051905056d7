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
        out = torch.ops.fusedloss.cross_entropy_fwd(x, t, -100, 0.0, 0, 0, 0.0, 2, 0.0, "", True, False,
                                                   False, False)[0]
    else:
        out = torch.ops.fusedloss.swiglu_fwd(x, None, None, None, 1.0, 1.0, False, False)[0].sum()
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


# ---- found by probing the API as a new user would ----

def test_rms_norm_residual_backward_with_an_expanded_gradient_of_s(device):
    """The gradient of s arrives expanded (from s.sum()): its contiguous copy must live until
    the kernel has run (it was freed at once: garbage gradients or a crash)."""
    x = torch.randn(64, 96, device=device, requires_grad=True)
    r = torch.randn(64, 96, device=device, requires_grad=True)
    w = torch.randn(96, device=device)
    for _ in range(3):  # allocations in between reuse freed memory
        x.grad = r.grad = None
        y, s = fusedloss.rms_norm(x, w, residual=r)
        (y.sum() + s.sum()).backward()
        s64 = x.detach().double() + r.detach().double()
        s64.requires_grad_(True)
        y64 = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
        (y64.sum() + s64.sum()).backward()
        torch.testing.assert_close(x.grad.double(), s64.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(r.grad.double(), s64.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", ["cross_entropy", "swiglu"])
def test_compiled_inplace_never_writes_a_parameter(device, op):
    p = torch.nn.Parameter(torch.randn(8, 10, device=device))
    before = p.detach().clone()
    t = torch.randint(0, 10, (8,), device=device)

    def f(a):
        if op == "cross_entropy":
            return fusedloss.cross_entropy(a, t, inplace_backward=True)
        return fusedloss.swiglu(a, inplace_backward=True).sum()

    torch.compile(f, fullgraph=True, backend="aot_eager")(p).backward()
    assert torch.equal(p.detach(), before)
    ref = before.clone().requires_grad_(True)
    (F.cross_entropy(ref, t) if op == "cross_entropy" else
     (F.silu(ref[:, :5]) * ref[:, 5:]).sum()).backward()
    torch.testing.assert_close(p.grad, ref.grad, rtol=1e-5, atol=1e-6)


def test_compiled_swiglu_inplace_on_an_intermediate(device):
    y = torch.randn(8, 16, device=device, requires_grad=True)
    f = torch.compile(lambda a: fusedloss.swiglu(a * 1.0, inplace_backward=True).sum(),
                      fullgraph=True, backend="aot_eager")
    f(y).backward()
    ref = y.detach().clone().requires_grad_(True)
    (F.silu(ref[:, :8]) * ref[:, 8:]).sum().backward()
    torch.testing.assert_close(y.grad, ref.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["cross_entropy", "swiglu", "rms_norm", "linear_cross_entropy",
                                "linear_cross_entropy_recompute"])
def test_second_order_through_another_path_raises_instead_of_dropping(device, op):
    """d/dh of (g(h)^2 + h^2) where g is the fused gradient: the fused part must raise, never be
    silently treated as zero (the guard node was detached from h). The linear CE: in_forward
    (its backward reads neither input) and recompute."""
    h = torch.randn(4, 6, device=device, requires_grad=True)
    t = torch.randint(0, 6, (4,), device=device)
    w = torch.randn(6, device=device)
    wl = torch.randn(6, 6, device=device)
    out = {"cross_entropy": lambda: fusedloss.cross_entropy(h * 2, t),
           "swiglu": lambda: fusedloss.swiglu(h * 2).sum(),
           "rms_norm": lambda: fusedloss.rms_norm(h * 2, w).pow(2).sum(),
           "linear_cross_entropy": lambda: fusedloss.linear_cross_entropy(h * 2, wl, t),
           "linear_cross_entropy_recompute": lambda: fusedloss.linear_cross_entropy(
               h * 2, wl, t, reduction="none").sum()}[op]()
    g, = torch.autograd.grad(out, h, create_graph=True)
    name = op.replace("_recompute", "")
    with pytest.raises(RuntimeError, match=f"fusedloss.{name}: differentiating its gradient"):
        torch.autograd.grad((g ** 2).sum() + (h ** 2).sum(), h)


def test_inplace_with_create_graph_gives_usable_values(device):
    h = torch.randn(4, 6, device=device, requires_grad=True)
    t = torch.randint(0, 6, (4,), device=device)
    g, = torch.autograd.grad(fusedloss.cross_entropy(h * 2, t, inplace_backward=True), h,
                             create_graph=True)
    ref = h.detach().clone().requires_grad_(True)
    F.cross_entropy(ref * 2, t).backward()
    torch.testing.assert_close(g.detach(), ref.grad, rtol=1e-5, atol=1e-6)


def test_clamped_swiglu_first_called_under_inference_mode():
    """The clamp rule is probed on first use, whatever grad mode that call runs in."""
    import subprocess
    import sys
    code = ("import torch, fusedloss\n"
            "with torch.inference_mode():\n"
            "    print(fusedloss.swiglu(torch.randn(8, 8), clamp_value=0.5).shape)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_no_inplace_warning_without_autograd(device):
    x = torch.randn(4, 6, device=device, requires_grad=True)
    t = torch.randint(0, 6, (4,), device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            fusedloss.cross_entropy(x, t, inplace_backward=True)
        with torch.inference_mode():
            fusedloss.swiglu(x, inplace_backward=True)


def test_inplace_warning_points_at_the_callers_line(device):
    x = torch.randn(4, 6, device=device, requires_grad=True)
    with pytest.warns(UserWarning) as record:
        fusedloss.cross_entropy(x, torch.randint(0, 6, (4,), device=device), inplace_backward=True)
    assert record[0].filename == __file__


@pytest.mark.parametrize("call, error, match", [
    (lambda d: fusedloss.cross_entropy(torch.randn(4, 5, device=d), torch.zeros(4, dtype=torch.long, device=d),
                                       ignore_index=2**63), ValueError, "ignore_index: got 9223372036854775808"),
    (lambda d: fusedloss.cross_entropy(torch.randn(4, 5, device=d), torch.zeros(4, dtype=torch.uint64, device=d)),
     ValueError, "target.dtype: got torch.uint64"),
    (lambda d: fusedloss.cross_entropy(torch.randn(4, 5, device=d),
                                       torch.zeros(4, dtype=torch.uint8, device=d).view(torch.bits8)),
     ValueError, "target.dtype: got torch.bits8"),  # integer-like, not convertible
    (lambda d: fusedloss.cross_entropy(torch.randn(4, 5, device=d), torch.zeros(4, dtype=torch.long, device=d),
                                       inplace_backward="no"), TypeError, "inplace_backward: got 'no'"),
    (lambda d: fusedloss.cross_entropy(torch.randn(4, 5, device=d), torch.zeros(4, dtype=torch.long, device=d),
                                       check_shard_agreement=1), TypeError, "check_shard_agreement: got 1"),
    (lambda d: fusedloss.cross_entropy(torch.randn(4, 5, device=d), torch.zeros(4, dtype=torch.long, device=d),
                                       label_smoothing=0.1 + 1j), TypeError, "label_smoothing: got"),
    (lambda d: fusedloss.swiglu(torch.randn(4, 8, device=d), fp8_input_store="False"),
     TypeError, "fp8_input_store: got 'False'"),
    (lambda d: fusedloss.RMSNorm(8, zero_centered_gamma="no"), TypeError, "zero_centered_gamma: got 'no'"),
    (lambda d: fusedloss.RMSNorm(8, dtype=torch.int32), ValueError, "dtype: got torch.int32"),
    (lambda d: fusedloss.SwiGLU(bogus=1), TypeError, "unknown options"),
    (lambda d: fusedloss.SwiGLU(clamp_value=-1), ValueError, "clamp_value: got -1"),
])
def test_clear_errors_for_types_and_ranges(device, call, error, match):
    with pytest.raises(error, match=match):
        call(device)


def test_swiglu_module_repr_shows_its_options():
    assert "clamp_value=0.5" in repr(fusedloss.SwiGLU(clamp_value=0.5))


@pytest.mark.parametrize("case", ["rms_norm", "rms_norm_3d", "rms_norm_residual_y", "swiglu", "swiglu_3d"])
def test_outputs_can_be_modified_in_place(device, case):
    # as with torch's ops: `out.mul_(2)` (or `out += r`) on a result, then backward through it;
    # an output that was a view made inside the autograd node made autograd refuse this
    torch.manual_seed(0)
    shape = (2, 3, 8) if case.endswith("3d") or case.endswith("_y") else (3, 8)
    w = torch.rand(8, device=device) + 0.5
    x = torch.randn(*shape[:-1], 16 if case.startswith("swiglu") else 8, device=device)
    r = torch.randn(shape, device=device)

    def run(op, inplace):
        xx = x.clone().requires_grad_()
        ww = w.clone().requires_grad_()
        if case.startswith("swiglu"):
            out = op(xx)
        elif case == "rms_norm_residual_y":
            out = op(xx, ww, r)[0]
        else:
            out = op(xx, ww, None)
        out = out.mul_(2.0) if inplace else out * 2.0
        (out * torch.arange(out.numel(), device=device).view(out.shape)).sum().backward()
        return out.detach(), xx.grad, ww.grad

    def reference(xx, ww, rr):
        if rr is not None:
            s = xx + rr
            return F.rms_norm(s, (8,), ww, 1e-5), s
        return F.rms_norm(xx, (8,), ww, 1e-5)

    if case.startswith("swiglu"):
        fused, ref = fusedloss.swiglu, lambda t: F.silu(t[..., :8]) * t[..., 8:]
    else:
        fused = lambda xx, ww, rr: (fusedloss.rms_norm(xx, ww, residual=rr) if rr is not None
                                    else fusedloss.rms_norm(xx, ww))
        ref = reference
    got, want = run(fused, inplace=True), run(ref, inplace=False)
    for a, b in zip(got, want):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# ---- options that float32 cannot hold: refused with the value as passed ----

@pytest.mark.parametrize("call, message", [
    (lambda h, w, t, x: fusedloss.linear_cross_entropy(h, w, t, logit_softcap=1e-300),
     r"logit_softcap: got 1e-300, which is 0 in float32"),  # 0 would mean "off": not silently
    (lambda h, w, t, x: fusedloss.linear_cross_entropy(h, w, t, z_loss=1e300),
     r"z_loss: got 1e\+300, which is inf in float32"),
    (lambda h, w, t, x: fusedloss.rms_norm(x, torch.ones(8), eps=1e-50),
     r"eps: got 1e-50, which is 0 in float32"),
    (lambda h, w, t, x: fusedloss.rms_norm(x, torch.ones(8), eps=torch.tensor(1e39, dtype=torch.float64)),
     r"eps: got 1e\+39, which is inf in float32"),
    (lambda h, w, t, x: fusedloss.cross_entropy(x, t[:6] % 8, label_smoothing=1e-46),
     r"label_smoothing: got 1e-46, which is 0 in float32"),
])
def test_options_float32_cannot_hold_are_refused(call, message):
    h, w, t, x = torch.randn(6, 8), torch.randn(10, 8), torch.randint(0, 10, (6,)), torch.randn(6, 8)
    with pytest.raises(ValueError, match=message):
        call(h, w, t, x)
    # the smallest float32 subnormal and the largest finite float32 are accepted
    fusedloss.linear_cross_entropy(h, w, t, logit_softcap=1.5e-45)
    fusedloss.rms_norm(x, torch.ones(8), eps=3.4e38)


def test_rms_norm_module_dtype_must_be_a_torch_dtype():
    with pytest.raises(TypeError, match="dtype: got 'float32' \\(str\\), expected a torch.dtype"):
        fusedloss.RMSNorm(4, dtype="float32")


# ---- torch.func and fake tensors: the custom ops serve where an eager node cannot ----

def _op_calls(device):
    """name -> (the op summed to a scalar, its inputs); the op's arguments built on `device`
    (fake tensors under a FakeTensorMode)."""
    x, w = torch.randn(4, 8, device=device), torch.randn(8, device=device)
    t, head = torch.randint(0, 8, (4,), device=device), torch.randn(8, 8, device=device)
    return {
        "rms_norm": (lambda x, w: fusedloss.rms_norm(x, w).sum(), (x, w)),
        "rms_norm_residual": (lambda x, w: sum(v.sum() for v in fusedloss.rms_norm(x, w, residual=2 * x)),
                              (x, w)),
        "cross_entropy": (lambda x, w: fusedloss.cross_entropy(x * w, t), (x, w)),
        "linear_cross_entropy": (lambda x, w: fusedloss.linear_cross_entropy(x * w, head, t), (x, w)),
        # reduced with its mask, as the mask's in-forward backward requires
        "linear_cross_entropy_masked": (lambda x, w: (fusedloss.linear_cross_entropy(
            x * w, head, t, reduction="none", loss_mask=t > 2) * (t > 2)).sum(), (x, w)),
        "swiglu": (lambda x, w: fusedloss.swiglu(torch.cat([x, x * w], -1)).sum(), (x, w)),
    }


@pytest.mark.parametrize("name", list(_op_calls("cpu")))
def test_torch_func_grad_is_refused_by_name_and_vmap_of_the_forward_works(device, name):
    """grad and jvp (a silent zero tangent through the custom op otherwise) are refused by name;
    vmap of the forward matches the loop, and an outer backward through it the loop's."""
    from torch.func import grad, jacfwd, jvp, vmap
    f, (x, w) = _op_calls(device)[name]
    for transform in (lambda: grad(f)(x, w), lambda: jvp(f, (x, w), (torch.ones_like(x), w)),
                      lambda: jacfwd(f)(x, w), lambda: vmap(grad(f))(x[None], w[None])):
        with pytest.raises(RuntimeError, match=r"fusedloss\.\w+: torch.func transforms that differentiate"):
            transform()
    xs, ws = torch.stack([x, -x, 2 * x]), torch.stack([w, w.flip(0), w + 1])
    xs.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "no batching rule": the custom op row by row
        batched = vmap(f)(xs, ws)
    looped = torch.stack([f(a, b) for a, b in zip(xs, ws)])
    torch.testing.assert_close(batched, looped)
    scale = torch.tensor([1.0, 2.0, 3.0], device=device)
    (dx_batched,) = torch.autograd.grad((batched * scale).sum(), xs)
    (dx_looped,) = torch.autograd.grad((looped * scale).sum(), xs)
    torch.testing.assert_close(dx_batched, dx_looped)


@pytest.mark.parametrize("name", list(_op_calls("cpu")))
def test_fake_tensors_take_the_fake_implementations(device, name):
    """Under a FakeTensorMode (memory estimators, tracing tools) the ops give fake results of
    the right shapes, forward and backward, instead of reaching for data fake tensors lack."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    f, (x, w) = _op_calls(device)[name]
    real = f(x, w)
    with FakeTensorMode():
        f, (x, w) = _op_calls(device)[name]
        x.requires_grad_(True), w.requires_grad_(True)
        loss = f(x, w)
        loss.backward()
        assert loss.shape == real.shape and loss.dtype == real.dtype
        assert x.grad.shape == x.shape and w.grad.shape == w.shape


def _dtensor_inputs_are_refused_by_name(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(torch.randn(4, 8), mesh, [Replicate()])
    head = distribute_tensor(torch.randn(6, 8), mesh, [Shard(0)])
    t = torch.zeros(4, dtype=torch.long)
    calls = {"x": lambda: fusedloss.rms_norm(x, torch.ones(8)),
             "weight": lambda: fusedloss.rms_norm(x.to_local(), distribute_tensor(torch.ones(8), mesh, [Replicate()])),
             "logits": lambda: fusedloss.cross_entropy(x, t),
             "y": lambda: fusedloss.swiglu(x),
             "hidden": lambda: fusedloss.linear_cross_entropy(x, head, t)}
    for name, call in calls.items():
        with pytest.raises(TypeError, match=rf"^{name}: got a DTensor, expected a plain torch.Tensor: "
                                            rf"pass {name}.to_local\(\)"):
            call()


def test_dtensor_inputs_are_refused_by_name():
    # a DTensor's own storage is empty (its data is the local shard): read as a plain tensor it
    # was refused as "x.data: got null"
    from dist_util import run_world
    run_world(1, _dtensor_inputs_are_refused_by_name)
