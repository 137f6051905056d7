"""fusedloss.linear_distillation_loss(divergence="jsd") against Liger-Kernel's fused linear JSD
(liger_kernel.transformers.LigerFusedLinearJSD) where their math overlaps:

- Liger's jsd_beta weighs the teacher's distribution P, as fusedloss's beta does (its
  _jsd_kernel, src/liger_kernel/ops/jsd.py at commit ead96b6: X = log Q is the student's
  "_input", Y = log P the teacher's "target"; "M = beta_P + one_minus_beta_Q" and
  "loss = beta_P * Y + one_minus_beta_Q * X - M * log_M", whose sum over the vocabulary is
  beta KL(P || M) + (1 - beta) KL(Q || M)). So jsd_beta = beta, for 0 < beta < 1 (Liger's 0 and
  1 are forward and reverse KL, not the JSD's limits; fusedloss's jsd refuses them).
- Both divide both models' logits by the temperature, with no temperature ** 2 factor.
- Liger's shift_labels only mask: rows whose label is its ignore_index count for nothing and
  the sum is divided by the other rows (n_non_ignore; all rows without labels); it has no
  hard-label term. fusedloss: target with hard_label_weight 0 (its default), reduction "mean".
- Liger takes [BT, H] inputs (2-D), a scalar mean loss.

The CPU test transcribes Liger's math (in float64 torch) and checks fusedloss's CPU op against
it: the beta mapping is tested where no GPU is. The CUDA tests run Liger itself and compare each
with a float64 reference, fusedloss's error within 1.5x Liger's plus a floor (the yardstick of
test_cross_entropy_liger_options.py's Liger cases).

The reference is test_linear_distillation.reference: the float64 loss over the logits as each
GEMM stores them (fusedloss's chunk buffers hold them in the inputs' dtype, as F.linear does).
Liger before 0.8.5 casts its bf16 logits to fp32 after the GEMM (the same rounding); 0.8.5 asks
the GEMM for fp32 logits (_project_to_float32 in ops/fused_linear_jsd.py), so in bf16 its error
against this reference is the logits' rounding itself and the bound is loose there (against the
exact float64 loss 0.8.5 is the more accurate in bf16: CPU stand-ins of the two at Liger's
torch.rand init, temperature 1, gave dhidden errors of 1.7e-3 with fp32 logits against 2.9e-1
with bf16 ones). fp32 inputs are the same for every version."""
import pytest
import torch

import fusedloss
from test_linear_distillation import _TOL, _problem, reference


def _liger_jsd(s, t, beta, temperature, labels=None, ignore_index=-100):
    """Liger's fused linear JSD over the student's logits s and the teacher's t ([BT, V]),
    transcribed from its source (commit ead96b6) in float64: (loss, its gradient of s).

    src/liger_kernel/ops/fused_linear_jsd.py, fused_linear_jsd_forward:
        student_logits_chunk = student_logits_chunk / temperature   (and the teacher's)
        student_prob_chunk = torch.log_softmax(student_logits_chunk, dim=-1)   -> X
        teacher_prob_chunk = torch.log_softmax(teacher_logits_chunk, dim=-1)   -> Y
        n_non_ignore = (shift_labels != ignore_index).sum().item()   (else BT)
    src/liger_kernel/ops/jsd.py, _jsd_kernel, the branch 0 < beta < 1 (the max shift of
    Q and P cancels: Q = exp(X), P = exp(Y)); a row whose label is ignore_index returns early
    (loss 0, dX 0):
        beta_P = beta * P;  one_minus_beta_Q = (1 - beta) * Q;  M = beta_P + one_minus_beta_Q
        loss = beta_P * Y + one_minus_beta_Q * X - M * log_M
        dX = one_minus_beta_Q * (X - log_M)
        scale = 1.0 / n_non_ignore;  loss = loss * scale;  dX = dX * scale
    back in fused_linear_jsd_forward, the gradient of the logits:
        (student_prob_chunk - torch.softmax(student_logits_chunk, dim=-1)
         * student_prob_chunk.sum(dim=-1, keepdim=True)) / temperature
    and loss = torch.sum(loss_1d)."""
    s, t = s / temperature, t / temperature
    X, Y = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    counted = (torch.ones(s.size(0), dtype=torch.bool, device=s.device) if labels is None
               else labels != ignore_index)
    n_non_ignore = counted.sum()
    Q, P = X.exp(), Y.exp()
    beta_P, one_minus_beta_Q = beta * P, (1 - beta) * Q
    M = beta_P + one_minus_beta_Q
    log_M = M.log()
    loss = beta_P * Y + one_minus_beta_Q * X - M * log_M
    dX = one_minus_beta_Q * (X - log_M)
    loss = torch.where(counted[:, None], loss / n_non_ignore, 0.0)
    dX = torch.where(counted[:, None], dX / n_non_ignore, 0.0)
    ds = (dX - torch.softmax(s, -1) * dX.sum(-1, keepdim=True)) / temperature
    return loss.sum(), ds


