"""fusedloss.linear_log_probs: per-token log-probabilities, entropy and arg-max from hidden states
and the LM head's weight, without the [tokens, V] logits (include/fusedloss/linear_log_probs.h):
the head RL post-training runs for the policy and the reference model.

The forward runs one GEMM a token chunk and keeps lse and entropy (8 B a token); the backward
recomputes each chunk's logits for the upstream gradients of log_probs and entropy (a PPO / GRPO
loss knows them only after the forward): 4 GEMMs in all. A call no gradient follows (no_grad,
the reference model, rollout scoring) keeps nothing.

tp_group of size > 1: weight is this rank's vocabulary shard; every rank computes its shard's
statistics (24 B a token), one all-gather over the group merges them, and every rank gets the
same results. dhidden_reduction as for fusedloss.linear_cross_entropy: "partial" (this rank's
partial sum), "all_reduce", or "reduce_scatter" (hidden is this rank's slice of the tokens).
"""
import functools
from typing import NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _C
from ._op import FusedOp
from ._distributed import (deferred_rejection, fingerprint, group_name, group_size, rank_checks,
                           resolve_group)
from ._sequence_parallel import gather_token_slices, gathered_shape, own_rows_buffer, sum_into_own_rows
from ._views import (agreement_flag, as_bool, as_choice, as_float, choice_name, as_int, autocast_operands, device_of,
                     index, matrix, require_same_device, require_tensor,
                     rows_of, stream_of, validated, values_in)
from .cross_entropy import check_targets_on_host
from ._head import as_workspace_bytes, group_place, set_shard_and_chunking, validate_head_operands

_OP = "fusedloss.linear_log_probs"
_DHIDDEN = {"partial": 0, "all_reduce": 1, "reduce_scatter": 2}


class LogProbs(NamedTuple):
    """linear_log_probs' results, one per token (target's shape)."""
    log_probs: Tensor            # fp32: log softmax(hidden @ weight.T / temperature)[token]
    entropy: Optional[Tensor]    # fp32: -sum p log p of that distribution (entropy=True)
    argmax: Optional[Tensor]     # int64 global ids, ties -> the smallest (argmax=True)


@functools.lru_cache(maxsize=256)
def _options(temperature, ignore_index, workspace_bytes, tf32, rank, v_local, world, rows, hidden):
    o = _C.LinearLogProbsOptions()
    o.temperature = temperature
    o.ignore_index = ignore_index
    set_shard_and_chunking(o, workspace_bytes, tf32, rank, v_local, world)
    validated(_C.validate_linear_log_probs_options, o, rows, v_local, hidden)
    return o


def _call_options(hidden, weight, temperature, ignore_index, workspace_bytes, tf32, group):
    """(the C++ options of a call on these rows, its group or None)."""
    g, rank, world = group_place(group)
    return _options(temperature, ignore_index, workspace_bytes, tf32, rank, weight.size(0), world,
                    hidden.size(0), hidden.size(1)), g


