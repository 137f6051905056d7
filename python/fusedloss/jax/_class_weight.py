"""A per-class weight for fusedloss.jax's losses, as torch.nn.functional.cross_entropy(weight=w)
defines it (fusedloss.cross_entropy's weight, fusedloss.linear_cross_entropy's class_weight):
each row's loss times w[target], 'mean' over the counted rows' weights; with label smoothing eps
torch's weighted term,

    (1 - eps) w[t] (lse - z_t) + eps / V sum_c w_c (lse - z_c),

built from the op's unsmoothed per-row loss nll = lse - z_t: sum_c w_c (lse - z_c) =
W (nll + z_t) - z . w, where each op supplies z_t and z . w (the linear head without logits).
JAX differentiates the composition."""
import jax.numpy as jnp
import numpy as np

from ._args import REDUCTIONS, require_array


def check_class_weight(w, arg, vocab, axis_name, label_smoothing, smoothing_formula, z_loss,
                       softcap):
    require_array(w, arg)
    if w.ndim != 1 or w.shape[0] != vocab or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"{arg}: got {np.dtype(w.dtype).name} {tuple(w.shape)}, expected a "
                         f"floating-point [{vocab}] (one weight per class)")
    if axis_name is not None:
        raise ValueError(f"{arg}: got an array with axis_name={axis_name!r}, expected no "
                         "axis_name (a per-class weight runs on the whole vocabulary)")
    if label_smoothing != 0.0:
        for option, given in (("smoothing_formula", smoothing_formula != "pytorch"),
                              ("z_loss", z_loss != 0.0), ("logit_softcap", softcap is not None)):
            if given:
                raise ValueError(f"{arg}: got an array with label_smoothing={label_smoothing} and "
                                 f"{option} set, expected {option} at its default (torch's "
                                 "weighted label smoothing is defined for the plain loss)")


def weighted(nll, w, target, ignore_index, reduction, label_smoothing, z_terms):
    """nll [N] fp32 (the op's reduction 'none', unsmoothed) weighted and reduced; z_terms(safe)
    -> (z_t [N], z . w [N]), called only with label smoothing."""
    t = target.reshape(-1)
    vocab = w.shape[0]
    counted = t != ignore_index
    safe = jnp.where(counted & (t >= 0) & (t < vocab), t, 0)
    w32 = w.astype(jnp.float32)
    row_weight = jnp.where(counted, w32[safe], 0.0)
    total = nll.reshape(-1) * row_weight
    if label_smoothing != 0.0:
        z_t, z_w = z_terms(safe)
        smooth = w32.sum() * (nll.reshape(-1) + z_t) - z_w
        total = (1.0 - label_smoothing) * total + jnp.where(counted, smooth, 0.0) * (
            label_smoothing / vocab)
    kind = REDUCTIONS[reduction]
    if kind == REDUCTIONS["none"]:
        return total.reshape(target.shape)
    if kind == REDUCTIONS["sum"]:
        return total.sum()
    norm = row_weight.sum()
    return jnp.where(norm != 0, total.sum() / jnp.where(norm != 0, norm, 1.0), 0.0)
