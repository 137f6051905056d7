"""The Megatron-core patcher (see fusedloss.megatron)."""
import contextlib
import importlib
import importlib.util
import inspect
import logging
import warnings
from typing import Optional

import fusedloss
from fusedloss._views import as_bool
from fusedloss._head import as_workspace_bytes

from . import lm_head, state

log = logging.getLogger("fusedloss.megatron")

_CE_FUSED = ("megatron.core.fusions.fused_cross_entropy", "_VocabParallelCrossEntropy")
_CE_UNFUSED = ("megatron.core.tensor_parallel.cross_entropy", "_VocabParallelCrossEntropy")
# the method that dispatches on cross_entropy_fusion_impl ('te', 'liger': replaced there)
_LM_LOSS = ("megatron.core.models.common.language_module.language_module",
            "LanguageModule.compute_language_model_loss")
_LIGER = "megatron.core.fusions.liger_cross_entropy"
_SWIGLU = [("megatron.core.fusions.fused_bias_swiglu", name)
           for name in ("SwiGLUFunction", "BiasSwiGLUFunction", "WeightedSwiGLUFunction")]
# The local spec's norm: every spec (LocalSpecProvider.layer_norm, gpt_layer_specs' LNImpl,
# the transformer block's final norm) holds this one class object, whatever the import order,
# so its __new__ is the narrowest point that covers them all.
_NORM = ("megatron.core.transformer.torch_norm", "WrappedTorchNorm.__new__")
# The GPT head: _postprocess is where the output layer meets the loss (see lm_head); the
# mappings are what the fused head calls for sequence parallelism and TP > 1 (checked, not
# replaced).
_HEAD = ("megatron.core.models.gpt.gpt_model", "GPTModel._postprocess")
_HEAD_NEEDS = [("megatron.core.tensor_parallel.mappings", name)
               for name in ("gather_from_sequence_parallel_region", "copy_to_tensor_model_parallel_region")]
# parameters the stand-ins read by name (autograd Functions: forward's; the norm: __new__'s);
# the rest are optional
_REQUIRED = {"_VocabParallelCrossEntropy": ("vocab_parallel_logits", "target"),
             "SwiGLUFunction": ("input",), "BiasSwiGLUFunction": ("input", "bias"),
             "WeightedSwiGLUFunction": ("input", "weights"),
             "WrappedTorchNorm.__new__": ("config", "hidden_size", "eps"),
             "LanguageModule.compute_language_model_loss": ("labels", "logits"),
             "GPTModel._postprocess": ("hidden_states", "labels", "inference_context"),
             "gather_from_sequence_parallel_region": ("input_", "tensor_parallel_output_grad", "group"),
             "copy_to_tensor_model_parallel_region": ("input_", "group")}

_ORIGINALS = {}  # (module, name) -> the original object, while patched


def _owner(module, attr):
    """(object holding the last name of a dotted attr, that name): (module, "X") for "X",
    (module.C, "__new__") for "C.__new__"."""
    *path, name = attr.split(".")
    for part in path:
        module = getattr(module, part)
    return module, name


def _import(module_name):
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise RuntimeError(f"fusedloss.megatron: cannot import {module_name} ({e}); is megatron-core "
                           "installed?") from e


def _resolve(module_name, attr):
    """The original object (an autograd Function, a staticmethod or a function), checked to
    take the parameters the stand-in reads; a clear error naming what is missing otherwise."""
    module = _import(module_name)
    try:
        owner, name = _owner(module, attr)
        # the raw entry (a staticmethod for __new__), so that unpatching restores it exactly
        found = inspect.getattr_static(owner, name, None)
    except AttributeError:
        owner, found = None, None
    original = _ORIGINALS.get((module_name, attr), found)
    if original is None:
        raise RuntimeError(f"fusedloss.megatron: {module_name}.{attr} not found in megatron-core "
                           f"{_megatron_version()}; this version is not supported")
    if isinstance(original, staticmethod):
        fn, where = original.__func__, attr
    elif inspect.isfunction(original):
        fn, where = original, attr
    else:
        fn, where = original.forward, f"{attr}.forward"
    params = inspect.signature(fn).parameters
    missing = [p for p in _REQUIRED.get(attr, ()) if p not in params]
    if missing:
        raise RuntimeError(f"fusedloss.megatron: {module_name}.{where} has no parameter "
                           f"{', '.join(missing)} in megatron-core {_megatron_version()} (its "
                           f"signature: {inspect.signature(fn)}); this version is not supported")
    return owner, original


