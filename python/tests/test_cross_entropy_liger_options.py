"""The cross-entropy's options that Liger-Kernel users rely on: logit_softcap (Liger's softcap),
return_z_loss, return_token_accuracy and return_predicted_tokens, against float64 references
with Liger's tolerances or tighter (Liger's test_cross_entropy.py: fp32 rtol 1e-6, bf16 5e-2)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusedloss
from dist_util import run_world

DTYPES = [torch.float32, torch.bfloat16]
GRAD_TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}


def _problem(device, dtype, rows=67, V=1031, scale=4.0, ignore_index=-100, ignore_frac=0.2):
    logits = (torch.randn(rows, V, dtype=torch.float64) * scale).to(dtype).to(device)
    target = torch.randint(0, V, (rows,), device=device)
    target[torch.rand(rows, device=device) < ignore_frac] = ignore_index
    return logits, target


def _reference(logits, target, softcap=0.0, z_loss=0.0, label_smoothing=0.0, ignore_index=-100,
               reduction="mean"):
    """float64: (loss, z-loss part) of the soft-capped logits, and the leaf the gradient lands on."""
    x = logits.detach().double().requires_grad_(True)
    y = softcap * torch.tanh(x / softcap) if softcap else x
    per_row = F.cross_entropy(y, target, ignore_index=ignore_index, reduction="none",
                              label_smoothing=label_smoothing)
    valid = target != ignore_index
    z = torch.where(valid, z_loss * torch.logsumexp(y, -1) ** 2, 0.0)
    per_row = per_row + z
    if reduction == "none":
        return x, per_row, z
    if reduction == "sum":
        return x, per_row.sum(), z.sum()
    n = valid.sum().clamp(min=1)
    return x, per_row.sum() / n, z.sum() / n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("options", [dict(), dict(z_loss=1e-4, label_smoothing=0.1),
                                     dict(ignore_index=-123)])
def test_softcap_matches_float64(device, dtype, reduction, options):
    softcap = 5.0
    ignore = options.get("ignore_index", -100)
    logits, target = _problem(device, dtype, ignore_index=ignore)
    x_ref, ref, _ = _reference(logits, target, softcap, reduction=reduction, **options)
    x = logits.clone().requires_grad_(True)
    loss = fusedloss.cross_entropy(x, target, logit_softcap=softcap, reduction=reduction, **options)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    g = torch.rand_like(ref) + 0.5
    loss.backward(g.float())
    ref.backward(g)
    tol = GRAD_TOL[dtype]
    torch.testing.assert_close(x.grad.double(), x_ref.grad, rtol=tol,
                               atol=tol * x_ref.grad.abs().max().item())
    # the cap changes the loss: a test that could not tell them apart would prove nothing
    plain = fusedloss.cross_entropy(logits, target, reduction=reduction, **options)
    assert not torch.allclose(plain, loss.detach())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_softcap_with_the_gradient_in_the_forward(device, dtype, reduction):
    logits, target = _problem(device, dtype)
    x_ref, ref, _ = _reference(logits, target, 3.0, z_loss=1e-3, reduction=reduction)
    x = logits.clone().requires_grad_(True)
    loss = fusedloss.cross_entropy(x * 1, target, softcap=3.0, z_loss=1e-3, reduction=reduction,
                                   grad_in_forward=True)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    (2 * loss).backward()
    (2 * ref).backward()
    tol = GRAD_TOL[dtype]
    torch.testing.assert_close(x.grad.double(), x_ref.grad, rtol=tol,
                               atol=tol * x_ref.grad.abs().max().item())


def test_softcap_module_and_names(device):
    logits, target = _problem(device, torch.float32)
    a = fusedloss.CrossEntropyLoss(softcap=7.0)(logits, target)
    b = fusedloss.cross_entropy(logits, target, logit_softcap=7.0)
    assert torch.equal(a, b)
    # 0 and None are off: the plain loss, bit for bit
    assert torch.equal(fusedloss.cross_entropy(logits, target, softcap=0.0),
                       fusedloss.cross_entropy(logits, target))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(softcap=-1.0), ValueError, r"^softcap: got -1.0, expected None or 0"),
    (dict(logit_softcap=-2), ValueError, r"^logit_softcap: got -2, expected None or 0"),
    (dict(logit_softcap=float("inf")), ValueError, r"logit_softcap: got inf"),
    (dict(softcap=2.0, logit_softcap=2.0), TypeError, r"softcap: got 2.0 with logit_softcap=2.0"),
    (dict(softcap="30"), TypeError, r"softcap: got '30'"),
    (dict(return_z_loss=1), TypeError, r"return_z_loss: got 1"),
    (dict(return_token_accuracy="yes"), TypeError, r"return_token_accuracy: got 'yes'"),
])
def test_bad_options_name_themselves(kwargs, error, match):
    logits, target = _problem("cpu", torch.float32, rows=4, V=9)
    with pytest.raises(error, match=match):
        fusedloss.cross_entropy(logits, target, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("z_loss", [1e-4, 1e-5])  # PaLM's, Chameleon's (Liger's cases)
def test_return_z_loss(device, dtype, reduction, z_loss):
    logits, target = _problem(device, dtype)
    x_ref, ref, z_ref = _reference(logits, target, z_loss=z_loss, reduction=reduction)
    x = logits.clone().requires_grad_(True)
    out = fusedloss.cross_entropy(x, target, z_loss=z_loss, reduction=reduction,
                                  return_z_loss=True)
    assert isinstance(out, fusedloss.CrossEntropyOutput)
    assert out.token_accuracy is None and out.predicted_tokens is None
    assert out.z_loss.shape == z_ref.shape and out.z_loss.grad_fn is None  # for logging
    torch.testing.assert_close(out.z_loss.double(), z_ref.detach(), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    # the loss (which includes the z-loss) and its gradient as without the option
    plain_x = logits.clone().requires_grad_(True)
    plain = fusedloss.cross_entropy(plain_x, target, z_loss=z_loss, reduction=reduction)
    assert torch.equal(plain.detach(), out.loss.detach())
    g = torch.rand_like(plain) + 0.5
    out.loss.backward(g)
    plain.backward(g)
    assert torch.equal(x.grad, plain_x.grad)


def _accuracy_reference(logits, target, ignore_index, reduction):
    valid = target != ignore_index
    predicted = torch.where(valid, logits.double().argmax(-1), -1)
    hit = (valid & (predicted == target)).double()
    if reduction == "none":
        return hit, predicted
    return hit.sum() / valid.sum().clamp(min=1), predicted


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction, grad_in_forward", [("none", False), ("sum", False),
                                                        ("mean", False), ("sum", True),
                                                        ("mean", True)])
def test_token_accuracy_and_predicted_tokens(device, dtype, reduction, grad_in_forward):
    logits, target = _problem(device, dtype, rows=203, V=67, scale=1.0)
    logits[5] = 0.5  # a whole row tied: the smallest id wins
    logits[7, 60] = logits[7, 3] = logits[7].max() + 1  # a tie of two
    # some rows predicted right, so accuracy is neither 0 nor 1
    target[10:40] = torch.where(target[10:40] == -100, -100, logits[10:40].float().argmax(-1))
    acc_ref, pred_ref = _accuracy_reference(logits, target, -100, reduction)
    assert pred_ref[7] in (3, -1) and 0 < acc_ref.mean() < 1
    x = logits.clone().requires_grad_(True)
    out = fusedloss.cross_entropy(x * 1, target, reduction=reduction, return_token_accuracy=True,
                                  return_predicted_tokens=True, grad_in_forward=grad_in_forward)
    assert out.z_loss is None
    assert out.predicted_tokens.dtype == torch.int64
    assert torch.equal(out.predicted_tokens, pred_ref)
    torch.testing.assert_close(out.token_accuracy.double(), acc_ref, rtol=1e-6, atol=0)
    # the loss and gradient as without the options (the argmax read the logits before any
    # gradient overwrote them)
    plain_x = logits.clone().requires_grad_(True)
    plain = fusedloss.cross_entropy(plain_x * 1, target, reduction=reduction)
    assert torch.equal(plain.detach(), out.loss.detach())
    out.loss.sum().backward()
    plain.sum().backward()
    tol = GRAD_TOL[dtype]
    torch.testing.assert_close(x.grad, plain_x.grad, rtol=tol, atol=tol * plain_x.grad.abs().max())


def test_every_extra_with_class_weight_and_3d_logits(device):
    logits, target = _problem(device, torch.float32, rows=48, V=41)
    logits, target = logits.view(6, 8, 41), target.view(6, 8)
    weight = torch.rand(41, device=device) + 0.5
    out = fusedloss.cross_entropy(logits, target, weight=weight, z_loss=1e-3, reduction="mean",
                                  return_z_loss=True, return_token_accuracy=True,
                                  return_predicted_tokens=True)
    x = logits.double().reshape(-1, 41)
    t = target.reshape(-1)
    valid = t != -100
    w = torch.where(valid, weight.double()[t.clamp(min=0)], 0.0)
    z = 1e-3 * torch.logsumexp(x, -1) ** 2
    ce = F.cross_entropy(x, t, weight=weight.double(), reduction="sum")
    torch.testing.assert_close(out.loss.double(), (ce + (w * z).sum()) / w.sum(), rtol=1e-6, atol=0)
    # the z-loss weighted as the loss that includes it; the accuracy a plain fraction
    torch.testing.assert_close(out.z_loss.double(), (w * z).sum() / w.sum(), rtol=1e-5, atol=0)
    acc, pred = _accuracy_reference(x, t, -100, "mean")
    torch.testing.assert_close(out.token_accuracy.double(), acc, rtol=1e-6, atol=0)
    assert torch.equal(out.predicted_tokens, pred.view(6, 8))


def test_no_counted_row_gives_zero_metrics():
    logits, target = _problem("cpu", torch.float32, rows=5, V=11)
    target[:] = -100
    out = fusedloss.cross_entropy(logits, target, z_loss=1e-3, return_z_loss=True,
                                  return_token_accuracy=True, return_predicted_tokens=True)
    assert out.loss.item() == 0 and out.z_loss.item() == 0 and out.token_accuracy.item() == 0
    assert torch.equal(out.predicted_tokens, torch.full((5,), -1))


def _check_tp(rank, world, reduction):
    torch.manual_seed(0)  # the same problem on every rank
    logits, target = _problem("cpu", torch.float32, rows=31, V=16 * world)
    logits[3, 5] = logits[3, 16 + 2] = logits[3].max() + 1  # a tie across the shards: id 5 wins
    shard = logits[:, rank * 16:(rank + 1) * 16].clone().requires_grad_(True)
    options = dict(reduction=reduction, logit_softcap=4.0, z_loss=1e-3, return_z_loss=True,
                   return_token_accuracy=True, return_predicted_tokens=True)
    out = fusedloss.cross_entropy(shard, target, tp_group=dist.group.WORLD, **options)
    x = logits.clone().requires_grad_(True)
    one = fusedloss.cross_entropy(x, target, **options)
    torch.testing.assert_close(out.loss, one.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.z_loss, one.z_loss, rtol=1e-6, atol=1e-9)
    assert torch.equal(out.predicted_tokens, one.predicted_tokens)
    assert out.predicted_tokens[3] in (5, -1)  # -1: an ignored row
    torch.testing.assert_close(out.token_accuracy, one.token_accuracy)
    out.loss.sum().backward()
    one.loss.sum().backward()
    torch.testing.assert_close(shard.grad, x.grad[:, rank * 16:(rank + 1) * 16], rtol=1e-5,
                               atol=1e-7)


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_gloo_tp_equals_tp1(reduction):
    run_world(2, _check_tp, reduction)


def _check_tp_softcap_on_one_rank(rank, world):
    from test_vocab_parallel import _same_error_everywhere
    logits, target = _problem("cpu", torch.float32, rows=8, V=16 * world)
    shard = logits[:, rank * 16:(rank + 1) * 16]
    _same_error_everywhere(lambda: fusedloss.cross_entropy(
        shard, target, tp_group=dist.group.WORLD, logit_softcap=5.0 if rank == 0 else None),
        "logit_softcap")


def test_gloo_tp_softcap_on_one_rank_raises_everywhere():
    run_world(2, _check_tp_softcap_on_one_rank, timeout_s=30)


# ---- the linear cross-entropy: the same options ----

def _lce_problem(device, dtype, N=45, H=24, V=133):
    hidden = (torch.randn(N, H, dtype=torch.float64)).to(dtype).to(device)
    weight = (torch.randn(V, H, dtype=torch.float64) / 2).to(dtype).to(device)
    target = torch.randint(0, V, (N,), device=device)
    target[torch.rand(N, device=device) < 0.2] = -100
    return hidden, weight, target


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_linear_every_extra(device, dtype, reduction):
    hidden, weight, target = _lce_problem(device, dtype)
    logits = hidden.double() @ weight.double().T
    _, ref, z_ref = _reference(logits, target, softcap=6.0, z_loss=1e-3, reduction=reduction)
    acc_ref, pred_ref = _accuracy_reference(logits, target, -100, reduction)
    h = hidden.clone().requires_grad_(True)
    out = fusedloss.linear_cross_entropy(h, weight, target, softcap=6.0, z_loss=1e-3,
                                         reduction=reduction, return_z_loss=True,
                                         return_token_accuracy=True, return_predicted_tokens=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(out.z_loss.double(), z_ref.detach(), rtol=tol, atol=1e-9)
    # the arg-max of the logits as the GEMM rounds them: compare where the float64 top two
    # differ by more than that rounding
    top2 = logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > (1e-4 if dtype == torch.float32 else 0.1)
    assert clear.sum() > 10
    assert torch.equal(out.predicted_tokens[clear], pred_ref[clear])
    if reduction == "none":
        assert torch.equal(out.token_accuracy[clear], acc_ref[clear])
    plain = fusedloss.linear_cross_entropy(hidden, weight, target, logit_softcap=6.0, z_loss=1e-3,
                                           reduction=reduction)
    torch.testing.assert_close(out.loss.detach(), plain, rtol=0, atol=0)
    out.loss.sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("workspace_bytes", [None, 133 * 4 * 7])  # one chunk, chunks of 7 tokens
def test_linear_extras_with_a_bias(device, dtype, workspace_bytes):
    """The arg-max of the biased logits (hidden @ weight^T + bias, as Liger's fused linear
    cross-entropy takes them together), the accuracy from it, beside the loss and its z-loss."""
    hidden, weight, target = _lce_problem(device, dtype)
    bias = (torch.randn(weight.size(0), dtype=torch.float64) * 2).to(dtype).to(device)
    logits = hidden.double() @ weight.double().T + bias.double()
    acc_ref, pred_ref = _accuracy_reference(logits, target, -100, "none")
    _, ref, z_ref = _reference(logits, target, z_loss=1e-3, reduction="none")
    out = fusedloss.linear_cross_entropy(hidden, weight, target, bias, z_loss=1e-3,
                                         reduction="none", return_z_loss=True,
                                         return_token_accuracy=True, return_predicted_tokens=True,
                                         workspace_bytes=workspace_bytes)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(out.z_loss.double(), z_ref.detach(), rtol=tol, atol=1e-9)
    top2 = logits.topk(2, dim=-1).values  # where the rounding of the logits cannot swap them
    clear = (top2[:, 0] - top2[:, 1]) > (1e-4 if dtype == torch.float32 else 0.2)
    assert clear.sum() > 10
    assert torch.equal(out.predicted_tokens[clear], pred_ref[clear])
    assert torch.equal(out.token_accuracy[clear], acc_ref[clear])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_linear_liger_options_together(device, dtype, reduction):
    """Liger's fused linear cross-entropy takes a class weight (ce_weight) with label smoothing
    and the arg-max outputs with a bias in one call: the loss and its gradients as
    F.cross_entropy(F.linear(...), weight=..., label_smoothing=...) in float64, the arg-max of
    the biased logits."""
    hidden, weight, target = _lce_problem(device, dtype)
    bias = (torch.randn(weight.size(0), dtype=torch.float64) * 2).to(dtype).to(device)
    cw = torch.rand(weight.size(0), device=device) + 0.25
    leaves = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    out = fusedloss.linear_cross_entropy(*leaves[:2], target, leaves[2], class_weight=cw,
                                         label_smoothing=0.1, reduction=reduction,
                                         return_token_accuracy=True, return_predicted_tokens=True)
    refs = [x.double().requires_grad_(True) for x in (hidden, weight, bias)]
    logits = F.linear(*refs)
    ref = F.cross_entropy(logits, target, weight=cw.double(), label_smoothing=0.1,
                          reduction=reduction)
    acc_ref, pred_ref = _accuracy_reference(logits.detach(), target, -100, reduction)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=tol, atol=tol)
    up = torch.rand_like(ref) + 0.5
    out.loss.backward(up.to(out.loss.dtype))
    ref.backward(up)
    for ours, theirs in zip(leaves, refs):
        err = (ours.grad.double() - theirs.grad).norm() / theirs.grad.norm()
        assert err <= tol, (ours.shape, err)
    top2 = logits.detach().topk(2, dim=-1).values  # where rounding cannot swap the two largest
    clear = (top2[:, 0] - top2[:, 1]) > (1e-4 if dtype == torch.float32 else 0.2)
    assert clear.sum() > 10
    assert torch.equal(out.predicted_tokens[clear], pred_ref[clear])
    if reduction == "none":
        assert torch.equal(out.token_accuracy[clear], acc_ref.float()[clear])
    else:
        torch.testing.assert_close(out.token_accuracy.double(), acc_ref, rtol=0, atol=0.05)


def test_linear_z_loss_with_class_weight(device):
    hidden, weight, target = _lce_problem(device, torch.float32)
    cw = torch.rand(weight.size(0), device=device) + 0.5
    out = fusedloss.linear_cross_entropy(hidden, weight, target, class_weight=cw, z_loss=1e-3,
                                         return_z_loss=True)
    x = hidden.double() @ weight.double().T
    valid = target != -100
    w = torch.where(valid, cw.double()[target.clamp(min=0)], 0.0)
    z = 1e-3 * torch.logsumexp(x, -1) ** 2
    torch.testing.assert_close(out.z_loss.double(), (w * z).sum() / w.sum(), rtol=1e-5, atol=0)


def _check_linear_tp(rank, world):
    torch.manual_seed(0)
    hidden, weight, target = _lce_problem("cpu", torch.float32, V=32 * world)
    own = slice(rank * 32, (rank + 1) * 32)
    options = dict(z_loss=1e-3, return_z_loss=True, return_token_accuracy=True,
                   return_predicted_tokens=True, reduction="mean")
    out = fusedloss.linear_cross_entropy(hidden, weight[own], target, tp_group=dist.group.WORLD,
                                         **options)
    one = fusedloss.linear_cross_entropy(hidden, weight, target, **options)
    torch.testing.assert_close(out.loss, one.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.z_loss, one.z_loss, rtol=1e-5, atol=1e-9)
    assert torch.equal(out.predicted_tokens, one.predicted_tokens)
    torch.testing.assert_close(out.token_accuracy, one.token_accuracy)


def test_linear_gloo_tp_equals_tp1():
    run_world(2, _check_linear_tp)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("options", [dict(), dict(z_loss=1e-3, logit_softcap=4.0)])
def test_linear_token_scaling(device, reduction, options):
    """Liger's use_token_scaling: each token's loss times its detached target probability."""
    hidden, weight, target = _lce_problem(device, torch.float32)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss = fusedloss.linear_cross_entropy(h, w, target, reduction=reduction,
                                          use_token_scaling=True, **options)
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    cap = options.get("logit_softcap", 0.0)
    _, per_row, _ = _reference(h64 @ w64.T, target, cap, options.get("z_loss", 0.0),
                               reduction="none")
    x = h64 @ w64.T  # the reference's own leaf is detached: recompute with the graph
    y = cap * torch.tanh(x / cap) if cap else x
    valid = target != -100
    per_row = (F.cross_entropy(y, target, reduction="none")
               + torch.where(valid, options.get("z_loss", 0.0) * torch.logsumexp(y, -1) ** 2, 0.0))
    p = torch.where(valid, torch.softmax(y, -1).gather(1, target.clamp(min=0)[:, None])[:, 0],
                    0.0).detach()
    ref = per_row * p
    ref = ref if reduction == "none" else ref.sum() / (valid.sum() if reduction == "mean" else 1)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-7)
    g = torch.rand_like(ref) + 0.5
    loss.backward(g.float())
    ref.backward(g)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)


def test_linear_token_scaling_refuses_label_smoothing():
    hidden, weight, target = _lce_problem("cpu", torch.float32)
    with pytest.raises(ValueError, match=r"use_token_scaling: got True with label_smoothing=0.1"):
        fusedloss.linear_cross_entropy(hidden, weight, target, use_token_scaling=True,
                                       label_smoothing=0.1)


# Liger's own CUDA cases (its test_cross_entropy.py shapes and options); the CPU runs the same
# options at the smaller shapes above.
@pytest.mark.parametrize("B, T, V", [(2, 4096, 32000), (3, 423, 32000)])
@pytest.mark.parametrize("dtype, rtol", [(torch.bfloat16, 5e-2), (torch.float32, 1e-6)])
@pytest.mark.parametrize("options", [dict(softcap=30.0), dict(z_loss=1e-4, return_z_loss=True),
                                     dict(z_loss=1e-5, label_smoothing=0.1, ignore_index=-123,
                                          reduction="sum", return_z_loss=True)])
def test_liger_cases_on_cuda(B, T, V, dtype, rtol, options):
    if not torch.cuda.is_available():
        pytest.skip("Liger's shapes are its CUDA cases: no GPU here (the same options run on "
                    "the CPU at smaller shapes in this file)")
    options = dict(options)
    ignore = options.get("ignore_index", -100)
    logits, target = _problem("cuda", dtype, rows=B * T, V=V, scale=1.0, ignore_index=ignore)
    x_ref, ref, z_ref = _reference(logits, target, options.get("softcap", 0.0),
                                   options.get("z_loss", 0.0), options.get("label_smoothing", 0.0),
                                   ignore, options.get("reduction", "mean"))
    x = logits.clone().requires_grad_(True)
    out = fusedloss.cross_entropy(x, target, **options)
    loss = out.loss if options.get("return_z_loss") else out
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=rtol, atol=1e-8)
    if options.get("return_z_loss"):
        torch.testing.assert_close(out.z_loss.double(), z_ref.detach(), rtol=max(rtol, 1e-5),
                                   atol=1e-8)
    loss.backward()
    ref.backward()
    tol = GRAD_TOL[dtype]
    torch.testing.assert_close(x.grad.double(), x_ref.grad, rtol=tol,
                               atol=tol * x_ref.grad.abs().max().item())


def _check_tp_argmax_on_one_rank(rank, world):
    from test_vocab_parallel import _same_error_everywhere
    logits, target = _problem("cpu", torch.float32, rows=8, V=16 * world)
    shard = logits[:, rank * 16:(rank + 1) * 16]
    # rank 0 alone asks for the accuracy (for its log line): its all-gather would meet no peer
    _same_error_everywhere(lambda: fusedloss.cross_entropy(
        shard, target, tp_group=dist.group.WORLD, return_token_accuracy=rank == 0),
        "return_token_accuracy_or_predicted_tokens")


def test_gloo_tp_argmax_on_one_rank_raises_everywhere():
    run_world(2, _check_tp_argmax_on_one_rank, timeout_s=30)


def test_weighted_per_row_accuracy_keeps_the_targets_shape():
    logits, target = torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3))
    out = fusedloss.CrossEntropyLoss(weight=torch.ones(7), reduction="none",
                                     return_token_accuracy=True)(logits, target)
    assert out.loss.shape == out.token_accuracy.shape == (2, 3)


def test_linear_extras_with_an_ignore_index_among_the_ids():
    hidden, weight, target = _lce_problem("cpu", torch.float32)
    target[target == -100] = 7
    out = fusedloss.linear_cross_entropy(hidden, weight, target, ignore_index=7,
                                         return_token_accuracy=True, return_predicted_tokens=True,
                                         reduction="none")
    ignored = target == 7
    assert ignored.any() and (out.predicted_tokens[ignored] == -1).all()
    logits = hidden.double() @ weight.double().T
    assert torch.equal(out.predicted_tokens[~ignored], logits.argmax(-1)[~ignored])


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(loss_mask=torch.ones(45)), ValueError, r"use_token_scaling: got True with loss_mask="),
    (dict(backward_mode="in_forward"), ValueError, r"backward_mode: got 'in_forward' with use_token"),
    (dict(return_z_loss="no"), TypeError, r"return_z_loss: got 'no'"),
    (dict(label_smoothing="x"), TypeError, r"label_smoothing: got 'x'"),
])
def test_linear_token_scaling_bad_arguments(kwargs, error, match):
    hidden, weight, target = _lce_problem("cpu", torch.float32)
    with pytest.raises(error, match=match):
        fusedloss.linear_cross_entropy(hidden, weight, target, use_token_scaling=True,
                                       reduction="none", **kwargs)


# Liger's test_fused_linear_cross_entropy.py cases: an nn.Linear LM head (its init: weight and
# bias from torch.rand, so logits of magnitude ~100 and a softmax near one-hot) and a mean loss.
# The loss against float64 (of the logits rounded as stored) with Liger's tolerances (bf16: atol
# 5e-3, rtol 5e-2; fp32: atol 1e-5, rtol 5e-4). The gradients against float64 with torch's own
# error in the same dtype on the same device as the yardstick (its F.linear + F.cross_entropy):
# Liger's elementwise tolerances, put on the gradient's scale, are tighter than what torch itself
# meets on a GPU, whose GEMMs sum in another order than float64's (up to 20x the tolerance on a
# few % of entries at H 4096-8192); Liger's own test compares with torch at an absolute atol that
# the ~1e-4 gradients of these cases pass whatever they hold. Small shape everywhere, large on CUDA.
@pytest.mark.parametrize("B, T, H, V", [(2, 4, 512, 512), (8, 2048, 4096, 32000),
                                        (4, 423, 8192, 32000)])
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.bfloat16, 5e-3, 5e-2),
                                               (torch.float32, 1e-5, 5e-4)])
@pytest.mark.parametrize("bias", [True, False])
def test_liger_linear_cases(device, B, T, H, V, dtype, atol, rtol, bias):
    if B * T > 8 and device != "cuda":
        pytest.skip("Liger's large shapes are its CUDA cases (the small one runs here)")
    g = torch.Generator().manual_seed(B * T + V)
    weight = torch.rand(V, H, generator=g).to(dtype).to(device)
    b = torch.rand(V, generator=g).to(dtype).to(device) if bias else None
    x = torch.randn(B * T, H, generator=g).to(dtype).to(device)
    target = torch.randint(0, V, (B * T,), generator=g).to(device)
    inputs = (x, weight) + ((b,) if bias else ())

    def grads(loss_fn):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        loss = loss_fn(*leaves)
        loss.backward()
        return loss.detach(), [t.grad for t in leaves]

    loss, ours = grads(lambda *a: fusedloss.linear_cross_entropy(
        a[0], a[1], target, a[2] if bias else None))
    _, torchs = grads(lambda *a: F.cross_entropy(F.linear(*a).float(), target))
    refs = [t.double().requires_grad_(True) for t in inputs]
    z = F.linear(*refs)
    # the logits as the GEMM stores them (in the inputs' dtype, as torch's and Liger's): logits of
    # magnitude ~100 carry bf16 steps of 0.5-1, which decide the softmax
    z = z + (z.to(dtype).double() - z).detach()
    ref = F.cross_entropy(z, target)
    torch.testing.assert_close(loss.double(), ref.detach(), atol=atol, rtol=rtol)
    ref.backward()
    for name, o, t, r in zip(("dhidden", "dweight", "dbias"), ours, torchs, refs):
        err = lambda a: ((a.double() - r.grad).norm() / r.grad.norm()).item()
        # the floor, rtol / 100 (5e-6 in fp32): in fp32 both errors are a few ulps of summation
        # order, which differs between BLAS builds (torch's 0.8e-6 and ours 2.4e-6 on one CPU)
        assert err(o) <= 1.5 * err(t) + rtol / 100, (name, err(o), err(t))


def _check_linear_tp_argmax_on_one_rank(rank, world):
    from test_vocab_parallel import _same_error_everywhere
    hidden, weight, target = _lce_problem("cpu", torch.float32, V=32 * world)
    own = slice(rank * 32, (rank + 1) * 32)
    _same_error_everywhere(lambda: fusedloss.linear_cross_entropy(
        hidden, weight[own], target, tp_group=dist.group.WORLD,
        return_predicted_tokens=rank == 0), "return_token_accuracy_or_predicted_tokens")


def test_linear_gloo_tp_argmax_on_one_rank_raises_everywhere():
    run_world(2, _check_linear_tp_argmax_on_one_rank, timeout_s=30)


def _check_linear_tp_biased_argmax(rank, world):
    torch.manual_seed(3)
    hidden, weight, target = _lce_problem("cpu", torch.float32, V=32 * world)
    bias = torch.randn(weight.size(0)) * 2
    bias[5] = bias[37] = 50.0  # a tie across the shards' boundary: the smaller id wins
    weight[5] = weight[37] = 0.0
    own = slice(rank * 32, (rank + 1) * 32)
    out = fusedloss.linear_cross_entropy(hidden, weight[own], target, bias[own],
                                         tp_group=dist.group.WORLD, reduction="none",
                                         return_predicted_tokens=True)
    ref = fusedloss.linear_cross_entropy(hidden, weight, target, bias, reduction="none",
                                         return_predicted_tokens=True)
    assert torch.equal(out.predicted_tokens, ref.predicted_tokens)
    counted = target != -100
    assert (out.predicted_tokens[counted] == 5).all()


def test_linear_gloo_tp_biased_argmax():
    run_world(2, _check_linear_tp_biased_argmax, timeout_s=30)
