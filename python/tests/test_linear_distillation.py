"""fusedloss.linear_distillation_loss against float64 torch: every divergence, temperature,
reduction and dtype, the hard-label term, ignored tokens, no target, [s, b, H] inputs, views,
a teacher of another width and dtype, torch.compile, no_grad keeping nothing, and bad arguments
named. The reference differentiates its own float64 loss (autograd), not the library's formula."""
import pytest
import torch
import torch.nn.functional as F

import fusedloss

_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _problem(dtype, shape=(19,), Hs=16, Ht=24, V=37, teacher_dtype=None):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    sh = torch.randn(*shape, Hs, generator=g).to(dtype)
    sw = (torch.randn(V, Hs, generator=g) * 0.5).to(dtype)
    td = teacher_dtype or dtype
    th = torch.randn(*shape, Ht, generator=g).to(td)
    tw = (torch.randn(V, Ht, generator=g) * 0.5).to(td)
    t = torch.randint(0, V, shape, generator=g)
    t.view(-1)[::5] = -100
    return sh, sw, th, tw, t


def reference(sh64, sw64, dtype, th, tw, t, divergence="forward_kl", beta=0.5, temperature=1.0,
              hard_label_weight=0.0, reduction="mean", ignore_index=-100):
    """float64 from the definitions over the logits as each GEMM stores them (the student's
    rounded to `dtype` with a straight-through gradient, the teacher's to its own dtype)."""
    z = F.linear(sh64, sw64)
    z = z + (z.to(dtype).double() - z).detach()
    zt = F.linear(th.double(), tw.double()).to(th.dtype).double()
    lq, lp = (z / temperature).log_softmax(-1), (zt / temperature).log_softmax(-1)
    q, p = lq.exp(), lp.exp()
    if divergence == "forward_kl":
        soft = (p * (lp - lq)).sum(-1)
    elif divergence == "reverse_kl":
        soft = (q * (lq - lp)).sum(-1)
    else:
        lm = torch.log(beta * p + (1 - beta) * q)
        soft = beta * (p * (lp - lm)).sum(-1) + (1 - beta) * (q * (lq - lm)).sum(-1)
    loss = (1 - hard_label_weight) * soft
    counted = torch.ones_like(soft, dtype=torch.bool) if t is None else t != ignore_index
    if hard_label_weight:
        loss = loss + hard_label_weight * F.cross_entropy(
            z.reshape(-1, z.size(-1)), torch.where(counted, t, 0).reshape(-1),
            reduction="none").view(soft.shape)
    loss = torch.where(counted, loss, 0.0)
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.sum() / counted.sum().clamp(min=1)


def _check(dtype=torch.float32, shape=(19,), target=True, teacher_dtype=None, view=None,
           compiled=False, **options):
    sh, sw, th, tw, t = _problem(dtype, shape, teacher_dtype=teacher_dtype)
    t = None if not target else torch.where(t == -100, options.get("ignore_index", -100), t)
    leaves = [sh.clone().requires_grad_(), sw.clone().requires_grad_()]
    op = torch.compile(fusedloss.linear_distillation_loss, fullgraph=True) if compiled else \
        fusedloss.linear_distillation_loss
    loss = op(*[view(x) if view else x for x in leaves], th, tw, t, **options)
    refs = [x.detach().double().requires_grad_() for x in (sh, sw)]
    ref = reference(refs[0], refs[1], dtype, th, tw, t, **options)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    tol = _TOL[dtype]
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=tol, atol=tol)
    up = torch.rand_like(loss) + 0.5
    loss.backward(up)
    ref.backward(up.double())
    for got, want, name in zip((x.grad for x in leaves), (r.grad for r in refs), ("hidden", "weight")):
        assert got.dtype == dtype and got.shape == want.shape, name
        rel = ((got.double() - want).norm() / want.norm().clamp(min=1e-30)).item()
        assert rel <= 4 * tol, (name, rel)
    for x, before in ((th, th.clone()), (tw, tw.clone())):
        assert torch.equal(x, before), "the teacher was written"


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64(divergence, temperature, reduction, dtype):
    _check(dtype, divergence=divergence, temperature=temperature, reduction=reduction, beta=0.3)


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_hard_labels_ignored_tokens_and_no_target(divergence):
    _check(divergence=divergence, hard_label_weight=0.4, temperature=1.5)
    _check(divergence=divergence, hard_label_weight=1.0)
    _check(divergence=divergence, target=False)
    _check(divergence=divergence, ignore_index=-1, hard_label_weight=0.2)


def test_sequence_first_inputs_views_and_another_teacher():
    _check(shape=(3, 4), reduction="none", divergence="reverse_kl")
    _check(view=lambda x: x.t().contiguous().t(), divergence="jsd")   # transposed storage
    _check(view=lambda x: x[:, :], teacher_dtype=torch.bfloat16)
    _check(torch.bfloat16, teacher_dtype=torch.float32, hard_label_weight=0.3)


def test_compiled_matches_eager():
    _check(compiled=True, divergence="jsd", reduction="sum")


def test_no_grad_keeps_nothing():
    sh, sw, th, tw, t = _problem(torch.float32)
    sh.requires_grad_()
    with torch.no_grad():
        loss = fusedloss.linear_distillation_loss(sh, sw, th, tw, t)
    assert loss.grad_fn is None and not loss.requires_grad


def test_bad_arguments_are_named():
    sh, sw, th, tw, t = _problem(torch.float32)
    op = fusedloss.linear_distillation_loss
    with pytest.raises(ValueError, match="divergence: got 'kl', expected one of"):
        op(sh, sw, th, tw, t, divergence="kl")
    with pytest.raises(ValueError, match="temperature: got 0"):
        op(sh, sw, th, tw, t, temperature=0.0)
    with pytest.raises(ValueError, match=r"beta: got 1(\.0)?, expected a value in \(0, 1\)"):
        op(sh, sw, th, tw, t, divergence="jsd", beta=1.0)
    with pytest.raises(ValueError, match="hard_label_weight: got 0.5 without a target"):
        op(sh, sw, th, tw, None, hard_label_weight=0.5)
    with pytest.raises(ValueError, match="teacher_weight: got a tensor that requires grad"):
        op(sh, sw, th, tw.clone().requires_grad_(), t)
    with pytest.raises(ValueError, match="teacher_weight: got 36 rows, expected 37"):
        op(sh, sw, th, tw[:36], t)
    with pytest.raises(ValueError, match=r"teacher_hidden: got shape \(18, 24\)"):
        op(sh, sw, th[:18], tw, t)
    with pytest.raises(ValueError, match=r"target: got shape \(18,\)"):
        op(sh, sw, th, tw, t[:18])
    with pytest.raises(ValueError, match="student_weight.dtype: got torch.bfloat16"):
        op(sh, sw.bfloat16(), th, tw, t)
    bad = t.clone()
    bad[1] = 37
    with pytest.raises(ValueError, match=r"target\[1\]: got 37"):
        op(sh, sw, th, tw, bad)
