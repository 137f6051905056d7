"""In-place safety, bad inputs (BAD_INPUTS.md, Python rows), torch.compile, CUDA graphs."""
import pytest
import torch
import torch.nn.functional as F

import fusedloss


def _logits_and_targets(device, rows=8, V=64):
    return (torch.randn(rows, V, device=device, requires_grad=True),
            torch.randint(0, V, (rows,), device=device))


def test_second_backward_through_inplace_raises(device):
    x, t = _logits_and_targets(device)
    loss = fusedloss.cross_entropy(x * 1, t, inplace_backward=True)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_reading_overwritten_logits_trips_version_check(device):
    x, t = _logits_and_targets(device)
    logits = x * 1
    other = (logits ** 2).sum()  # saves `logits` for its own backward
    loss = fusedloss.cross_entropy(logits, t, inplace_backward=True)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        other.backward()


def test_out_of_place_allows_double_backward_of_graph(device):
    x, t = _logits_and_targets(device)
    loss = fusedloss.cross_entropy(x, t)
    loss.backward(retain_graph=True)
    g1 = x.grad.clone()
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * g1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(label_smoothing=1.0), "label_smoothing: got 1"),
    (dict(label_smoothing=-0.1), "label_smoothing: got -0.1"),
    (dict(z_loss=-1.0), "z_loss: got -1"),
    (dict(reduction="avg"), "reduction: got 'avg'"),
    (dict(smoothing_formula="tf"), "smoothing_formula: got 'tf'"),
])
def test_bad_options(device, kwargs, match):
    x = torch.randn(4, 10, device=device)
    t = torch.randint(0, 10, (4,), device=device)
    with pytest.raises(ValueError, match=match):
        fusedloss.cross_entropy(x, t, **kwargs)


def test_bad_shapes_and_dtypes(device):
    t = torch.randint(0, 10, (4,), device=device)
    with pytest.raises(ValueError, match="expected a 2-D"):
        fusedloss.cross_entropy(torch.randn(40, device=device), t)
    with pytest.raises(ValueError, match=r"target: got shape \(3,\)"):
        fusedloss.cross_entropy(torch.randn(4, 10, device=device), t[:3])
    with pytest.raises(ValueError, match="logits.dtype: got torch.float64"):
        fusedloss.cross_entropy(torch.randn(4, 10, device=device, dtype=torch.float64), t)
    with pytest.raises(ValueError, match="target.dtype: got torch.float32"):
        fusedloss.cross_entropy(torch.randn(4, 10, device=device), t.float())


def test_extension_keeps_its_cxx_runtime_private():
    """The extension must not take libstdc++/libgcc from the process (torch's libraries can put
    another copy first; its error messages then crashed in the locale code): linked static."""
    import shutil
    import subprocess
    from fusedloss import _C
    if not _C.STATIC_CXX_RUNTIME:
        pytest.skip("built with FUSEDLOSS_PYTHON_STATIC_RUNTIME=OFF (or not on Linux)")
    if shutil.which("readelf") is None:
        pytest.skip("readelf is not available to list the extension's shared libraries")
    # The extension's own NEEDED entries (not ldd's transitive list: libcublasLt, which the
    # linear cross-entropy links, brings its own libgcc_s, which the extension does not use).
    dynamic = subprocess.run(["readelf", "-d", _C.__file__], capture_output=True, text=True,
                             check=True).stdout
    needed = [line for line in dynamic.splitlines() if "(NEEDED)" in line]
    assert needed, dynamic
    assert not any("libstdc++" in n or "libgcc_s" in n for n in needed), needed


