"""One knowledge-distillation step in plain PyTorch: a small causal LM (the student) learns from
a larger one (the teacher, frozen, another width), with and without
fusedloss.linear_distillation_loss: the same loss and gradients, and the time and memory of each
(on the GPU when there is one, else the CPU backend).

Per token, at temperature T, with q the student's and p the teacher's next-token distributions:
    loss = (1 - w) JSD_beta(p, q) + w CE(student logits at T = 1, the next token)
averaged over the tokens that are not padding. The torch loss goes through both models' [tokens, V]
logits; fusedloss computes it from the last hidden states and the two LM heads without them.

    python examples/distillation_step.py [--vocab 32000] [--hidden 256] [--seq 256] [--batch 8]
"""
import argparse

import torch
import torch.nn.functional as F

import fusedloss
from grpo_step import TinyLM, compare

PAD = -100


def torch_distillation(student_h, student_w, teacher_h, teacher_w, targets, temperature, beta, w):
    """The loss through both [tokens, V] logits (as TRL's GKD trainer computes it)."""
    s = (student_h @ student_w.t()).float()
    with torch.no_grad():
        t = (teacher_h @ teacher_w.t()).float()
    lq, lp = torch.log_softmax(s / temperature, -1), torch.log_softmax(t / temperature, -1)
    lm = torch.logsumexp(torch.stack([lp + torch.log(torch.tensor(beta)),
                                      lq + torch.log(torch.tensor(1 - beta))]), 0)
    jsd = beta * (lp.exp() * (lp - lm)).sum(-1) + (1 - beta) * (lq.exp() * (lq - lm)).sum(-1)
    ce = F.cross_entropy(s, targets.clamp(min=0), reduction="none")
    counted = targets != PAD
    per_token = torch.where(counted, (1 - w) * jsd + w * ce, 0.0)
    return per_token.sum() / counted.sum()


def fused_distillation(student_h, student_w, teacher_h, teacher_w, targets, temperature, beta, w):
    return fusedloss.linear_distillation_loss(student_h, student_w, teacher_h, teacher_w, targets,
                                              divergence="jsd", beta=beta,
                                              temperature=temperature, hard_label_weight=w)


def distillation_loss(student, teacher, batch, loss_fn, temperature=2.0, beta=0.5, w=0.1):
    inputs, targets = batch
    h = student.hidden_states(inputs).reshape(-1, student.head.weight.size(1))
    with torch.no_grad():  # the teacher: the forward alone, nothing kept
        th = teacher.hidden_states(inputs).reshape(-1, teacher.head.weight.size(1))
    return loss_fn(h, student.head.weight, th, teacher.head.weight, targets.reshape(-1),
                   temperature, beta, w)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=256, help="the student's (the teacher: 2x)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    student = TinyLM(args.vocab, args.hidden).to(device)
    teacher = TinyLM(args.vocab, 2 * args.hidden, layers=3).to(device).requires_grad_(False)
    sequences = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)
    targets = sequences[:, 1:].clone()
    targets[:, -args.seq // 8:] = PAD  # padding at the end of every sequence: no loss there
    batch = (sequences[:, :-1], targets)

    compare(student, {name: (lambda fn=fn: distillation_loss(student, teacher, batch, fn))
                      for name, fn in (("torch", torch_distillation),
                                       ("fusedloss", fused_distillation))},
            device, f"distillation step, {args.batch} sequences of {args.seq} tokens, "
            f"V = {args.vocab}, H = {args.hidden} (student), {2 * args.hidden} (teacher)")

if __name__ == "__main__":
    main()