@pytest.mark.parametrize("beta", [0.1, 0.3, 0.5, 0.8])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("labels", [False, True])
def test_beta_maps_to_ligers_jsd_beta(beta, temperature, labels):
    """fusedloss's jsd with beta = Liger's fused linear JSD with jsd_beta = beta (its math,
    transcribed): loss, dhidden = ds @ W_s, dweight = ds^T @ h_s (Liger's GEMMs)."""
    sh, sw, th, tw, t = _problem(torch.float32)  # every 5th target is -100
    t = t if labels else None
    h, w = sh.clone().requires_grad_(), sw.clone().requires_grad_()
    loss = fusedloss.linear_distillation_loss(h, w, th, tw, t, divergence="jsd", beta=beta,
                                              temperature=temperature)
    loss.backward()
    h64, w64 = sh.double(), sw.double()
    s, z_t = h64 @ w64.T, th.double() @ tw.double().T
    want, ds = _liger_jsd(s, z_t, beta, temperature, t)
    tol = _TOL[torch.float32]
    torch.testing.assert_close(loss.double(), want, rtol=tol, atol=tol)
    for got, ref, name in ((h.grad, ds @ w64, "dhidden"), (w.grad, ds.T @ h64, "dweight")):
        rel = ((got.double() - ref).norm() / ref.norm()).item()
        assert rel <= 4 * tol, (name, rel)
    if beta != 0.5:  # the other convention (beta on the student) is another loss, told apart
        # by its gradient (the mean losses of the two can nearly meet: 1e-6 apart at some seeds)
        _, ds_swapped = _liger_jsd(s, z_t, 1 - beta, temperature, t)
        apart = ((ds_swapped - ds).norm() / ds.norm()).item()
        assert apart > 100 * 4 * tol, apart


def _liger_fused_linear_jsd():
    """Liger's module, or the test skipped with the reason."""
    if not torch.cuda.is_available():
        pytest.skip("Liger-Kernel's fused linear JSD runs on CUDA: no CUDA device in this process "
                    "(the beta mapping is checked on the CPU by test_beta_maps_to_ligers_jsd_beta)")
    try:
        from liger_kernel.transformers import LigerFusedLinearJSD
    except Exception as e:  # not installed, or its import (Triton) fails here
        pytest.skip(f"liger_kernel not importable: {type(e).__name__}: {e}")
    return LigerFusedLinearJSD


