"""fusedloss.cross_entropy against torch.nn.functional.cross_entropy in float64."""
import pytest
import torch
import torch.nn.functional as F

import fusedloss

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def reference(logits, target, ignore_index=-100, label_smoothing=0.0, reduction="mean", z_loss=0.0,
              formula="pytorch"):
    """float64: torch's cross-entropy plus z * lse^2; Megatron's smoothing a = ls V/(V-1)."""
    x = logits.detach().double().reshape(-1, logits.size(-1)).requires_grad_(True)
    t = target.reshape(-1)
    ls = label_smoothing
    if formula == "megatron" and ls > 0:
        ls = ls * x.size(1) / (x.size(1) - 1)
    per_row = F.cross_entropy(x, t, ignore_index=ignore_index, label_smoothing=ls, reduction="none")
    valid = t != ignore_index
    per_row = per_row + z_loss * torch.where(valid, torch.logsumexp(x, -1) ** 2, 0.0)
    if reduction == "none":
        return x, per_row.view(target.shape)
    if reduction == "sum":
        return x, per_row.sum()
    return x, per_row.sum() / valid.sum().clamp(min=1)


def check(device, dtype=torch.float32, shape=(37, 1001), inplace=False, ignore_frac=0.2, **opts):
    logits = (torch.randn(*shape, dtype=torch.float64) * 3).to(dtype).to(device)
    target = torch.randint(0, shape[-1], shape[:-1], device=device)
    ignore = opts.get("ignore_index", -100)
    target[torch.rand(shape[:-1], device=device) < ignore_frac] = ignore
    x_ref, ref = reference(logits, target, **opts)
    x = logits.clone().requires_grad_(True)
    # In-place writes into the leaf's storage: run through a non-leaf so autograd owns it.
    inp = x * 1 if inplace else x
    loss = fusedloss.cross_entropy(inp, target, inplace_backward=inplace, **opts)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=2e-5, atol=2e-6)
    g = torch.rand_like(ref) + 0.5
    loss.backward(g.float())
    ref.backward(g)
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(x.grad.double(), x_ref.grad.view(shape), rtol=tol, atol=tol * x_ref.grad.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_matches_torch(device, dtype, reduction):
    check(device, dtype, reduction=reduction)


@pytest.mark.parametrize("ls", [0.1, 0.3])
@pytest.mark.parametrize("formula", ["pytorch", "megatron"])
def test_label_smoothing(device, ls, formula):
    logits = torch.randn(29, 503, device=device)
    target = torch.randint(0, 503, (29,), device=device)
    target[3] = -100
    x_ref, ref = reference(logits, target, label_smoothing=ls, formula=formula)
    x = logits.clone().requires_grad_(True)
    loss = fusedloss.cross_entropy(x, target, label_smoothing=ls, smoothing_formula=formula)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=2e-5, atol=1e-6)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(x.grad.double(), x_ref.grad, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("z", [1e-4, 0.05])
def test_z_loss(device, z):
    check(device, z_loss=z, label_smoothing=0.1)


def test_three_dim_megatron_layout(device):
    check(device, shape=(16, 3, 777), reduction="none")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_backward(device, dtype):
    check(device, dtype, inplace=True, reduction="mean")


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_written_in_the_forward(device, dtype, reduction):
    """grad_in_forward=True: the logits hold the gradient (for a unit upstream gradient) once
    the forward returns, and the backward scales it. fp16 keeps the in-place backward."""
    shape = (19, 1003)  # odd V: rows start off the 16-byte boundary
    logits = (torch.randn(*shape, dtype=torch.float64) * 3).to(dtype).to(device)
    target = torch.randint(0, shape[-1], shape[:-1], device=device)
    target[::4] = -100
    x_ref, ref = reference(logits, target, reduction=reduction, label_smoothing=0.1)
    ref.backward()
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    atol = tol * x_ref.grad.abs().max().item()
    for upstream in (1.0, 0.25):
        x = logits.clone().requires_grad_(True)
        inp = x * 1
        loss = fusedloss.cross_entropy(inp, target, grad_in_forward=True, reduction=reduction,
                                       label_smoothing=0.1)
        torch.testing.assert_close(loss.double(), ref.detach(), rtol=2e-5, atol=2e-6)
        if dtype == torch.float16:  # the logits stay until the backward
            torch.testing.assert_close(inp.detach(), logits)
        else:  # already the gradient, before any backward
            torch.testing.assert_close(inp.detach().double(), x_ref.grad, rtol=tol, atol=atol)
        (loss * upstream).backward()
        torch.testing.assert_close(x.grad.double(), x_ref.grad * upstream, rtol=tol, atol=atol)


def test_gradient_in_the_forward_guards(device):
    logits = torch.randn(8, 64, device=device)
    target = torch.randint(0, 64, (8,), device=device)
    x = logits.clone().requires_grad_(True)
    inp = x * 1
    earlier = inp.sin()  # an autograd reader of the logits, recorded before they are consumed
    loss = fusedloss.cross_entropy(inp, target, grad_in_forward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + earlier.sum()).backward()
    # a second backward would scale the gradient twice: refused
    inp = x * 1
    loss = fusedloss.cross_entropy(inp, target, grad_in_forward=True, reduction="sum")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()
    # only when asked: inplace_backward alone keeps the logits until the backward
    inp = x * 1
    fusedloss.cross_entropy(inp, target, inplace_backward=True)
    torch.testing.assert_close(inp, logits)
    with pytest.raises(ValueError, match="grad_in_forward.*reduction='none'"):
        fusedloss.cross_entropy(x * 1, target, grad_in_forward=True, reduction="none")
    with torch.no_grad():  # nothing to differentiate: nothing written
        kept = logits.clone()
        fusedloss.cross_entropy(kept, target, grad_in_forward=True)
        torch.testing.assert_close(kept, logits)
    # a leaf is the caller's: its gradient goes to a new buffer, with the in-place warning
    leaf = logits.clone().requires_grad_(True)
    with pytest.warns(UserWarning, match="not overwritten"):
        fusedloss.cross_entropy(leaf, target, grad_in_forward=True).backward()
    torch.testing.assert_close(leaf.detach(), logits)


def test_ignore_index_and_all_ignored(device):
    check(device, ignore_index=5, ignore_frac=0.5)
    logits = torch.randn(6, 50, device=device, requires_grad=True)
    target = torch.full((6,), -100, device=device)
    loss = fusedloss.cross_entropy(logits, target)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.count_nonzero(logits.grad) == 0


def test_strided_last_dim_and_padded_rows(device):
    base = torch.randn(20, 64, device=device)
    logits = base.t()[:, :20]  # last-dim stride != 1: copied, still right
    target = torch.randint(0, 20, (64,), device=device)
    torch.testing.assert_close(fusedloss.cross_entropy(logits, target).double(),
                               F.cross_entropy(logits.double(), target), rtol=2e-5, atol=1e-6)
    padded = torch.randn(10, 130, device=device)[:, :127]  # row stride 130
    t = torch.randint(0, 127, (10,), device=device)
    torch.testing.assert_close(fusedloss.cross_entropy(padded, t, reduction="none").double(),
                               F.cross_entropy(padded.double(), t, reduction="none"), rtol=2e-5, atol=1e-6)


def test_gradcheck(device):
    x = torch.randn(4, 9, device=device, requires_grad=True)
    t = torch.randint(0, 9, (4,), device=device)
    def fn(v):
        return fusedloss.cross_entropy(v, t, label_smoothing=0.1, z_loss=0.01, reduction="sum")
    # the kernels compute in fp32, so finite differences use fp32 inputs and fp32 tolerances
    with pytest.warns(UserWarning, match="double precision"):
        assert torch.autograd.gradcheck(fn, (x,), eps=1e-3, atol=2e-3, rtol=2e-3)


def test_module_wrapper(device):
    m = fusedloss.CrossEntropyLoss(label_smoothing=0.1, reduction="sum")
    x = torch.randn(5, 40, device=device)
    t = torch.randint(0, 40, (5,), device=device)
    torch.testing.assert_close(m(x, t).double(), F.cross_entropy(x.double(), t, label_smoothing=0.1, reduction="sum"),
                               rtol=2e-5, atol=1e-6)
    assert "label_smoothing=0.1" in repr(m)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_zero_rows_and_single_class(device, reduction):
    empty = torch.randn(0, 7, device=device, requires_grad=True)
    loss = fusedloss.cross_entropy(empty, torch.zeros(0, dtype=torch.long, device=device), reduction=reduction)
    assert loss.numel() == (0 if reduction == "none" else 1)
    if reduction != "none":
        assert loss.item() == 0.0
    check(device, shape=(9, 1), reduction=reduction, ignore_frac=0.0)


@pytest.mark.parametrize("mode", ["inplace_backward", "grad_in_forward"])
def test_in_place_with_a_target_that_is_a_view_of_the_logits(device, mode):
    """Targets kept in the logits' own memory (the bits of row 0's first elements, tiny
    subnormal logits) are read as the caller passed them while the gradient overwrites the
    logits."""
    N, V = 8, 16
    ids = torch.randint(0, V, (N,), dtype=torch.int32)
    x0 = torch.randn(N, V)
    x0.view(-1)[:N] = ids.view(torch.float32)
    leaf = x0.to(device, copy=True).requires_grad_(True)
    x = leaf * 1  # an intermediate: eligible for the in-place paths
    target = x.detach().view(-1).view(torch.int32)[:N]
    assert target.data_ptr() == x.data_ptr() and torch.equal(target.cpu(), ids)
    loss = fusedloss.cross_entropy(x, target, reduction="sum", **{mode: True})
    loss.backward(torch.tensor(0.5, device=device))
    ref_leaf = x0.double().requires_grad_(True)
    ref = F.cross_entropy(ref_leaf, ids.long(), reduction="sum")
    (ref * 0.5).backward()
    torch.testing.assert_close(loss.double().cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(leaf.grad.double().cpu(), ref_leaf.grad, rtol=1e-5, atol=1e-6)


def test_module_checks_the_option_pair_at_construction():
    with pytest.raises(ValueError, match="grad_in_forward: got True with reduction='none'"):
        fusedloss.CrossEntropyLoss(grad_in_forward=True, reduction="none")
    with pytest.raises(TypeError, match="check_shard_agreement: got 'yes'"):
        fusedloss.CrossEntropyLoss(check_shard_agreement="yes")
    fusedloss.CrossEntropyLoss(grad_in_forward=True, reduction="sum")


def weighted_reference(x, target, weight, label_smoothing=0.0, reduction="mean",
                       formula="pytorch", ignore_index=-100):
    """float64 cross-entropy of logits x [N, V] with a per-class weight and label smoothing:
    torch's F.cross_entropy(weight=..., label_smoothing=...) for the PyTorch formula; for
    Megatron's, its label distribution (1 - ls on the target, ls / (V - 1) on each other class)
    weighted as torch weighs its own, sum_c q_c w_c (-log p_c), 'mean' over sum w[target]."""
    if formula == "pytorch":
        return F.cross_entropy(x, target, weight=weight, label_smoothing=label_smoothing,
                               reduction=reduction, ignore_index=ignore_index)
    counted = target != ignore_index
    safe = torch.where(counted, target, 0)
    q = torch.full_like(x, label_smoothing / (x.size(1) - 1))
    q.scatter_(1, safe[:, None], 1.0 - label_smoothing)
    per_row = torch.where(counted, -(q * weight * x.log_softmax(-1)).sum(-1), 0.0)
    if reduction == "none":
        return per_row
    total = per_row.sum()
    return total if reduction == "sum" else total / torch.where(counted, weight[safe], 0.0).sum()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing, formula", [(0.0, "pytorch"), (0.1, "pytorch"),
                                                      (0.2, "megatron")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_class_weight_matches_torch(device, reduction, label_smoothing, formula, dtype):
    """weight is F.cross_entropy's per-class weight: rows scaled by their class's weight, 'mean'
    over the counted rows' weights, and with label smoothing torch's weighted smoothing term
    (Megatron's formula: its label distribution weighted alike); the module keeps it as a
    buffer."""
    x = (torch.randn(37, 50, dtype=torch.float64) * 2).to(dtype).double().to(device)
    t = torch.randint(0, 50, (37,), device=device)
    t[::4] = -100
    w = torch.rand(50, device=device) + 0.25
    w[t[1]] = 0.0  # a class of weight 0: its rows keep their smoothing term
    xx = x.to(dtype).requires_grad_()
    options = dict(weight=w, reduction=reduction, label_smoothing=label_smoothing,
                   smoothing_formula=formula)
    loss = fusedloss.cross_entropy(xx, t, **options)
    up = torch.rand_like(loss) + 0.5
    loss.backward(up)
    x64 = x.clone().requires_grad_()
    ref = weighted_reference(x64, t, w.double(), label_smoothing, reduction, formula)
    ref.backward(up.double())
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    # bf16: the op's gradient and the smoothing term's, each rounded once to bf16, then added
    atol = 1e-6 if dtype == torch.float32 else 2 ** -8 * x64.grad.abs().max().item()
    torch.testing.assert_close(xx.grad.double(), x64.grad, rtol=1e-5 if atol < 1e-5 else 1e-2,
                               atol=atol)
    module = fusedloss.CrossEntropyLoss(**options)
    assert "weight" in dict(module.named_buffers())
    torch.testing.assert_close(module(x.to(dtype), t), loss.detach())


@pytest.mark.parametrize("formula", ["pytorch", "megatron"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_unit_class_weight_with_smoothing_is_the_plain_loss(device, formula, reduction):
    """A weight of ones gives the op's own smoothed loss for either formula, over [s, b, V]
    logits too: the weighted terms are the same definition."""
    x = torch.randn(3, 7, 40, device=device) * 2
    t = torch.randint(0, 40, (3, 7), device=device)
    t[0, ::3] = -100
    options = dict(label_smoothing=0.15, smoothing_formula=formula, reduction=reduction)
    plain = fusedloss.cross_entropy(x, t, **options)
    weighted = fusedloss.cross_entropy(x, t, weight=torch.ones(40, device=device), **options)
    torch.testing.assert_close(weighted, plain, rtol=1e-5, atol=1e-6)


def test_class_weight_with_smoothing_and_the_extra_outputs(device):
    """The arg-max outputs beside a weighted, smoothed loss: the loss as without them."""
    x = torch.randn(29, 33, device=device)
    t = torch.randint(0, 33, (29,), device=device)
    t[::5] = -100
    w = torch.rand(33, device=device) + 0.5
    out = fusedloss.cross_entropy(x, t, weight=w, label_smoothing=0.1, return_z_loss=True,
                                  return_token_accuracy=True, return_predicted_tokens=True)
    ref = weighted_reference(x.double(), t, w.double(), 0.1)
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-5, atol=1e-6)
    counted = t != -100
    predicted = x.double().argmax(-1)
    assert torch.equal(out.predicted_tokens, torch.where(counted, predicted, -1))
    torch.testing.assert_close(out.token_accuracy,
                               (predicted == t)[counted].float().mean())
    assert out.z_loss.item() == 0.0


@pytest.mark.parametrize("formula", ["pytorch", "megatron"])
def test_class_weight_with_smoothing_compiled(device, formula):
    """The weighted smoothing term (its gather and the op beside it) in a fullgraph
    torch.compile: the loss and the logits' gradient as eager, against float64."""
    x = torch.randn(23, 40, device=device, dtype=torch.float64).float()
    t = torch.randint(0, 40, (23,), device=device)
    t[::4] = -100
    w = torch.rand(40, device=device) + 0.25
    options = dict(weight=w, label_smoothing=0.1, smoothing_formula=formula)
    compiled = torch.compile(fusedloss.cross_entropy, fullgraph=True)
    xx = x.clone().requires_grad_()
    loss = compiled(xx, t, **options)
    loss.backward()
    x64 = x.double().requires_grad_()
    ref = weighted_reference(x64, t, w.double(), 0.1, "mean", formula)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xx.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["sliced", "expanded", "non-contiguous view of a leaf"])
@pytest.mark.parametrize("wdtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_class_weight_any_layout_and_dtype(device, layout, wdtype):
    """The per-class weight is read in any layout and float dtype (as F.cross_entropy reads it
    in fp32 after the cast), for both ops, and never written."""
    V = 24
    base = {"sliced": lambda: torch.rand(2 * V) + 0.5,
            "expanded": lambda: torch.tensor([0.7]),
            "non-contiguous view of a leaf": lambda: torch.rand(V, 3) + 0.5}[layout]()
    base = base.to(device, wdtype)
    view = {"sliced": lambda b: b[::2], "expanded": lambda b: b.expand(V),
            "non-contiguous view of a leaf": lambda b: b[:, 1]}[layout](base)
    before = base.clone()
    x = torch.randn(11, V, device=device)
    t = torch.randint(0, V, (11,), device=device)
    t[3] = -100
    ref = F.cross_entropy(x.double(), t, weight=view.double())
    got = fusedloss.cross_entropy(x, t, weight=view)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    h = torch.randn(11, 8, device=device)
    w = torch.randn(V, 8, device=device)
    ref = F.cross_entropy(F.linear(h.double(), w.double()), t, weight=view.double())
    got = fusedloss.linear_cross_entropy(h, w, t, class_weight=view)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(base, before)
