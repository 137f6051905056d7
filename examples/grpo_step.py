"""One GRPO step in plain PyTorch on a small causal LM, with and without fusedloss.linear_log_probs:
the same loss and gradients, and the time and memory of each (on the GPU when there is one, else
the CPU backend).

GRPO per prompt group: rewards r_i of G sampled completions -> advantages A_i = (r_i - mean) / std;
per completion token, at the sampling temperature T:
    ratio   = exp(logp_policy - logp_old)                     (logp_old: the rollout's, no grad)
    loss    = -min(ratio A, clip(ratio, 1 - eps, 1 + eps) A)  clipped policy gradient
            + beta (exp(logp_ref - logp_policy) - (logp_ref - logp_policy) - 1)   KL to the reference
            - c_ent entropy                                   entropy bonus
averaged over the completion tokens. Both heads give logp_policy and entropy from the last hidden
states: torch through [tokens, V] logits, fusedloss without them.

    python examples/grpo_step.py [--vocab 32000] [--hidden 256] [--seq 256] [--group 8]
"""
import argparse
import copy
import time

import torch
import torch.nn as nn

import fusedloss


class TinyLM(nn.Module):
    """Embedding, a few causal self-attention blocks, the LM head's weight [V, H]."""

    def __init__(self, vocab, hidden, layers=2, heads=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        block = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def hidden_states(self, tokens):
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.size(1), device=tokens.device)
        return self.norm(self.blocks(self.embed(tokens), mask=mask, is_causal=True))


def torch_head(h, weight, targets, temperature):
    """log_softmax(logits / T)[target] and the entropy, through the [tokens, V] logits (the way
    TRL and verl compute them by default)."""
    logits = (h @ weight.t()).float() / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def fused_head(h, weight, targets, temperature):
    out = fusedloss.linear_log_probs(h, weight, targets, temperature=temperature)
    return out.log_probs, out.entropy


def grpo_loss(policy, reference, sequences, completion_mask, advantages, logp_old, head,
              temperature=0.7, eps=0.2, beta=0.04, c_ent=0.01):
    inputs, targets = sequences[:, :-1], sequences[:, 1:]
    mask = completion_mask[:, 1:].float()
    h = policy.hidden_states(inputs)
    logp, entropy = head(h, policy.head.weight, targets, temperature)
    with torch.no_grad():  # the reference model: the forward alone, nothing kept
        logp_ref, _ = head(reference.hidden_states(inputs), reference.head.weight, targets,
                           temperature)
    ratio = torch.exp(logp - logp_old)
    a = advantages[:, None]
    pg = -torch.min(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
    d = logp_ref - logp
    kl = torch.exp(d) - d - 1
    per_token = pg + beta * kl - c_ent * entropy
    return (per_token * mask).sum() / mask.sum()


def measure(model, step, device):
    """One forward+backward of `step()` (the model's loss): (loss, the model's gradients, ms,
    peak extra MiB on CUDA)."""
    model.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    loss = step()
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device == "cuda" else float("nan")
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, ms, peak


def compare(model, steps, device, title):
    """Each of steps {"torch": fn, "fusedloss": fn} measured after a warm-up; prints the losses,
    the largest gradient difference, time and memory; exits non-zero where they disagree."""
    results = {}
    for name, step in steps.items():
        measure(model, step, device)  # warm-up
        results[name] = measure(model, step, device)
    (l_t, g_t, ms_t, mem_t), (l_f, g_f, ms_f, mem_f) = results["torch"], results["fusedloss"]
    worst = max(((g_f[k] - g_t[k]).norm() / g_t[k].norm().clamp(min=1e-30)).item() for k in g_t)
    print(f"[{device}] {title}")
    print(f"  loss: torch {l_t.item():.6f}  fusedloss {l_f.item():.6f}  "
          f"(difference {abs(l_t - l_f).item():.2e})")
    print(f"  gradients: the largest relative difference over {len(g_t)} parameters {worst:.2e}")
    print(f"  time: torch {ms_t:.1f} ms  fusedloss {ms_f:.1f} ms"
          + (f";  peak extra memory: torch {mem_t:.0f} MiB  fusedloss {mem_f:.0f} MiB"
             if device == "cuda" else ""))
    fusedloss.check_device_errors()
    tol = 1e-4  # fp32: the two differ by float rounding only
    if abs(l_t - l_f).item() > tol * max(1.0, abs(l_t.item())) or worst > 1e-3:
        raise SystemExit(f"the two losses disagree beyond {tol}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--prompts", type=int, default=2)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    policy = TinyLM(args.vocab, args.hidden).to(device)
    reference = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():  # a policy that has moved away from the reference
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.01)

    # A rollout: prompts of a quarter of the sequence, completions of varying length after them
    # (the rest is padding), rewards per completion.
    n, prompt = args.prompts * args.group, args.seq // 4
    sequences = torch.randint(0, args.vocab, (n, args.seq), device=device)
    completion_mask = torch.zeros(n, args.seq, dtype=torch.bool, device=device)
    lengths = torch.randint((args.seq - prompt) // 2, args.seq - prompt + 1, (n,), device=device)
    for i in range(n):
        completion_mask[i, prompt:prompt + int(lengths[i])] = True
    rewards = torch.rand(args.prompts, args.group, device=device)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) /
                  (rewards.std(1, keepdim=True) + 1e-4)).reshape(-1)
    with torch.no_grad():  # the rollout policy's log-probs (the policy before this step)
        logp_old, _ = fused_head(policy.hidden_states(sequences[:, :-1]), policy.head.weight,
                                 sequences[:, 1:], 0.7)
        logp_old = logp_old + 0.01 * torch.randn_like(logp_old)  # an older policy's
    batch = (sequences, completion_mask, advantages, logp_old)

    compare(policy, {name: (lambda head=head: grpo_loss(policy, reference, *batch, head=head))
                     for name, head in (("torch", torch_head), ("fusedloss", fused_head))},
            device, f"GRPO step, {n} sequences of {args.seq} tokens, V = {args.vocab}, "
            f"H = {args.hidden}")

if __name__ == "__main__":
    main()