def _megatron_version():
    return getattr(importlib.import_module("megatron.core"), "__version__", "unknown")


def _stand_in(original, name, run):
    """A class with the `apply` that Megatron calls on its autograd Function: hands run() the
    arguments the caller passed, by the original forward's parameter names (without ctx; an
    omitted optional one is absent, so run() can tell "not passed" from its default), plus the
    call itself (for falling back to the original). The names are read once, here:
    inspect.Signature.bind per call costs more than the rest of the adapter."""
    params = list(inspect.signature(original.forward).parameters.values())[1:]  # drop ctx
    names = tuple(p.name for p in params)
    required = [p.name for p in params if p.default is p.empty]

    def apply(*args, **kwargs):
        if len(args) > len(names):
            raise TypeError(f"{name}.apply: takes {len(names)} arguments ({', '.join(names)}), "
                            f"got {len(args)}")
        a = dict(zip(names, args))
        if kwargs:
            unknown = [k for k in kwargs if k not in names or k in a]
            if unknown:
                raise TypeError(f"{name}.apply: unexpected or repeated keyword arguments {unknown} "
                                f"(takes {', '.join(names)})")
            a.update(kwargs)
        if len(args) < len(required) and any(r not in a for r in required):
            raise TypeError(f"{name}.apply: missing {[r for r in required if r not in a]}")
        return run(a, args, kwargs)

    return type(name, (), {"__fusedloss_original__": original, "apply": staticmethod(apply)})


def _make_ce(original, where):
    """Stands in for a `_VocabParallelCrossEntropy`, whatever its forward's signature:
    (logits, target, tp_group) for the fused path, (logits, target, label_smoothing=0.0
    [, tp_group=None]) for the unfused one."""
    what = f"{where} vocab_parallel_cross_entropy"

    def run(a, _args, _kwargs):
        group = a.get("tp_group")
        if group is None and where == "unfused":
            group = state.tp_group_from_parallel_state()  # what Megatron's unfused path defaults to
        # Megatron's vocab_parallel_cross_entropy() passes its default 0.0 on to the Function
        # whoever called it (GPT's loss passes nothing), so 0.0 reads as "none given": the
        # patch's smoothing then applies on this route as on the fused one and the linear head.
        ls = a.get("label_smoothing")
        return state.cross_entropy(a["vocab_parallel_logits"], a["target"], state.guard(group, what),
                                   None if ls is None or float(ls) == 0.0 else float(ls))

    return _stand_in(original, f"FusedLoss{where.capitalize()}VocabParallelCrossEntropy", run)


def _make_swiglu(original, name):
    def run(a, args, kwargs):
        if a.get("cpu_offload_input"):
            state.warn_once("offload", f"fusedloss.megatron: {name} with cpu_offload_input=True runs "
                            "Megatron's own implementation (activation offload is not fused)")
            return original.apply(*args, **kwargs)
        fp8 = bool(a.get("fp8_input_store", False))
        return fusedloss.swiglu(a["input"], a.get("bias"), per_token_scale=a.get("weights"),
                                clamp_value=a.get("clamp_value"), fp8_input_store=fp8,
                                inplace_backward=state.CONFIG["swiglu_inplace_backward"] and not fp8)

    return _stand_in(original, f"FusedLoss{name}", run)


