"""Conventions shared by the ops (docs/conventions.md): the inplace_backward defaults follow one
rule, a backward overwrites a tensor the caller passed in only when asked, while memory only the
op can reach is reused by default."""
import inspect

import pytest
import torch
import torch.nn.functional as F

import fusedloss


def _default(fn, name):
    return inspect.signature(fn).parameters[name].default


def test_inplace_backward_defaults_follow_one_rule():
    # these overwrite an input the caller passed (logits, y, gate and up): off unless asked
    assert _default(fusedloss.cross_entropy, "inplace_backward") is False
    assert _default(fusedloss.swiglu, "inplace_backward") is False
    assert "inplace_backward" not in fusedloss.SwiGLU().options  # the function's default
    # this reuses the gradients it saved itself, which nobody else can reach: on
    assert _default(fusedloss.linear_cross_entropy, "inplace_backward") is True
    for fn in (fusedloss.cross_entropy, fusedloss.swiglu):
        assert "a backward overwrites a tensor the caller" in " ".join(fn.__doc__.split())


def test_default_backward_leaves_every_input_as_it_was(device):
    """By default no backward writes a tensor the caller passed, not even an autograd
    intermediate the op could take (plain code may read it after the backward)."""
    leaf = torch.randn(6, 10, device=device, requires_grad=True)
    logits = leaf * 1
    before = logits.detach().clone()
    target = torch.randint(0, 10, (6,), device=device)
    fusedloss.cross_entropy(logits, target).backward()
    assert torch.equal(logits.detach(), before)
    ref = leaf.detach().clone().requires_grad_(True)
    F.cross_entropy(ref, target).backward()
    torch.testing.assert_close(leaf.grad, ref.grad, rtol=2e-5, atol=2e-6)

    y = torch.randn(6, 16, device=device, requires_grad=True) * 1
    before = y.detach().clone()
    fusedloss.swiglu(y).sum().backward()
    gate, up = (torch.randn(6, 8, device=device, requires_grad=True) * 1 for _ in range(2))
    kept = gate.detach().clone(), up.detach().clone()
    fusedloss.swiglu(gate, up).sum().backward()
    assert torch.equal(y.detach(), before)
    assert torch.equal(gate.detach(), kept[0]) and torch.equal(up.detach(), kept[1])


def test_linear_ce_default_reuses_only_its_own_buffers(device):
    """The linear cross-entropy's default in-place backward scales the gradients it saved in the
    forward: hidden and weight are never written, and only a second backward through the same
    loss (retain_graph) is ruled out, with an error that names the flag."""
    hidden_leaf = torch.randn(12, 16, device=device, requires_grad=True)
    weight = torch.randn(20, 16, device=device, requires_grad=True)
    target = torch.randint(0, 20, (12,), device=device)
    hidden = hidden_leaf * 1
    kept = hidden.detach().clone(), weight.detach().clone()
    loss = fusedloss.linear_cross_entropy(hidden, weight, target)
    loss.backward(retain_graph=True)
    assert torch.equal(hidden.detach(), kept[0]) and torch.equal(weight.detach(), kept[1])
    h64, w64 = (t.detach().double().requires_grad_(True) for t in kept)
    F.cross_entropy(h64 @ w64.t(), target).backward()
    torch.testing.assert_close(hidden_leaf.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)
    with pytest.raises(RuntimeError, match="second backward.*inplace_backward"):
        loss.backward()
    # asked not to: a second backward adds the same gradients again
    weight.grad = None
    loss = fusedloss.linear_cross_entropy(hidden_leaf, weight, target, inplace_backward=False)
    loss.backward(retain_graph=True)
    first = weight.grad.clone()
    loss.backward()
    torch.testing.assert_close(weight.grad, 2 * first)