def test_out_of_range_target(device):
    x = torch.randn(4, 10, device=device)
    t = torch.tensor([1, 2, 10, 3], device=device)
    if device == "cpu":
        with pytest.raises(ValueError, match=r"target\[2\]: got 10"):
            fusedloss.cross_entropy(x, t)
    else:
        loss = fusedloss.cross_entropy(x, t, reduction="none")  # no host sync: reported later
        with pytest.raises(ValueError, match=r"target\[2\]: got 10"):
            fusedloss.check_device_errors()
        assert torch.isnan(loss[2]) and torch.isfinite(loss[[0, 1, 3]]).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_mismatch():
    with pytest.raises(ValueError, match="target.device"):
        fusedloss.cross_entropy(torch.randn(4, 10, device="cuda"), torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("inplace, backend", [(False, "aot_eager"), (True, "aot_eager"),
                                              (True, "inductor")])
def test_torch_compile_fullgraph(device, inplace, backend):
    x = torch.randn(16, 300, device=device, requires_grad=True)
    t = torch.randint(0, 300, (16,), device=device)
    y = torch.randn(16, 64, device=device, requires_grad=True)

    def step(x, t, y):
        loss = fusedloss.cross_entropy(x * 2, t, label_smoothing=0.1, inplace_backward=inplace)
        return loss + fusedloss.swiglu(y).sum()

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    out = compiled(x, t, y)
    out.backward()
    gx, gy = x.grad.clone(), y.grad.clone()
    x.grad = y.grad = None
    eager = step(x, t, y)
    eager.backward()
    torch.testing.assert_close(out, eager)  # inductor fuses x * 2 and its backward: rounding only
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gy, y.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_capture_replays_forward_backward():
    x_static = torch.randn(64, 5000, device="cuda")
    t_static = torch.randint(0, 5000, (64,), device="cuda")
    w = torch.randn(5000, 5000, device="cuda", requires_grad=True) * 0.01
    w = w.detach().requires_grad_(True)

    def step():
        logits = x_static @ w
        loss = fusedloss.cross_entropy(logits, t_static, inplace_backward=True)
        loss.backward()
        return loss

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # warm up (allocator, lazy init) outside the capture
            w.grad = None
            step()
    torch.cuda.current_stream().wait_stream(s)
    w.grad = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_loss = step()
    for _ in range(2):
        x_static.copy_(torch.randn_like(x_static))
        t_static.copy_(torch.randint(0, 5000, (64,), device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        ref_w = w.detach().clone().requires_grad_(True)
        ref = F.cross_entropy(x_static @ ref_w, t_static)
        ref.backward()
        torch.testing.assert_close(static_loss, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(w.grad, ref_w.grad, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("op", ["cross_entropy", "swiglu"])
def test_double_backward_raises_instead_of_treating_the_gradient_as_constant(device, op):
    x = torch.randn(6, 16, device=device, requires_grad=True)
    if op == "cross_entropy":
        out = fusedloss.cross_entropy(x, torch.randint(0, 16, (6,), device=device))
    else:
        out = fusedloss.swiglu(x).sum()
    g, = torch.autograd.grad(out, x, create_graph=True)
    w = torch.randn_like(x, requires_grad=True)
    (g.detach() * w).sum().backward()  # using the gradient's values is fine
    assert w.grad is not None
    with pytest.raises(RuntimeError, match=f"fusedloss.{op}: differentiating its gradient"):
        (g * w).sum().backward()


def test_an_option_given_as_a_tensor_that_requires_grad_is_refused():
    """An option is read as a number: a tensor that requires grad would silently get none."""
    x, t = torch.randn(4, 8, requires_grad=True), torch.randint(0, 8, (4,))
    ls = torch.tensor(0.1, requires_grad=True)
    with pytest.raises(TypeError, match="label_smoothing: got a tensor that requires grad"):
        fusedloss.cross_entropy(x, t, label_smoothing=ls)
    leaf = torch.tensor([0.1, 0.2], requires_grad=True)  # a view of a leaf, too
    with pytest.raises(TypeError, match="z_loss: got a tensor that requires grad"):
        fusedloss.cross_entropy(x, t, z_loss=leaf[0])
    assert torch.isfinite(fusedloss.cross_entropy(x, t, label_smoothing=ls.detach()))