def _make_norm(original):
    """WrappedTorchNorm.__new__ that builds fusedloss's RMSNorm for normalization="RMSNorm"
    (with zero-centred gamma and sequence parallelism, which the torch norm refuses) and
    Megatron's own module for every other normalization."""
    from .modules import FusedLossRMSNorm
    new = original.__func__ if isinstance(original, staticmethod) else original

    def __new__(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if getattr(config, "normalization", None) == "RMSNorm":
            return FusedLossRMSNorm(config, hidden_size, eps)
        return new(cls, config, hidden_size, eps, *args, **kwargs)

    __new__.__fusedloss_original__ = original
    return staticmethod(__new__)


def _replaced_routes():
    """cross_entropy_fusion_impl values computed by fusedloss in compute_language_model_loss
    itself: 'te' always, 'liger' where this megatron-core has that route."""
    return ("te", "liger") if importlib.util.find_spec(_LIGER) is not None else ("te",)


def apply_fusedloss_to_megatron(cross_entropy: bool = True, swiglu: bool = True, rms_norm: bool = True,
                                linear_cross_entropy: bool = False, ignore_index: int = -100,
                                label_smoothing: float = 0.0, allow_vocab_parallel: bool = False,
                                inplace_backward: bool = True, swiglu_inplace_backward: bool = False,
                                check_shard_agreement: bool = True, swiglu_in_place=None,
                                linear_cross_entropy_backward: str = "recompute",
                                linear_cross_entropy_workspace_bytes: Optional[int] = None) -> None:
    """Swap Megatron-core's cross-entropy, SwiGLU, RMSNorm and (asked for) the GPT head for
    fusedloss's. Idempotent; a later call sets the patch to exactly what it asks for
    (cross_entropy=False after a full patch restores Megatron's cross-entropy).

    cross_entropy: every route of compute_language_model_loss: the fused 'native' and the
      unfused paths (their autograd Functions, so direct callers see them too), 'te' and, where
      this megatron-core has it, 'liger' (computed in compute_language_model_loss itself); any
      other route warns at its first call and runs Megatron's own. Per-token fp32 loss as
      Megatron returns, Megatron's label-smoothing formula averaged over the local shard;
      positions whose label is `ignore_index` get loss 0 and gradient 0 (Megatron would compute
      lse there and rely on loss_mask). `label_smoothing` applies on every route where Megatron's
      caller passes none or 0.0 (its unfused wrapper passes its default 0.0 on); a non-zero
      value passed wins. `inplace_backward` writes the gradient into the logits (Megatron does not read them
      again).
    swiglu: SwiGLUFunction / BiasSwiGLUFunction / WeightedSwiGLUFunction natively (bias,
      per-token weights, clamp, fp8 input store); cpu_offload_input falls back to Megatron's
      own, with one warning. `swiglu_inplace_backward` writes the input gradient into the fc1 output
      (`swiglu_in_place` is its deprecated spelling).
    rms_norm: the norm Megatron's local spec builds for normalization="RMSNorm" (WrappedTorchNorm:
      the transformer layers' input/pre-MLP norms, q/k norms and the final norm) becomes
      fusedloss.RMSNorm, whichever module imported the spec, in the models built while the patch
      is on (a norm is a module of the model: patch before building it); zero-centred gamma and
      sequence parallelism are supported (the weight keeps its `sequence_parallel` attribute for
      Megatron's all-reduce). TransformerEngine's spec (TENorm, and the norm fused into
      TELayerNormColumnParallelLinear) is left alone.
    linear_cross_entropy: GPTModel's output layer + loss become one
      fusedloss.linear_cross_entropy whenever labels are given (no [s, b, V/tp] logits); without
      labels, or in inference, Megatron's own head runs. Tied embeddings, sequence parallelism,
      gradient-accumulation fusion (the weight gradient is added to `main_grad`) as Megatron's
      output layer; a multi-token-prediction model, an output bias, deferred embedding wgrad or
      MuP logit scaling raise a RuntimeError naming it. Same options as cross_entropy.
    linear_cross_entropy_backward: "recompute" (default): the backward recomputes the logits
      (4 GEMMs), for any reduction of the per-token loss; 4 bytes a token kept in between.
      "auto": when Megatron's forward receives a `loss_mask` (pretrain_gpt's forward_step
      passes it), the forward computes the gradients of sum(loss_mask * loss), which Megatron's
      loss_func reduces times one scalar, and the backward only scales them (3 GEMMs; bf16 and
      fp32 models, fp16 recomputes); without one, "recompute". It keeps the gradients between
      forward and backward (dhidden [N, H], dweight [V/tp, H] in fp32 under
      gradient-accumulation fusion), and needs a loss function that reduces exactly
      c * sum(loss_mask * loss): any other makes the gradients (and an fp32 main_grad they are
      added to) NaN, raised by fusedloss.check_device_errors() on CUDA (on the CPU the
      backward raises); the head reads that error once itself, at the first backward after the
      patch (one host sync), so a loss function that does not fit raises at its first step.
    linear_cross_entropy_workspace_bytes: the fused head's bound on its logits chunk and GEMM
      workspace together (None: the op's default, 256 MiB). Larger chunks mean fewer passes
      over the weight gradient [V/tp, H] (one read-modify-write per chunk group), at that many
      bytes of memory.
    allow_vocab_parallel: without it, tensor_model_parallel_size > 1 raises RuntimeError here
      (when parallel_state is initialised) and at the first call (from the tp_group).
    check_shard_agreement: at TP > 1, every call checks that the ranks agree (one tiny
      all-gather and a host sync); False skips it, e.g. for CUDA-graph capture.
    """
    if swiglu_in_place is not None:
        warnings.warn("apply_fusedloss_to_megatron: swiglu_in_place= is deprecated; use "
                      "swiglu_inplace_backward=", DeprecationWarning, stacklevel=2)
        swiglu_inplace_backward = swiglu_in_place
    flags = dict(cross_entropy=cross_entropy, swiglu=swiglu, rms_norm=rms_norm,
                 linear_cross_entropy=linear_cross_entropy,
                 allow_vocab_parallel=allow_vocab_parallel, inplace_backward=inplace_backward,
                 swiglu_inplace_backward=swiglu_inplace_backward,
                 check_shard_agreement=check_shard_agreement)
    flags = {k: as_bool(v, k) for k, v in flags.items()}
    if linear_cross_entropy_backward not in ("auto", "recompute"):
        raise ValueError(f"linear_cross_entropy_backward: got {linear_cross_entropy_backward!r}, "
                         "expected 'auto' or 'recompute'")
    # the op's own check; the int (0: the op's default), not what was passed: the head's TP
    # agreement compares the options' repr
    workspace_bytes = as_workspace_bytes(linear_cross_entropy_workspace_bytes,
                                         "linear_cross_entropy_workspace_bytes")
    # the options are checked here, once, by the op that will use them
    fusedloss.CrossEntropyLoss(ignore_index=ignore_index, label_smoothing=label_smoothing,
                               **state.MEGATRON_SMOOTHING)
    if (flags["cross_entropy"] or flags["linear_cross_entropy"]) and not flags["allow_vocab_parallel"]:
        size = state.group_size(state.tp_group_from_parallel_state())
        if size > 1:
            raise RuntimeError("fusedloss.megatron: " + state.tp_refusal(
                f"tensor_model_parallel_size is {size}"))
    targets = []  # (module, attr, stand-in factory)
    if flags["cross_entropy"]:
        routes = _replaced_routes()
        targets += [(*_CE_FUSED, lambda original: _make_ce(original, "fused")),
                    (*_CE_UNFUSED, lambda original: _make_ce(original, "unfused")),
                    (*_LM_LOSS, lambda original: lm_head.make_lm_loss(original, routes))]
    if flags["swiglu"]:
        targets += [(m, a, lambda original, a=a: _make_swiglu(original, a)) for m, a in _SWIGLU]
    if flags["rms_norm"]:
        targets += [(*_NORM, _make_norm)]
    if flags["linear_cross_entropy"]:
        targets += [(*_HEAD, lm_head.make_postprocess)]
        for m, a in _HEAD_NEEDS:
            _resolve(m, a)
    # Every symbol is resolved and checked before anything changes: all or nothing.
    resolved = [(_resolve(m, a), m, a, make) for m, a, make in targets]
    wanted = {(m, a) for _, m, a, _ in resolved}
    for module_name, attr in [key for key in _ORIGINALS if key not in wanted]:  # no longer asked for
        setattr(*_owner(importlib.import_module(module_name), attr), _ORIGINALS.pop((module_name, attr)))
    state.configure(flags, ignore_index, label_smoothing, linear_cross_entropy_backward,
                    workspace_bytes)
    for (owner, original), module_name, attr, make in resolved:
        _ORIGINALS.setdefault((module_name, attr), original)
        setattr(owner, attr.split(".")[-1], make(original))
    log.info("fusedloss.megatron: patched %s", ", ".join(f"{m}.{a}" for m, a in _ORIGINALS))
    if flags["rms_norm"]:
        log.info("fusedloss.megatron: RMSNorm is replaced in Megatron's local spec only "
                 "(WrappedTorchNorm); TransformerEngine's spec (TENorm, the norm fused into "
                 "TELayerNormColumnParallelLinear) is left as it is")


def unpatch_megatron() -> None:
    """Restore every original Megatron object exactly."""
    for (module_name, attr), original in list(_ORIGINALS.items()):
        setattr(*_owner(importlib.import_module(module_name), attr), original)
        del _ORIGINALS[(module_name, attr)]


def is_patched() -> bool:
    return bool(_ORIGINALS)


@contextlib.contextmanager
def fusedloss_megatron(**options):
    """Context manager form: patched as asked inside the block; after it, the patch is what it
    was before (none, or an enclosing block's or an explicit call's), so blocks nest."""
    before = dict(state.CONFIG.get("options", {})) if is_patched() else None
    apply_fusedloss_to_megatron(**options)
    try:
        yield
    finally:
        if before is None:
            unpatch_megatron()
        else:
            apply_fusedloss_to_megatron(**before)
