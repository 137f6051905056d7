"""fusedloss.verl.linear_cross_entropy, verl's fused log-prob kernel's call: against float64 (values
and gradients of log-probs and entropy, every reduction, [b, s, H] hidden, gloo TP 2 with verl's
partial hidden gradient), against verl's own torch implementation of the same head, and
apply_fusedloss_to_verl on verl's kernel module.

verl's package __init__ imports ray, tensordict and omegaconf (verl's trainer), and its Triton
kernel needs CUDA, so the tests load the two torch-only modules they need from the installed verl
(pip install --no-deps verl) by file: verl/utils/experimental/torch_functional.py (its torch
backend of the same fused path, FusedLinearForPPOFunction) and
verl/utils/kernel/linear_cross_entropy.py (the module the patch rewires)."""
import importlib.util
import os
import sys

import pytest
import torch
import torch.distributed as dist

import fusedloss.verl
from dist_util import run_world

_TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _verl_file(name, relpath):
    """A module of the installed verl, executed alone under its own name."""
    spec = importlib.util.find_spec("verl")
    if spec is None:  # CI installs it (launch/python.sh); a GPU machine without a package index may not
        pytest.skip("verl is not installed (launch/python.sh: pip install --no-deps verl)")
    path = os.path.join(list(spec.submodule_search_locations)[0], relpath)
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def reference(h, w, labels, temperature):
    """Float64 (log_probs, entropy, logits) per row of h [..., H] against w [V, H]."""
    logits = (h.reshape(-1, h.size(-1)) @ w.t()) / temperature
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(1, labels.reshape(-1, 1))[:, 0]
    return lp, -(logp.exp() * logp).sum(-1), logits


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _problem(device, dtype, shape, H=40, V=173):
    h = torch.randn(*shape, H)
    w = torch.randn(V, H) * (2.0 / H ** 0.5)
    labels = torch.randint(0, V, shape)
    return h.to(device, dtype), w.to(device, dtype), labels.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean", "MEAN"])
@pytest.mark.parametrize("shape", [(29,), (3, 11)])
def test_against_float64(device, dtype, reduction, shape):
    h, w, labels = _problem(device, dtype, shape)
    temperature = float(torch.empty(()).uniform_(0.5, 1.5))
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = fusedloss.verl.linear_cross_entropy(hh, ww, labels, temperature, reduction)
    n = labels.numel()
    assert ent.shape == (n,) and lp.shape == ((n,) if reduction == "none" else ())
    assert lp.dtype == ent.dtype == torch.float32
    a, b = torch.randn(lp.shape, device=device), torch.randn(n, device=device)
    ((a * lp).sum() + (b * ent).sum()).backward()

    h64, w64 = h.double().cpu().requires_grad_(), w.double().cpu().requires_grad_()
    lp64, ent64, _ = reference(h64, w64, labels.cpu(), temperature)
    lp64 = {"none": lp64, "sum": lp64.sum(), "mean": lp64.sum() / n}[reduction.lower()]
    ((a.double().cpu() * lp64).sum() + (b.double().cpu() * ent64).sum()).backward()
    tol = _TOL[dtype]
    torch.testing.assert_close(lp.cpu().double(), lp64.detach(), rtol=tol, atol=tol * 10)
    torch.testing.assert_close(ent.cpu().double(), ent64.detach(), rtol=tol, atol=tol * 10)
    assert (lp <= 0).all() if reduction == "none" else lp <= 0  # log-probs, not the NLL
    assert hh.grad.shape == h.shape and hh.grad.dtype == dtype and ww.grad.dtype == dtype
    assert _rel(hh.grad.cpu(), h64.grad) <= tol * 2 and _rel(ww.grad.cpu(), w64.grad) <= tol * 2


def test_matches_verls_torch_implementation():
    """verl's FusedLinearForPPOFunction (its fused path's torch backend, [b, s] in and out): the
    same log-probs, entropy and gradients, up to fp32 rounding."""
    verl_torch = _verl_file("verl.utils.experimental.torch_functional",
                            "utils/experimental/torch_functional.py")
    h, w, labels = _problem("cpu", torch.float32, (2, 23))
    temperature = float(torch.empty(()).uniform_(0.5, 1.5))
    a, b = torch.randn(labels.shape), torch.randn(labels.shape)
    results = []
    for run in ("verl", "fusedloss"):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        if run == "verl":
            lp, ent = verl_torch.FusedLinearForPPOFunction.apply(hh, ww, labels, temperature, 16)
        else:
            lp, ent = fusedloss.verl.linear_cross_entropy(hh, ww, labels, temperature, "none")
            lp, ent = lp.view(labels.shape), ent.view(labels.shape)
        (a * lp + b * ent).sum().backward()
        results.append((lp.detach(), ent.detach(), hh.grad, ww.grad))
    for mine, theirs in zip(results[1], results[0]):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