def _forward(hidden: Tensor, weight: Tensor, tokens: Tensor, temperature: float,
             ignore_index: int, workspace_bytes: int, tf32: bool, group: str, check: bool,
             grad: bool, dhidden_reduction: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(hidden rows [N, H], weight [V_local, H], tokens (N of any shape)) -> (log_probs, entropy,
    argmax, lse), each [N]: this shard's statistics, their all-gather over the group, the merge.
    At TP > 1 with check, the shard agreement (rows, V_local, the tokens, the options, whether a
    gradient follows) runs here, when the op runs (eager or in a compiled graph), after
    everything this rank allocates."""
    g = resolve_group(group) if group else None
    options = (fingerprint(temperature=temperature, ignore_index=ignore_index,
                           dtype=str(hidden.dtype), H=hidden.size(-1),
                           dhidden_reduction=choice_name(_DHIDDEN, dhidden_reduction),
                           gradient=grad, tokens_shape=tuple(tokens.shape))
               if g is not None and check else 0)
    tokens = tokens.reshape(-1)
    with rank_checks(g, check, _OP, options=options) as checks:
        opts, _ = _call_options(hidden, weight, temperature, ignore_index, workspace_bytes, tf32,
                                group)
        world = 1 if g is None else dist.get_world_size(g)
        dev = hidden.device
        h, w = rows_of(hidden), rows_of(weight)
        _, tv = index(tokens, "tokens")
        n = h.size(0)
        checks.rows, checks.v_local, checks.target = n, w.size(0), tokens
        f32 = dict(dtype=torch.float32, device=dev)
        log_probs, entropy, lse = (torch.empty(n, **f32) for _ in range(3))
        argmax = torch.empty(n, dtype=torch.int64, device=dev)
        nbytes = _C.LOG_PROB_STATS_BYTES * n
        stats = torch.empty(world * nbytes, dtype=torch.uint8, device=dev)
        mine = stats[:nbytes] if world == 1 else torch.empty(nbytes, dtype=torch.uint8, device=dev)
    stream = stream_of(h)
    _C.linear_log_probs_local_stats(matrix(h), matrix(w), tv, opts, mine.data_ptr(), stream)
    if world > 1:
        dist.all_gather_into_tensor(stats, mine, group=g)
    _C.log_probs_merge(stats.data_ptr(), world, n, tv, opts, log_probs.data_ptr(),
                       entropy.data_ptr(), argmax.data_ptr(), lse.data_ptr(), device_of(h), stream)
    return log_probs, entropy, argmax, lse


def _forward_fake(hidden, weight, tokens, *options):  # (tokens of any shape: N of them)
    n = tokens.numel()
    return (hidden.new_empty(n, dtype=torch.float32), hidden.new_empty(n, dtype=torch.float32),
            hidden.new_empty(n, dtype=torch.int64), hidden.new_empty(n, dtype=torch.float32))


def _backward(grad_log_probs: Optional[Tensor], grad_entropy: Optional[Tensor], hidden: Tensor,
              weight: Tensor, tokens: Tensor, lse: Tensor, entropy: Tensor, temperature: float,
              ignore_index: int, workspace_bytes: int, tf32: bool, group: str, check: bool,
              grad: bool, dhidden_reduction: int) -> Tuple[Tensor, Tensor]:
    """The recompute backward into new dhidden [N, H] and dweight [V_local, H], then dhidden's
    collective over the group (dhidden_reduction)."""
    opts, g = _call_options(hidden, weight, temperature, ignore_index, workspace_bytes, tf32, group)
    reduced = None if g is None else {1: "all-reduce", 2: "reduce-scatter"}.get(dhidden_reduction)
    h, w = rows_of(hidden), rows_of(weight)
    _, tv = index(tokens, "tokens")
    dh = torch.empty(h.shape, dtype=hidden.dtype, device=hidden.device)
    dw = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    own_rows = own_rows_buffer(dh, g) if reduced == "reduce-scatter" else None
    glp = None if grad_log_probs is None else values_in(grad_log_probs, torch.float32)
    gent = None if grad_entropy is None else values_in(grad_entropy, torch.float32)
    _C.linear_log_probs_backward(
        matrix(h), matrix(w), tv, lse.data_ptr(), entropy.data_ptr(),
        0 if glp is None else glp.data_ptr(), 0 if gent is None else gent.data_ptr(), opts,
        matrix(dh), matrix(dw), False, stream_of(h))
    if reduced == "all-reduce":
        dist.all_reduce(dh, group=g)
    elif reduced == "reduce-scatter":
        sum_into_own_rows(dh, g, own_rows)
    return dh, dw


def _backward_fake(grad_log_probs, grad_entropy, hidden, weight, *rest):
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape)


def _setup(ctx, inputs, output):
    hidden, weight, tokens, *options = inputs
    _, entropy, _, lse = output
    ctx.options = options
    ctx.save_for_backward(hidden, weight, tokens, lse, entropy)


def _grads(ctx, grads, kernels):
    grad_log_probs, grad_entropy, _ = grads
    hidden, weight, tokens, lse, entropy = ctx.saved_tensors
    dh, dw = kernels.bwd(grad_log_probs, grad_entropy, hidden, weight, tokens, lse, entropy,
                         *ctx.options)
    return (dh, dw) + (None,) * (1 + len(ctx.options)), None


_linear_log_probs = FusedOp(
    "linear_log_probs", forward=_forward, forward_fake=_forward_fake, setup=_setup,
    backward=_grads, inplace_flag="inplace_backward", n_outputs=3,
    kernels={"bwd": (_backward, _backward_fake, ())})


def linear_log_probs(hidden: Tensor, weight: Tensor, tokens: Tensor, *, temperature: float = 1.0,
                     entropy: bool = True, argmax: bool = False,
                     loss_mask: Optional[Tensor] = None, ignore_index: int = -100,
                     tp_group: Optional["dist.ProcessGroup"] = None,
                     check_shard_agreement: bool = True, dhidden_reduction: str = "partial",
                     workspace_bytes: Optional[int] = None) -> LogProbs:
    """log softmax(hidden @ weight.T / temperature) at each token, its entropy and arg-max,
    without the [N, V] logits.

    hidden [N, H] or [s, b, H] and weight [V_local, H] (fp32/fp16/bf16, one dtype, any strides;
    under torch.autocast the GEMMs run in its dtype); tokens: integer ids in hidden's shape
    without H (the sampled tokens). temperature: > 0, finite (the sampling temperature).
    Tokens equal to ignore_index, or where loss_mask (tokens' shape, any real dtype) is zero,
    give log_prob = entropy = 0 and no gradient. Results are fp32 (int64 for argmax) in tokens'
    shape; entropy is None unless entropy=True, argmax None unless argmax=True (ties: the
    smallest id).

    Gradients flow from log_probs and entropy together, for any upstream gradients, into
    hidden and weight in their dtypes (4 GEMMs: the backward recomputes the logits a chunk at a
    time). tp_group, check_shard_agreement and dhidden_reduction are as for
    fusedloss.linear_cross_entropy. workspace_bytes bounds the logits chunk buffer and the GEMM
    workspace together (default 256 MiB).

    CPU tokens outside [0, V) that are not ignore_index raise (on every rank at TP > 1); CUDA
    tokens are not read on the host (no synchronisation): such a row's log_prob and entropy are
    NaN.
    """
    name = group_name(tp_group)
    group = tp_group if name else None  # (not resolved from its name: torch.compile traces this)
    check, bad_flag = agreement_flag(check_shard_agreement)
    # Every argument check inside the agreement's reach: at TP > 1 a rank that fails raises the
    # same error on every rank (deferred to the graph under torch.compile), nothing hangs.
    with rank_checks(group, check, _OP, only_on_error=True, defer_when_compiling=True) as checks:
        if bad_flag is not None:
            raise bad_flag
        t_value = as_float(temperature, "temperature")
        want_entropy, want_argmax = as_bool(entropy, "entropy"), as_bool(argmax, "argmax")
        ignore = as_int(ignore_index, "ignore_index")
        dh_red = as_choice(dhidden_reduction, "dhidden_reduction", _DHIDDEN)
        workspace = as_workspace_bytes(workspace_bytes)
        if not (t_value > 0 and t_value != float("inf")):
            raise ValueError(f"temperature: got {temperature!r}, expected a finite value > 0")
        hidden, weight = autocast_operands(hidden, weight)
        world = group_size(tp_group) if name else 1
        slices = world if name and dh_red == _DHIDDEN["reduce_scatter"] else 1
        _validate(hidden, weight, tokens, loss_mask, slices)
        if loss_mask is not None:  # masked tokens are ignored ones
            tokens = torch.where(loss_mask != 0, tokens, torch.full_like(tokens, ignore))
        v_local, rows, H = weight.size(0), tokens.numel(), hidden.size(-1)
        tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
        if not torch.compiler.is_compiling():  # traced calls are checked when the op runs
            # (the options as rank 0's: this rank's shard is the op's to place)
            o = _options(t_value, ignore, workspace, tf32, 0, v_local, world, rows, H)
            if name:  # inside the agreement's reach (at TP = 1 the core checks them, once)
                check_targets_on_host(tokens, o, "tokens")
    if checks.deferred is not None:  # traced: raised on every rank when the graph runs
        rejected = deferred_rejection((hidden, weight, tokens), "none", tokens, name, _OP,
                                      checks.deferred)
        return LogProbs(rejected, rejected, None)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if slices > 1:
        hidden_grad = grad and hidden.requires_grad
        if not hidden_grad:
            dh_red = _DHIDDEN["partial"]
        hidden = gather_token_slices(hidden, name, check, hidden_grad, rows, v_local, _OP)
    flat = hidden.reshape(-1, H) if hidden.dim() == 3 else hidden
    lp, ent, am = _linear_log_probs(flat, weight, tokens, t_value, ignore, workspace, tf32, name,
                                    bool(name) and check, grad, dh_red)
    return LogProbs(lp.view(tokens.shape), ent.view(tokens.shape) if want_entropy else None,
                    am.view(tokens.shape) if want_argmax else None)


def _validate(hidden, weight, tokens, loss_mask, slices):
    validate_head_operands(hidden, weight)
    require_tensor(tokens, "tokens")
    shape = tuple(hidden.shape[:-1]) if slices == 1 else gathered_shape(hidden.shape[:-1], slices)
    if tuple(tokens.shape) != shape:
        what = ("hidden's shape without the hidden dim" if slices == 1 else
                f"the tokens of {slices} ranks' slices of hidden along dim 0")
        raise ValueError(f"tokens: got shape {tuple(tokens.shape)}, expected {shape} ({what})")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"tokens.dtype: got {tokens.dtype}, expected an integer dtype")
    require_same_device(tokens, "tokens", hidden, "hidden")
    if loss_mask is not None:
        require_tensor(loss_mask, "loss_mask")
        if loss_mask.shape != tokens.shape:
            raise ValueError(f"loss_mask: got shape {tuple(loss_mask.shape)}, expected tokens' "
                             f"shape {tuple(tokens.shape)}")
        if loss_mask.is_complex() or loss_mask.requires_grad:
            raise ValueError("loss_mask: got a complex tensor or one that requires grad, expected "
                             "a constant real tensor (bool, integer or floating point)")
        require_same_device(loss_mask, "loss_mask", hidden, "hidden")