# Liger's test_fused_linear_jsd.py cases: BT x (student H // 2, teacher H) x V, inputs and
# weights from torch.rand (logits of magnitude ~100 at H 1024), and one of centred logits
# (randn, std ~2) where the two distributions overlap more. The loss's floor is Liger's atol
# (bf16 5e-3, fp32 1e-5). The gradients' floor: bf16 Liger's rtol / 100 (5e-2 / 100, as
# test_cross_entropy_liger_options.py's); fp32 1e-4 (its rtol 5e-4 / 5), where both are GEMM
# summation-order noise: at the torch.rand case's logits of ~100, torch's own unfused fp32 JSD
# had 2.4-3.3x Liger's dhidden error on an H100 (3e-5 to 1e-4 against 1.1e-5 to 3.9e-5), and a
# wrong mapping of beta, the temperature or the ignored rows errs by 1e-2 or more.
CASES = [(8 * 128, 512, 1024, 4096, "rand"), (4 * 423, 83, 167, 1423, "rand"),
         (8 * 128, 512, 1024, 4096, "randn")]
DTYPES = {torch.bfloat16: (5e-3, 5e-4), torch.float32: (1e-5, 1e-4)}  # the floors: loss, gradients


def _inputs(rows, Hs, Ht, V, init, dtype):
    """student_hidden, student_weight, teacher_hidden, teacher_weight on CUDA."""
    if init == "rand":  # Liger's
        xs = [torch.rand(rows, Hs), torch.rand(V, Hs), torch.rand(rows, Ht), torch.rand(V, Ht)]
    else:
        xs = [torch.randn(rows, Hs), torch.randn(V, Hs) * 2 * Hs ** -0.5, torch.randn(rows, Ht),
              torch.randn(V, Ht) * 2 * Ht ** -0.5]
    return [x.to(dtype).cuda() for x in xs]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("beta", [0.1, 0.5, 0.75])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("labels", [None, -100, 42], ids=["no-target", "ignore-100", "ignore42"])
def test_matches_liger_on_cuda(case, dtype, beta, temperature, labels):
    """Loss, dhidden and dweight of both against float64 (fusedloss's definition, over the
    logits as each GEMM stores them): fusedloss's error <= 1.5x Liger's + the floor. labels:
    no target; targets with a fifth of the rows -100 (Liger's default ignore_index); or
    ignore_index 42, a class id (Liger's own case)."""
    LigerFusedLinearJSD = _liger_fused_linear_jsd()
    rows, Hs, Ht, V, init = case
    sh, sw, th, tw = _inputs(rows, Hs, Ht, V, init, dtype)
    ignore = -100 if labels is None else labels
    target = None
    if labels is not None:
        target = torch.randint(0, V, (rows,), device="cuda")
        target[torch.rand(rows, device="cuda") < 0.2] = ignore
        assert (target != ignore).any()

    def run(loss_fn):
        leaves = [sh.clone().requires_grad_(True), sw.clone().requires_grad_(True)]
        loss = loss_fn(*leaves)
        loss.backward()
        return [loss.detach().double()] + [x.grad.double() for x in leaves]

    ours = run(lambda h, w: fusedloss.linear_distillation_loss(
        h, w, th, tw, target, divergence="jsd", beta=beta, temperature=temperature,
        ignore_index=ignore))
    liger = LigerFusedLinearJSD(jsd_beta=beta, ignore_index=ignore, temperature=temperature)
    theirs = run(lambda h, w: liger(h, w, th, tw, target))
    refs = [x.double().requires_grad_(True) for x in (sh, sw)]
    ref = reference(refs[0], refs[1], dtype, th, tw, target, divergence="jsd", beta=beta,
                    temperature=temperature, ignore_index=ignore)
    ref.backward()
    loss_floor, grad_floor = DTYPES[dtype]
    err = lambda a, r: (a - r).abs().item()
    assert err(ours[0], ref) <= 1.5 * err(theirs[0], ref) + loss_floor, \
        ("loss", ours[0].item(), theirs[0].item(), ref.item())
    for name, o, t, r in zip(("dhidden", "dweight"), ours[1:], theirs[1:], refs):
        rel = lambda a: ((a - r.grad).norm() / r.grad.norm()).item()
        assert rel(o) <= 1.5 * rel(t) + grad_floor, (name, rel(o), rel(t))
