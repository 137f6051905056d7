"""What the LM heads (fusedloss.linear_cross_entropy, fusedloss.linear_log_probs and the
distillation loss's two heads) check of their arguments, below those modules."""
import torch

from ._views import as_int, require_same_device, require_values


def as_workspace_bytes(value, name: str = "workspace_bytes") -> int:
    """workspace_bytes as the op takes it: None (0: the core's default) or a positive int."""
    if value is None:
        return 0
    v = as_int(value, name)
    if v <= 0:
        raise ValueError(f"{name}: got {v}, expected None or a positive number of bytes")
    return v


def set_shard_and_chunking(o, workspace_bytes: int, tf32: bool, rank: int, v_local: int,
                           world: int):
    """The chunk loop's and the vocabulary shard's fields of a head's C++ options (the log-prob
    head's, the distillation loss's): workspace_bytes (0: the core's default), TF32, this rank's
    shard [rank V_local, (rank + 1) V_local) of world V_local classes."""
    if workspace_bytes:
        o.workspace_bytes = workspace_bytes
    o.allow_tf32 = tf32
    o.vocab_start = rank * v_local
    o.vocab_global = world * v_local
    return o


def group_place(group: str):
    """(the process group a traced op names, or None at one rank; this rank; the group's size)."""
    from ._distributed import rank_and_size, resolve_group
    g = resolve_group(group) if group else None
    rank, world = rank_and_size(g) if g is not None else (0, 1)
    return g, rank, world


def validate_head_operands(hidden, weight, fp32_weight_ok=False, names=("hidden", "weight")):
    """An LM head's operands, as every op over them takes them: hidden [N, H] or [s, b, H] and
    weight [V_local, H] in one float dtype (or an fp32 weight, fp32_weight_ok) on one device;
    `names`: the arguments' names in the messages."""
    h, w = names
    require_values(hidden, h)
    require_values(weight, w)
    if hidden.dim() not in (2, 3) or hidden.size(-1) == 0:
        raise ValueError(f"{h}: got shape {tuple(hidden.shape)}, expected a 2-D [N, H] or 3-D "
                         "[s, b, H] tensor with H >= 1")
    if weight.dim() != 2 or weight.size(1) != hidden.size(-1) or weight.size(0) == 0:
        raise ValueError(f"{w}: got shape {tuple(weight.shape)}, expected [V_local, "
                         f"{hidden.size(-1)}] (V_local >= 1, H = {h}.shape[-1])")
    if weight.dtype != hidden.dtype and not (fp32_weight_ok and weight.dtype == torch.float32):
        raise ValueError(f"{w}.dtype: got {weight.dtype}, expected {hidden.dtype} ({h}'s dtype)")
    require_same_device(weight, w, hidden, h)
