"""The C++ autograd nodes (libfusedloss_torch.so, fusedloss/_native.py): loaded when the
package was built against this torch, the same bits as the Python nodes, and a clear fallback."""
import contextlib
import importlib
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import fusedloss
from fusedloss import _native
from layouts import LAYOUTS, build

rms_module = importlib.import_module("fusedloss.rms_norm")  # (fusedloss.rms_norm is the function)

pytestmark = pytest.mark.skipif(os.environ.get("FUSEDLOSS_NATIVE_NODES") == "0",
                                reason="C++ nodes switched off (FUSEDLOSS_NATIVE_NODES=0)")


def test_loaded():
    """launch/python.sh builds the package against the environment's torch: the library ships
    and loads (a silent fallback would only cost host time, which no other test sees)."""
    assert os.path.exists(_native._LIBRARY), _native.status
    assert _native.ops is not None, _native.status
    x = torch.randn(3, 4, requires_grad=True)
    y = fusedloss.rms_norm(x, torch.ones(4))
    assert "Cpp" in type(y.grad_fn).__name__  # the eager call went through the C++ node


def test_other_torch_falls_back(tmp_path, monkeypatch):
    stamp = tmp_path / "torch_nodes_version.txt"
    stamp.write_text("0.0.0\n")
    monkeypatch.setattr(_native, "_BUILT_FOR", str(stamp))
    ops, status = _native._load()
    assert ops is None and "built for torch 0.0.0" in status and torch.__version__ in status
    monkeypatch.setenv("FUSEDLOSS_NATIVE_NODES", "0")
    assert _native._load() == (None, "off (FUSEDLOSS_NATIVE_NODES=0)")


def test_a_core_table_of_another_layout_is_refused(monkeypatch):
    """The nodes call fusedloss._C's core through its table (python/src/core_table.h): a table
    whose size is not the library's is refused (the Python nodes serve, status says why), and a
    refused attach leaves the nodes on the table they had."""
    monkeypatch.setattr(_native._C, "_CORE_TABLE_SIZE", _native._C._CORE_TABLE_SIZE + 8)
    ops, status = _native._load()
    assert ops is None and "core table differs" in status
    x = torch.randn(3, 4, requires_grad=True)
    y = fusedloss.rms_norm(x, torch.ones(4))
    y.sum().backward()  # still through the C++ node and the table attached at import
    assert "Cpp" in type(y.grad_fn).__name__ and x.grad is not None


def _same_bits_as_python_node(run, module, monkeypatch, names=("_EAGER",), layout=None, device=None):
    """run() through the C++ node, then with the op's module switched to its Python node: every
    result has the same dtype, shape and bits. Except one case: the leaf behind a view whose
    rows overlap gets its gradient from torch's as_strided backward, which on CUDA sums the
    overlapping elements with atomics in no fixed order; there the results agree to rounding."""
    native = run()
    for name in names:
        monkeypatch.setattr(module, name, None)
    python = run()
    assert len(native) == len(python)
    for a, b in zip(native, python):
        assert a.dtype == b.dtype and a.shape == b.shape
        if layout == "overlapping" and device == "cuda" and a.is_floating_point():
            # a few terms summed in a's dtype, in either order: a rounding of the largest each
            atol = 4 * torch.finfo(a.dtype).eps * float(b.abs().max()) if b.numel() else 0.0
            torch.testing.assert_close(a, b, rtol=0, atol=atol)
        else:
            assert torch.equal(a, b)


def _through(base, view, through):
    """(a fresh leaf with base's values, what the op gets): view() of the leaf itself
    (through="view_of_leaf"; the leaf itself for a contiguous layout) or of an intermediate copy
    of it (whose memory an in-place gradient may take). base and view: layouts.build's."""
    leaf = base.detach().clone().requires_grad_()
    return leaf, view(leaf if through == "view_of_leaf" else leaf * 1)


def _made(dtype, device):
    return lambda n: torch.randn(n, device=device).to(dtype)


