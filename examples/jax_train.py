"""A small causal LM trained a few steps in JAX with fusedloss.jax, against the same model in
plain jax.numpy: the same losses step by step.

    python examples/jax_train.py [--steps 8] [--tp 4]

The model: token embedding, one causal attention block and one SwiGLU MLP block (pre-norm,
residual), a final RMSNorm and the LM head. fusedloss.jax supplies rms_norm, swiglu (over the
fused gate-up projection) and linear_cross_entropy (the LM head and the loss in one op, without
the [tokens, V] logits). Optax's AdamW where optax is installed, else plain SGD.

Then the same training with the LM head vocab-parallel under jax.shard_map over --tp devices
(four CPU devices here: jax_num_cpu_devices): each device holds V/tp rows of the head's weight,
fusedloss merges the shards' per-row statistics with one all_gather of 16 B/row, and the losses
match the unsharded run's. Runs on the CPU in seconds; on a GPU where JAX has one.
"""
import argparse
import os
import sys

import jax

if "jax_num_cpu_devices" in jax.config.values:
    jax.config.update("jax_num_cpu_devices", 4)  # before JAX starts its backends
else:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fusedloss.jax as fj  # noqa: E402

VOCAB, HIDDEN, FFN, HEADS, SEQ, BATCH = 256, 64, 128, 4, 32, 8
EPS = 1e-5


def init(key):
    k = jax.random.split(key, 6)
    normal = lambda key, shape, scale: jax.random.normal(key, shape, jnp.float32) * scale  # noqa: E731
    return {
        "embed": normal(k[0], (VOCAB, HIDDEN), 0.5),
        "norm1": jnp.ones(HIDDEN), "norm2": jnp.ones(HIDDEN), "norm_f": jnp.ones(HIDDEN),
        "qkv": normal(k[1], (HIDDEN, 3 * HIDDEN), HIDDEN ** -0.5),
        "proj": normal(k[2], (HIDDEN, HIDDEN), HIDDEN ** -0.5),
        "gate_up": normal(k[3], (HIDDEN, 2 * FFN), HIDDEN ** -0.5),  # [gate | up], fused
        "down": normal(k[4], (FFN, HIDDEN), FFN ** -0.5),
        "head": normal(k[5], (VOCAB, HIDDEN), HIDDEN ** -0.5),  # [V, H], as the op takes it
    }


# ---- the model's pieces, fused (fusedloss.jax) or plain (jax.numpy) ----

def rms_norm_jnp(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS) * w


def swiglu_jnp(y):
    gate, up = jnp.split(y, 2, -1)
    return jax.nn.silu(gate) * up


def head_loss_jnp(h, w, targets):
    logits = h @ w.T
    lse = jax.nn.logsumexp(logits, -1)
    return jnp.mean(lse - jnp.take_along_axis(logits, targets[:, None], -1)[:, 0])


FUSED = dict(rms_norm=lambda x, w: fj.rms_norm(x, w, eps=EPS), swiglu=fj.swiglu,
             head_loss=fj.linear_cross_entropy)
PLAIN = dict(rms_norm=rms_norm_jnp, swiglu=swiglu_jnp, head_loss=head_loss_jnp)