def _tp(rank, world):
    torch.manual_seed(4321)  # the same problem on every rank
    h, w, labels = _problem("cpu", torch.float32, (2, 7), V=48)
    v_local = w.size(0) // world
    rows = slice(rank * v_local, (rank + 1) * v_local)
    hh, shard = h.clone().requires_grad_(), w[rows].clone().requires_grad_()
    lp, ent = fusedloss.verl.linear_cross_entropy(hh, shard, labels, 0.8, "none", dist.group.WORLD)
    a, b = torch.randn(lp.shape), torch.randn(ent.shape)
    (a * lp + b * ent).sum().backward()
    h64, w64 = h.double(), w.double().requires_grad_()
    lp64, ent64, logits = reference(h64, w64, labels, 0.8)
    logits.retain_grad()
    (a.double() * lp64 + b.double() * ent64).sum().backward()
    torch.testing.assert_close(lp.double(), lp64.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent64.detach(), rtol=1e-5, atol=1e-5)
    assert _rel(shard.grad, w64.grad[rows]) <= 1e-4
    # verl's convention: hidden's gradient is this rank's term, its shard's logits' share
    mine = (logits.grad[:, rows] @ w64[rows].detach()) / 0.8
    assert _rel(hh.grad.reshape(-1, h.size(-1)), mine) <= 1e-4


def test_gloo_tp_leaves_this_ranks_partial_hidden_gradient():
    run_world(2, _tp)


def test_apply_fusedloss_to_verl_rewires_verls_kernel(monkeypatch):
    """verl's kernel module, and a module that bound its function by name the way verl's
    Megatron forward does, call fusedloss after the patch (verl's positional call)."""
    name = "verl.utils.kernel.linear_cross_entropy"
    kernel = _verl_file(name, "utils/kernel/linear_cross_entropy.py")
    monkeypatch.setitem(sys.modules, name, kernel)
    original = kernel.linear_cross_entropy
    consumer = type(sys)("verl.models.mcore.model_forward_fused")
    exec(f"from {name} import linear_cross_entropy", consumer.__dict__)
    monkeypatch.setitem(sys.modules, consumer.__name__, consumer)
    assert consumer.linear_cross_entropy is original

    patched = fusedloss.verl.apply_fusedloss_to_verl()
    assert sorted(patched) == sorted([name, consumer.__name__])
    assert kernel.linear_cross_entropy is fusedloss.verl.linear_cross_entropy
    assert consumer.linear_cross_entropy is fusedloss.verl.linear_cross_entropy
    assert fusedloss.verl.apply_fusedloss_to_verl() == []  # applied once
    h, w, labels = _problem("cpu", torch.float32, (1, 9))
    lp, ent = consumer.linear_cross_entropy(h, w, labels, 1.0, "none", None)
    lp64, ent64, _ = reference(h.double(), w.double(), labels, 1.0)
    torch.testing.assert_close(lp.double(), lp64, rtol=1e-5, atol=1e-5)


def test_ignored_labels_give_zero_and_no_gradient():
    h, w, labels = _problem("cpu", torch.float32, (17,))
    labels[::3] = -100
    hh = h.clone().requires_grad_()
    lp, ent = fusedloss.verl.linear_cross_entropy(hh, w, labels, 1.0)
    (lp.sum() + ent.sum()).backward()
    assert not lp[::3].any() and not ent[::3].any() and not hh.grad[::3].any()


def test_bad_arguments_are_named():
    h, w, labels = _problem("cpu", torch.float32, (5,))
    with pytest.raises(ValueError, match=r"reduction: got 'avg', expected one of"):
        fusedloss.verl.linear_cross_entropy(h, w, labels, 1.0, "avg")
    with pytest.raises(ValueError, match=r"labels: got 4 elements \(shape \(4,\)\), expected one "
                                         r"per row of hidden \(5"):
        fusedloss.verl.linear_cross_entropy(h, w, labels[:4], 1.0)
    with pytest.raises(ValueError, match="temperature: got -1.0"):
        fusedloss.verl.linear_cross_entropy(h, w, labels, -1.0)
    with pytest.raises(TypeError, match="labels: got list"):
        fusedloss.verl.linear_cross_entropy(h, w, [0] * 5, 1.0)