def _run(x, w, residual, zc, grads, through):
    (xl, x_in), (wl, w_in) = _through(*x, through), _through(*w, through)
    rl, r_in = _through(*residual, through) if residual is not None else (None, None)
    out = fusedloss.rms_norm(x_in, w_in, 1e-5, zc, r_in)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, grads[:len(outs)])
    return [t.detach() for t in outs] + [xl.grad, wl.grad] + ([] if rl is None else [rl.grad])


@pytest.mark.parametrize("dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                           (torch.bfloat16, torch.float32), (torch.float16, torch.float64),
                                           (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(12, 40), (3, 4, 40)], ids=["2d", "3d"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("through", ["view_of_leaf", "intermediate"])
def test_rms_norm_same_bits_as_python_nodes(device, dtype, w_dtype, layout, shape, residual, through,
                                            monkeypatch):
    H = shape[-1]
    x = build(layout, shape, _made(dtype, device), step=3)
    w = build("contiguous", (2 * H,), _made(w_dtype, device))[0], lambda b: b[::2]  # strided
    # the residual in another layout than x's
    r = build("transposed" if layout != "transposed" else "sliced", shape, _made(dtype, device)) if residual else None
    grads = [torch.randn(shape, device=device).to(dtype) for _ in range(2)]
    zc = len(shape) == 3
    _same_bits_as_python_node(lambda: _run(x, w, r, zc, grads, through), rms_module, monkeypatch,
                              ("_EAGER", "_EAGER_RESIDUAL"), layout=layout, device=device)


def test_rms_norm_unused_output_and_no_grad(device):
    x = torch.randn(6, 8, device=device, requires_grad=True)
    w = torch.randn(8, device=device, requires_grad=True)
    r = torch.randn(6, 8, device=device, requires_grad=True)
    y, s = fusedloss.rms_norm(x, w, residual=r)
    s.sum().backward()  # only s used: y's gradient is zeros
    assert torch.equal(x.grad, torch.ones_like(x)) and torch.equal(r.grad, torch.ones_like(r))
    assert torch.count_nonzero(w.grad) == 0
    with torch.no_grad():
        assert fusedloss.rms_norm(x, w).grad_fn is None
    with torch.inference_mode():
        assert torch.equal(fusedloss.rms_norm(x, w), fusedloss.rms_norm(x.detach(), w.detach()))


swiglu_module = importlib.import_module("fusedloss.swiglu")


def _swiglu_run(y, bias, scale, clamp, inplace, grad, through):
    pairs = [_through(*t, through) if t is not None else (None, None) for t in (y, bias, scale)]
    out = fusedloss.swiglu(pairs[0][1], pairs[1][1], per_token_scale=pairs[2][1], clamp_value=clamp,
                           inplace_backward=inplace)
    out.backward(grad)
    return [out.detach()] + [leaf.grad for leaf, _ in pairs if leaf is not None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("extras", ["none", "bias", "bias_fp32+scale", "clamp"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("through", ["view_of_leaf", "intermediate"])
def test_swiglu_same_bits_as_python_nodes(device, dtype, layout, extras, inplace, through, monkeypatch):
    T, n = 12, 24
    y = build(layout, (T, 2 * n), _made(dtype, device), step=5)
    bias = scale = clamp = None
    if "bias" in extras:  # strided
        bias = build("contiguous", (4 * n,), _made(torch.float32 if "fp32" in extras else dtype, device))[0], lambda b: b[::2]
    if "scale" in extras:  # one scale expanded over the rows
        scale = build("expanded", (T, 1), lambda k: torch.rand(k, device=device))
    if extras == "clamp":
        clamp = 0.5
    grad = torch.randn(T, n, device=device).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # in-place refused for a leaf's memory or a copied layout
        _same_bits_as_python_node(lambda: _swiglu_run(y, bias, scale, clamp, inplace, grad, through),
                                  swiglu_module, monkeypatch, layout=layout, device=device)


def test_swiglu_inplace_consumes_and_second_backward_raises(device):
    y = torch.randn(4, 16, device=device, requires_grad=True)
    h = y * 2
    out = fusedloss.swiglu(h, inplace_backward=True)
    out.sum().backward(retain_graph=True)
    assert "Cpp" in type(out.grad_fn).__name__
    with pytest.raises(RuntimeError, match="second backward .* inplace_backward=True"):
        out.sum().backward()
    with pytest.warns(UserWarning, match="not overwritten"):  # a leaf's memory stays the caller's
        fusedloss.swiglu(y, inplace_backward=True).sum().backward()


def _swiglu_two_run(gate, up, bias, scale, mults, inplace, grad, through):
    pairs = [_through(*t, through) if t is not None else (None, None) for t in (gate, up, bias, scale)]
    out = fusedloss.swiglu(pairs[0][1], pairs[1][1], bias=pairs[2][1], per_token_scale=pairs[3][1],
                           gate_multiplier=mults[0], down_multiplier=mults[1], inplace_backward=inplace)
    out.backward(grad)
    return [out.detach()] + [leaf.grad for leaf, _ in pairs if leaf is not None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("extras", ["none", "bias+scale+multipliers"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("through", ["view_of_leaf", "intermediate"])
def test_swiglu_two_tensor_same_bits_as_python_nodes(device, dtype, layout, extras, inplace, through,
                                                      monkeypatch):
    """swiglu(gate, up): the C++ node and the Python node, the same bits."""
    T, n = 12, 24
    gate, up = (build(layout, (T, n), _made(dtype, device), step=5) for _ in range(2))
    bias = scale = None
    mults = (1.0, 1.0)
    if extras != "none":
        bias = build("contiguous", (4 * n,), _made(dtype, device))[0], lambda b: b[::2]
        scale = build("expanded", (T, 1), lambda k: torch.rand(k, device=device))
        mults = (1.5, -0.5)
    grad = torch.randn(T, n, device=device).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _same_bits_as_python_node(lambda: _swiglu_two_run(gate, up, bias, scale, mults, inplace, grad, through),
                                  swiglu_module, monkeypatch, names=("_EAGER_GATE_UP",), layout=layout,
                                  device=device)


def test_swiglu_two_tensor_node(device):
    """The two-tensor form's C++ node: in place over the halves of one buffer (a second backward
    raises), never over a leaf, nor over gate and up that share elements when called directly."""
    x = torch.randn(4, 32, device=device, requires_grad=True)
    gate, up = (x * 1).chunk(2, -1)
    out = fusedloss.swiglu(gate, up, inplace_backward=True)
    assert "Cpp" in type(out.grad_fn).__name__
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward .* inplace_backward=True; the first "
                                           "backward overwrote gate and up"):
        out.sum().backward()
    op = torch.ops.fusedloss.swiglu_gate_up_eager.default
    g0, u0 = (torch.randn(4, 8, device=device, requires_grad=True) for _ in range(2))
    before = g0.detach().clone(), u0.detach().clone()
    op(g0, u0, None, None, False, 0.0, False, False, 1.0, 1.0, True).sum().backward()
    assert torch.equal(g0.detach(), before[0]) and torch.equal(u0.detach(), before[1])
    h = g0 * 1
    with pytest.raises(ValueError, match="grad_gate: overlaps up"):
        op(h, h, None, None, False, 0.0, False, False, 1.0, 1.0, True).sum().backward()


def test_swiglu_node_never_writes_a_leaf_or_a_copy(device):
    """The op is reachable as torch.ops.fusedloss.swiglu_eager: asked for an in-place gradient
    of a leaf, or of rows that are a copy at backward time, it writes a new buffer."""
    op = torch.ops.fusedloss.swiglu_eager.default
    y = torch.randn(4, 8, device=device, requires_grad=True)
    before = y.detach().clone()
    op(y, None, None, False, 0.0, False, False, 1.0, 1.0, True).sum().backward()
    assert torch.equal(y.detach(), before) and not torch.equal(y.grad, before)
    b = torch.randn(1, 8, device=device, requires_grad=True)
    h = (b * 1).expand(4, 8)  # an intermediate whose rows the kernels read as a copy
    out = op(h, None, None, False, 0.0, False, False, 1.0, 1.0, True)
    out.sum().backward()
    ref = b.detach().clone().requires_grad_()
    fusedloss.swiglu((ref * 1).expand(4, 8)).sum().backward()
    assert torch.equal(b.grad, ref.grad)


def test_nodes_run_on_the_current_stream(device):
    """The C++ nodes launch on the caller's current stream (c10's device-generic stream query)."""
    x = build("contiguous", (64, 256), _made(torch.float32, device))
    w = build("contiguous", (256,), _made(torch.float32, device))
    g = torch.randn(64, 256, device=device)
    ref = _run(x, w, None, False, [g], "view_of_leaf")
    stream = torch.cuda.Stream() if device == "cuda" else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            got = _run(x, w, None, False, [g], "view_of_leaf")
        torch.cuda.current_stream().wait_stream(stream)
    else:
        got = _run(x, w, None, False, [g], "view_of_leaf")
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


ce_module = importlib.import_module("fusedloss.cross_entropy")


def _ce_run(logits, target, kw, mode, grad_scale):
    leaf, x = _through(*logits, "view_of_leaf" if mode == "view_of_leaf" else "intermediate")
    loss = fusedloss.cross_entropy(x, target, inplace_backward=mode in ("inplace", "view_of_leaf"),
                                   grad_in_forward=mode == "in_forward", **kw)
    loss.backward(torch.full_like(loss, grad_scale) if loss.dim() == 0 else
                  torch.rand(loss.shape, device=loss.device, generator=torch.Generator(loss.device).manual_seed(1)))
    return [loss.detach(), leaf.grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kw,mode", [
    pytest.param(kw, mode, id=f"{name}-{mode}")
    for name, kw in [("mean", {}), ("sum+smoothing+z", {"reduction": "sum", "label_smoothing": 0.1, "z_loss": 1e-3}),
                     ("none+ignore", {"reduction": "none", "ignore_index": 3}),
                     ("megatron", {"label_smoothing": 0.2, "smoothing_formula": "megatron"})]
    for mode in ["view_of_leaf", "copy", "inplace", "in_forward"]
    if not (mode == "in_forward" and kw.get("reduction") == "none")])  # (sum/mean only)
def test_cross_entropy_same_bits_as_python_nodes(device, dtype, layout, kw, mode, monkeypatch):
    N, V = 12, 37
    logits = build(layout, (N, V), _made(dtype, device), step=7)
    # the targets in a layout and index dtype of their own
    ids = torch.randint(0, V, (2 * N,), device=device)
    ids[2] = kw.get("ignore_index", -100)  # an ignored row (not in the expanded target's one id)
    target = {"contiguous": ids[:N].clone(), "sliced": ids[::2], "offset": ids[1:N + 1].to(torch.int32),
              "expanded": ids[:1].expand(N), "transposed": ids[:N].clamp(min=0).to(torch.uint8),
              "overlapping": ids[:N].to(torch.int16)}[layout]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # in-place refused for a leaf's memory or a copied layout
        _same_bits_as_python_node(lambda: _ce_run(logits, target, kw, mode, 0.5 if mode == "copy" else 1.0),
                                  ce_module, monkeypatch, layout=layout, device=device)


def test_cross_entropy_inplace_consumes_the_logits(device):
    h = torch.randn(6, 11, device=device, requires_grad=True)
    x = h * 1
    loss = fusedloss.cross_entropy(x, torch.randint(0, 11, (6,), device=device), inplace_backward=True)
    assert "Cpp" in type(loss.grad_fn).__name__
    square = x * x  # an autograd reader of x recorded before the backward
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        square.sum().backward()  # x holds the gradient now: autograd's version check refuses it


def test_cross_entropy_node_checks_what_a_direct_call_passes(device):
    """torch.ops.fusedloss.cross_entropy_eager is public: a float target is refused, the
    gradient in the forward needs a node to take it, and the caller's target is version-checked."""
    op = torch.ops.fusedloss.cross_entropy_eager.default
    h = torch.randn(4, 5, device=device, requires_grad=True)
    with pytest.raises(ValueError, match="target.dtype"):
        op(h * 1, torch.zeros(4, device=device), -100, 0.0, 0, 0, 0.0, 2, 0.0, False, False)
    x = h * 1
    before = x.detach().clone()
    with torch.no_grad():
        op(x, torch.zeros(4, dtype=torch.long, device=device), -100, 0.0, 0, 0, 0.0, 2, 0.0, True, True)
    assert torch.equal(x, before)  # no node: nothing written
    t = torch.zeros(4, dtype=torch.uint8, device=device)
    loss = fusedloss.cross_entropy(h * 1, t)
    t.fill_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_cross_entropy_node_names_the_python_argument(device):
    x = torch.randn(4, 1, device=device, requires_grad=True) * 1
    with pytest.raises(ValueError, match=r"^label_smoothing: "):
        fusedloss.cross_entropy(x, torch.zeros(4, dtype=torch.long, device=device),
                                label_smoothing=0.1, smoothing_formula="megatron")


@pytest.mark.parametrize("in_forward", [False, True])
def test_nodes_share_the_core_of_check_device_errors(device, in_forward):
    """The nodes call fusedloss._C's core (one copy in the process): a target out of range in a
    kernel the C++ node launched is what fusedloss.check_device_errors() reports (on the CPU the
    call itself raises)."""
    op = torch.ops.fusedloss.cross_entropy_eager.default
    h = torch.randn(4, 10, device=device, requires_grad=True)
    t = torch.tensor([1, 2, 10, 3], device=device)
    if device == "cpu":
        with pytest.raises(ValueError, match=r"target\[2\]: got 10"):
            op(h * 1, t, -100, 0.0, 0, 0, 0.0, 1, 0.0, False, in_forward)
        return
    loss = op(h * 1, t, -100, 0.0, 0, 0, 0.0, 1, 0.0, False, in_forward)  # reduction sum
    assert loss.grad_fn is not None and "CppFunction" in type(loss.grad_fn).__name__
    with pytest.raises(ValueError, match=r"target\[2\]: got 10"):
        fusedloss.check_device_errors()
    fusedloss.check_device_errors()  # cleared once reported


lce_module = importlib.import_module("fusedloss.linear_cross_entropy")


def _lce_run(hidden, weight, target, kw, through):
    h_leaf, h = _through(*hidden, through)
    w_leaf, w = _through(*weight, "view_of_leaf")
    loss = fusedloss.linear_cross_entropy(h, w, target, **kw)
    loss.backward(torch.full_like(loss, 0.5) if loss.dim() == 0 else
                  torch.rand(loss.shape, device=loss.device, generator=torch.Generator(loss.device).manual_seed(1)))
    return [loss.detach(), h_leaf.grad, w_leaf.grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(12, 24), (3, 4, 24)], ids=["2d", "3d"])
@pytest.mark.parametrize("kw", [
    pytest.param(kw, id=name) for name, kw in [
        ("mean", {}), ("sum+smoothing+z+softcap", {"reduction": "sum", "label_smoothing": 0.1,
                                                   "z_loss": 1e-3, "logit_softcap": 4.0}),
        ("none+ignore", {"reduction": "none", "ignore_index": 3}),
        ("recompute+megatron", {"backward_mode": "recompute", "label_smoothing": 0.2,
                                "smoothing_formula": "megatron"}),
        ("weight_dtype", {"dweight_accumulation": "weight_dtype"}),
        ("no_inplace+chunks", {"inplace_backward": False, "workspace_bytes": 1024})]])
@pytest.mark.parametrize("through", ["view_of_leaf", "intermediate"])
def test_linear_cross_entropy_same_bits_as_python_nodes(device, dtype, layout, shape, kw, through,
                                                        monkeypatch):
    """Every layout of hidden (2-D and 3-D), the weight in another layout beside it (rows of a
    wider tensor, transposed, one row expanded over the vocabulary, every other row, offset),
    targets in other index dtypes and layouts, each reduction and backward mode, fp32 or
    weight-dtype accumulation, in place or not, chunked or not."""
    V, H = 37, shape[-1]
    hidden = build(layout, shape, _made(dtype, device), step=5)
    w_layout = {"contiguous": None, "sliced": "transposed", "offset": "expanded",
                "expanded": "sliced", "transposed": "offset", "overlapping": "contiguous"}[layout]
    weight = (build(w_layout, (V, H), _made(dtype, device), step=3) if w_layout else
              (build("contiguous", (V, 2 * H), _made(dtype, device))[0], lambda b: b[:, :H]))
    N = hidden[1](hidden[0]).numel() // H
    ids = torch.randint(0, V, (2 * N,), device=device)
    ids[1] = kw.get("ignore_index", -100)
    target = {"contiguous": ids[:N], "sliced": ids[::2], "offset": ids[1:N + 1].to(torch.int32),
              "expanded": ids[:1].expand(N), "transposed": ids[:N].clamp(min=0).to(torch.uint8),
              "overlapping": ids[:N].to(torch.int16)}[layout].reshape(shape[:-1])
    _same_bits_as_python_node(lambda: _lce_run(hidden, weight, target, kw, through), lce_module,
                              monkeypatch, layout=layout, device=device)


def test_linear_cross_entropy_node_in_use_and_inplace_consumed(device):
    h = torch.randn(5, 8, device=device, requires_grad=True)
    w = torch.randn(11, 8, device=device, requires_grad=True)
    t = torch.randint(0, 11, (5,), device=device)
    loss = fusedloss.linear_cross_entropy(h, w, t)  # in_forward, scaled in place in the backward
    assert "Cpp" in type(loss.grad_fn).__name__
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()
    # a loss_mask too: its row weights through the C++ node
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], device=device)
    loss = fusedloss.linear_cross_entropy(h, w, t, reduction="none", loss_mask=mask)
    assert "Cpp" in type(loss.grad_fn.next_functions[0][0]).__name__  # (under the target's view)
    h.grad = w.grad = None
    (loss * mask).sum().backward()
    ref_h, ref_w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (fusedloss.linear_cross_entropy(ref_h, ref_w, t, reduction="none", backward_mode="recompute")
     * mask).sum().backward()
    torch.testing.assert_close(h.grad, ref_h.grad)
    torch.testing.assert_close(w.grad, ref_w.grad)
    # routed to the Python node: a tp_group or an accumulator (those stay in Python)
    acc = torch.zeros(11, 8, device=device)
    loss = fusedloss.linear_cross_entropy(h, w, t, weight_grad_accumulator=acc)
    assert "Cpp" not in type(loss.grad_fn).__name__
    loss.backward()
    assert acc.abs().sum() > 0


def test_linear_cross_entropy_node_checks_what_a_direct_call_passes(device):
    op = torch.ops.fusedloss.linear_cross_entropy_eager.default
    h = torch.randn(4, 8, device=device, requires_grad=True)
    w = torch.randn(6, 8, device=device)
    with pytest.raises(ValueError, match="target.dtype"):
        op(h, w, torch.zeros(4, device=device), None, -100, 0.0, 0, 0, 0.0, 2, 0.0, 0, 1, False, True, True)
    with pytest.raises(ValueError, match="weight"):  # the core names H's mismatch
        op(h, torch.randn(6, 7, device=device), torch.zeros(4, dtype=torch.long, device=device),
           None, -100, 0.0, 0, 0, 0.0, 2, 0.0, 0, 1, False, True, True)
    t = torch.zeros(4, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="target.dtype"):  # uint64 ids may not fit int64
        op(h, w, t.to(torch.uint64), None, -100, 0.0, 0, 0, 0.0, 2, 0.0, 0, 1, False, True, True)
    with pytest.raises(ValueError, match="hidden: got 1 dimensions"):
        op(h[0], w, t[:1], None, -100, 0.0, 0, 0, 0.0, 2, 0.0, 0, 1, False, True, True)
    with pytest.raises(ValueError, match="weight: got 3 dimensions"):
        op(h, w[None], t, None, -100, 0.0, 0, 0, 0.0, 2, 0.0, 0, 1, False, True, True)
    with pytest.raises(ValueError, match="workspace_bytes: got -1"):
        op(h, w, t, None, -100, 0.0, 0, 0, 0.0, 2, 0.0, -1, 1, False, True, True)
    with torch.no_grad():  # no node: the forward alone, whatever mode the caller passed
        loss = op(h, w, t, None, -100, 0.0, 0, 0, 0.0, 2, 0.0, 0, 1, False, True, True)
    assert loss.grad_fn is None and torch.isfinite(loss)
    # backward_mode 0 ("auto"): in_forward for a mean, recompute for none, as the Python API
    auto = op(h, w, t, None, -100, 0.0, 0, 0, 0.0, 2, 0.0, 0, 0, False, True, True)
    assert torch.equal(auto, fusedloss.linear_cross_entropy(h, w, t))
    per_row = op(h, w, t, None, -100, 0.0, 0, 0, 0.0, 0, 0.0, 0, 0, False, True, True)
    assert torch.equal(per_row, fusedloss.linear_cross_entropy(h, w, t, reduction="none"))
    # fp16: auto takes recompute there (the core refuses in_forward for fp16), as the Python API
    h16, w16 = h.detach().half().requires_grad_(), w.detach().half().requires_grad_()
    auto16 = op(h16, w16, t, None, -100, 0.0, 0, 0, 0.0, 2, 0.0, 0, 0, False, True, True)
    auto16.backward()
    h16_grad, h16.grad = h16.grad, None
    fusedloss.linear_cross_entropy(h16, w16, t).backward()
    assert torch.equal(h16_grad, h16.grad)
    with pytest.raises(ValueError, match="backward_mode: got InForward with fp16 inputs"):
        op(h16, w16, t, None, -100, 0.0, 0, 0, 0.0, 2, 0.0, 0, 1, False, True, True)
    # a new weight gradient is returned as it is, not as a view of itself
    g = torch.autograd.grad(op(h, w.requires_grad_(), t, None, -100, 0.0, 0, 0, 0.0, 2, 0.0, 0, 1,
                               False, True, False), w)[0]
    assert g._base is None
    # the loss_mask as the Python caller converts it: fp32, contiguous, one per target
    for bad in (torch.ones(4, dtype=torch.float64, device=device), torch.ones(3, device=device),
                torch.ones(8, device=device)[::2]):
        with pytest.raises(ValueError, match=r"row_weight: got .*expected a contiguous float32 \[4\]"):
            op(h, w, t, bad, -100, 0.0, 0, 0, 0.0, 0, 0.0, 0, 1, False, True, True)
    with pytest.raises(ValueError, match="row_weight: got a tensor that requires grad"):
        op(h, w, t, torch.ones(4, device=device, requires_grad=True), -100, 0.0, 0, 0, 0.0, 0,
           0.0, 0, 0, False, True, True)
    # no rows: Auto recomputes (nothing to weight; an empty tensor has no address)
    empty = op(h[:0], w, t[:0], torch.ones(0, device=device), -100, 0.0, 0, 0, 0.0, 0, 0.0, 0, 0,
               False, True, True)
    empty.sum().backward()
    # Auto with row weights and reduction none: the in-forward gradients of sum(w * loss)
    rw = torch.tensor([1.0, 0.0, 1.0, 1.0], device=device)
    loss = op(h, w, t, rw, -100, 0.0, 0, 0, 0.0, 0, 0.0, 0, 0, False, True, True)
    with pytest.raises(ValueError, match=r"grad_loss\[1\]"):  # (CPU: the check raises)
        loss.sum().backward() if device == "cpu" else (loss.sum().backward(), fusedloss.check_device_errors())



def test_linear_cross_entropy_node_forward_only_mode_backward_is_recompute(device):
    """A direct call with the schema's forward-only mode (-2) that a backward follows runs as
    Recompute throughout: the same bits as mode 2, the exact vocabulary blocks of a 16-bit
    weight gradient included."""
    op = torch.ops.fusedloss.linear_cross_entropy_eager.default
    h0 = torch.randn(64, 32, device=device).bfloat16()
    w0, t = (torch.randn(512, 32, device=device) * 0.1).bfloat16(), torch.randint(0, 512, (64,), device=device)
    grads = []
    for mode in (2, -2):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        op(h, w, t, None, -100, 0.0, 0, 0, 0.0, 1, 0.0, 1 << 16, mode, False, True, False).backward()
        grads.append((h.grad, w.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="allocations are counted on a CUDA device")
def test_linear_cross_entropy_node_runs_the_forward_alone_when_no_gradient_follows():
    """No node, no gradient buffers: under no_grad, or with no input requiring grad, the C++
    node's forward keeps no dhidden [N, H] or fp32 dweight [V, H] (the forward alone). Its
    scratch (the chunk buffer and the GEMM workspace, from torch's allocator) is what the core
    says a forward of these arguments takes; the gradients would add 10 MiB beyond it."""
    from fusedloss import _C
    from fusedloss._views import matrix
    h = torch.randn(1024, 512, device="cuda")
    w = torch.randn(4096, 512, device="cuda")
    t = torch.randint(0, 4096, (1024,), device="cuda")
    gradients = (h.numel() + w.numel()) * 4
    scratch = _C.linear_cross_entropy_forward_scratch_bytes(
        matrix(h), matrix(w), _C.CrossEntropyOptions(), _C.LinearCrossEntropyOptions(), 1)
    for ctx, (hh, ww) in [(torch.no_grad, (h.requires_grad_(), w)), (contextlib.nullcontext, (h.detach(), w))]:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with ctx():
            loss = fusedloss.linear_cross_entropy(hh, ww, t, backward_mode="in_forward")
        torch.cuda.synchronize()
        assert loss.grad_fn is None
        assert torch.cuda.max_memory_allocated() - before < scratch + gradients / 2


def test_unattached_nodes_raise_instead_of_crashing():
    """A process whose _C reports another table layout: the import falls back to the Python
    nodes with a warning, and a direct call of the still-registered op raises (no crash)."""
    child = textwrap.dedent("""
        import glob, importlib.util, os, sys, warnings
        import torch
        package = importlib.util.find_spec("fusedloss").submodule_search_locations[0]  # (not imported)
        so = glob.glob(os.path.join(package, "_C.*"))[0]
        spec = importlib.util.spec_from_file_location("fusedloss._C", so)
        C = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(C)
        sys.modules["fusedloss._C"] = C
        C._CORE_TABLE_SIZE += 8  # what a _C of another build would report
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import fusedloss
            from fusedloss import _native
        assert _native.ops is None and "core table differs" in _native.status, _native.status
        assert any("Python nodes" in str(w.message) for w in caught)
        x = torch.randn(3, 4, requires_grad=True)
        assert "Cpp" not in type(fusedloss.rms_norm(x, torch.ones(4)).grad_fn).__name__
        try:
            torch.ops.fusedloss.rms_norm_eager(x, torch.ones(4), 1e-5, False)
        except RuntimeError as error:
            assert "core attached" in str(error), error
        else:
            raise AssertionError("the unattached op returned")
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