def hidden_states(params, tokens, ops):
    """[BATCH, SEQ] tokens -> the final normed hidden states [BATCH * SEQ, HIDDEN]."""
    x = params["embed"][tokens]
    b, s, _ = x.shape
    q, k, v = jnp.split(ops["rms_norm"](x, params["norm1"]) @ params["qkv"], 3, -1)
    heads = lambda t: t.reshape(b, s, HEADS, HIDDEN // HEADS)  # noqa: E731
    scores = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)) / (HIDDEN // HEADS) ** 0.5
    causal = jnp.tril(jnp.ones((s, s), bool))
    attn = jax.nn.softmax(jnp.where(causal, scores, -1e9), -1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", attn, heads(v)).reshape(b, s, HIDDEN) @ params["proj"]
    x = x + ops["swiglu"](ops["rms_norm"](x, params["norm2"]) @ params["gate_up"]) @ params["down"]
    return ops["rms_norm"](x, params["norm_f"]).reshape(b * s, HIDDEN)


def loss_fn(params, tokens, ops, head_loss=None):
    """Next-token cross-entropy: position i predicts token i + 1 (the last position predicts
    nothing: its target is ignore_index for the fused op, and is cut for the plain one)."""
    h = hidden_states(params, tokens, ops)
    targets = jnp.concatenate([tokens[:, 1:], jnp.full((tokens.shape[0], 1), -100)], 1).reshape(-1)
    if ops is PLAIN:
        b, s = tokens.shape
        kept = h.reshape(b, s, HIDDEN)[:, :-1].reshape(-1, HIDDEN)
        return head_loss_jnp(kept, params["head"], tokens[:, 1:].reshape(-1))
    return (head_loss or ops["head_loss"])(h, params["head"], targets)


def batches(key, steps):
    """Sequences that follow a fixed random successor table (learnable), with some noise."""
    k1, k2 = jax.random.split(key)
    successor = jax.random.permutation(k1, VOCAB)
    out = []
    for step in range(steps):
        start = jax.random.randint(jax.random.fold_in(k2, step), (BATCH,), 0, VOCAB)
        seq = [start]
        for _ in range(SEQ - 1):
            seq.append(successor[seq[-1]])
        out.append(jnp.stack(seq, 1))
    return out


class Sgd:
    """Plain SGD with optax's interface."""

    def __init__(self, lr):
        self.lr = lr

    def init(self, params):
        return ()

    def update(self, grads, state, params=None):
        return jax.tree.map(lambda g: -self.lr * g, grads), state


def optimizer():
    try:
        import optax
    except ImportError:
        return Sgd(0.5), "plain SGD (optax is not installed)"
    return optax.adamw(3e-3), "optax.adamw"


def train(params, data, loss, opt):
    state = opt.init(params)

    @jax.jit
    def step(params, state, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, state = opt.update(grads, state, params)
        return jax.tree.map(lambda p, u: p + u, params, updates), state, value

    losses = []
    for tokens in data:
        params, state, value = step(params, state, tokens)
        losses.append(float(value))
    return losses


def sharded_head_loss(mesh):
    """The LM head vocab-parallel: weight rows sharded over the mesh axis 'tp', hidden states and
    targets on every device; the loss (and the gradients) the same as unsharded."""
    if hasattr(jax, "shard_map"):
        shard_map = jax.shard_map
    else:  # older JAX
        from jax.experimental.shard_map import shard_map
    return shard_map(lambda h, w, t: fj.linear_cross_entropy(h, w, t, axis_name="tp"),
                     mesh=mesh, in_specs=(P(), P("tp"), P()), out_specs=P())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tp", type=int, default=4, help="devices for the vocab-parallel run (0: skip)")
    args = ap.parse_args()
    params = init(jax.random.key(0))
    data = batches(jax.random.key(1), args.steps)
    opt, opt_name = optimizer()
    print(f"{opt_name}, {args.steps} steps, V={VOCAB} H={HIDDEN}, {BATCH}x{SEQ} tokens, on "
          f"{jax.devices()[0].platform}")
    plain = train(params, data, lambda p, t: loss_fn(p, t, PLAIN), opt)
    fused = train(params, data, lambda p, t: loss_fn(p, t, FUSED), opt)
    runs = {"fusedloss.jax": fused}
    if args.tp > 1:
        if len(jax.devices()) < args.tp:
            print(f"vocab-parallel run skipped: {len(jax.devices())} devices, --tp {args.tp}")
        else:
            mesh = jax.make_mesh((args.tp,), ("tp",), devices=jax.devices()[:args.tp],
                                 axis_types=(jax.sharding.AxisType.Auto,))
            with (jax.set_mesh(mesh) if hasattr(jax, "set_mesh") else mesh):
                runs[f"fusedloss.jax, head over {args.tp} devices"] = train(
                    params, data, lambda p, t: loss_fn(p, t, FUSED, sharded_head_loss(mesh)), opt)
    print("step  jax.numpy  " + "  ".join(runs))
    worst = 0.0
    for i, ref in enumerate(plain):
        row = [runs[name][i] for name in runs]
        worst = max([worst] + [abs(v - ref) / max(1.0, abs(ref)) for v in row])
        print(f"{i:4d}  {ref:9.5f}  " + "  ".join(f"{v:{len(n)}.5f}" for v, n in zip(row, runs)))
    ok = worst < 1e-4 and plain[-1] < plain[0]
    print(f"largest relative difference to jax.numpy: {worst:.2e}; loss {plain[0]:.3f} -> "
          f"{plain[-1]:.3f}: {'ok' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
