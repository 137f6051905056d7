"""apply_fusedloss_to_megatron(linear_cross_entropy=True) on a real GPTModel (CPU, gloo): the
loss and every parameter gradient against the same model's unpatched head, at TP=1 and TP=2
with sequence parallelism on and off, tied and untied embeddings; gradient-accumulation fusion;
the refusals; and the cross-entropy routes of compute_language_model_loss ('te', 'liger')."""
import contextlib
import importlib
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

import fusedloss  # noqa: E402
import fusedloss._distributed  # noqa: E402
from fusedloss.megatron import apply_fusedloss_to_megatron, patch, unpatch_megatron  # noqa: E402
from dist_util import run_world  # noqa: E402

S, B, H, V = 16, 2, 64, 256
# the patch's own norm, in the reference too: the local spec's torch norm refuses sequence parallel
BASE = dict(cross_entropy=False, swiglu=False, rms_norm=True, allow_vocab_parallel=True)


@pytest.fixture(autouse=True)
def _clean():
    yield
    unpatch_megatron()


def _cpu_megatron():
    """This megatron-core allocates a few buffers on torch.cuda.current_device() (sequence-parallel
    gathers, the attention's scratch) and forks the CUDA RNG tracker around dropout; on a CPU
    rank those become the CPU and a no-op (dropout is 0 here), so the whole GPTModel runs."""
    from megatron.core.tensor_parallel import random
    torch.cuda.current_device = lambda: torch.device("cpu")
    random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


def _model(tp, sequence_parallel, tied, seed=0):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = TransformerConfig(num_layers=2, hidden_size=H, ffn_hidden_size=96, num_attention_heads=4,
                            use_cpu_initialization=True, normalization="RMSNorm", gated_linear_unit=True,
                            activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False,
                            hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
                            sequence_parallel=sequence_parallel)
    torch.manual_seed(seed)
    return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=V,
                    max_sequence_length=S, share_embeddings_and_output_weights=tied)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, 3] = labels[1, 0] = -100  # ignore_index: loss 0 here; Megatron relies on loss_mask
    mask = (labels != -100).float()
    scale = torch.rand(B, S, generator=g) * mask  # as Megatron's loss_mask weighting
    return ids, torch.arange(S).expand(B, S), labels, mask, scale


def _step(model, batch, **patch_options):
    ids, pos, labels, mask, scale = batch
    apply_fusedloss_to_megatron(**BASE, **patch_options)
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), 1).view(1, 1, S, S)
    model.zero_grad(set_to_none=True)
    loss = model(ids, pos, causal, labels=labels)
    (loss * scale).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads


def _check_parity(model, batch):
    calls, pre_calls = [], []
    hook = model.output_layer.register_forward_hook(lambda *args: calls.append(1))
    pre_hook = model.output_layer.register_forward_pre_hook(lambda *args: pre_calls.append(1))
    ref_loss, ref_grads = _step(model, batch)
    assert len(calls) == 1 and len(pre_calls) == 1
    loss, grads = _step(model, batch, linear_cross_entropy=True)
    assert len(calls) == 1  # the fused head: Megatron's output layer did not run
    assert len(pre_calls) == 2  # but its pre-hooks did (DDP's parameter all-gather wait)
    hook.remove()
    pre_hook.remove()
    assert loss.shape == (B, S) and loss.dtype == torch.float32
    mask = batch[3].bool()
    torch.testing.assert_close(loss[mask], ref_loss[mask], rtol=1e-5, atol=1e-5)
    assert (loss[~mask] == 0).all()
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    return ref_grads


def _masked_step(model, batch, reduce_with_mask=True, **patch_options):
    """A step as pretrain_gpt's: the loss_mask goes to the model's forward, and loss_func reduces
    sum(loss * loss_mask) / loss_mask.sum() (times a loss scale here)."""
    ids, pos, labels, mask, scale = batch
    apply_fusedloss_to_megatron(**BASE, **patch_options)
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), 1).view(1, 1, S, S)
    model.zero_grad(set_to_none=True)
    loss = model(ids, pos, causal, labels=labels, loss_mask=mask)
    # otherwise: per-token weights, still 0 where the label is ignored (Megatron's loss there
    # is lse, fusedloss's 0: only the mask makes them agree)
    weights = (mask if reduce_with_mask else scale).reshape(-1)
    ((loss.float().view(-1) * weights).sum() / mask.sum() * 2.5).backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check_masked_parity(model, batch):
    """With the loss_mask Megatron's forward receives, the fused head computes the gradients in
    its forward (linear_cross_entropy_backward="auto", opt-in): the same loss and gradients as the
    unpatched model; a loss function that does not reduce with the mask is refused in the
    backward (CPU: it raises, naming the way out), and "recompute" takes it."""
    mask = batch[3].bool()
    for reduce_with_mask in (True, False):
        ref_loss, ref_grads = _masked_step(model, batch, reduce_with_mask)
        for backward, workspace in (("auto", None), ("recompute", None), ("auto", 2 * 3 * V * 4)):
            # the last: chunks of a few tokens (not a divisor of S * B) through the patch
            options = dict(linear_cross_entropy=True, linear_cross_entropy_backward=backward,
                           linear_cross_entropy_workspace_bytes=workspace)
            if backward == "auto" and not reduce_with_mask:
                with pytest.raises(ValueError, match=r"grad_loss\[\d+\].*loss_mask.*recompute"):
                    _masked_step(model, batch, reduce_with_mask, **options)
                continue
            loss, grads = _masked_step(model, batch, reduce_with_mask, **options)
            torch.testing.assert_close(loss[mask], ref_loss[mask], rtol=1e-5, atol=1e-5)
            for name in ref_grads:
                torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-5,
                                           msg=f"{name} ({backward}, workspace {workspace}, "
                                               f"reduce_with_mask={reduce_with_mask})")


def _check_main_grad(model, batch, ref_grads, tied, dtype=torch.float32):
    """Gradient-accumulation fusion: the head's weight gradient lands in main_grad (fp32: from
    the op itself; bf16, grad_reduce_in_fp32=False: through autograd), what reaches .grad is
    Megatron's placeholder (zeros for the shared weight: zero_out_wgrad)."""
    layer = model.output_layer
    name = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
    weight = dict(model.named_parameters())[name]
    layer.gradient_accumulation_fusion = True  # (Megatron's own needs APEX's CUDA wgrad kernel)
    weight.main_grad = torch.zeros(weight.shape, dtype=dtype)
    weight.grad_added_to_main_grad = False
    try:
        _, grads = _step(model, batch, linear_cross_entropy=True)
    finally:
        layer.gradient_accumulation_fusion = False
    assert weight.grad_added_to_main_grad is True
    total = weight.main_grad.float() + (grads[name] if tied else 0)  # tied: the embedding's own in .grad
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(total, ref_grads[name], **tol)
    del weight.main_grad, weight.grad_added_to_main_grad


def _tp1(rank, world):
    from megatron.core import parallel_state
    _cpu_megatron()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    for tied in (False, True):
        apply_fusedloss_to_megatron(**BASE)
        model = _model(1, False, tied)
        batch = _batch(1 + tied)
        ref_grads = _check_parity(model, batch)
        _check_masked_parity(model, batch)
        _check_main_grad(model, batch, ref_grads, tied)
        _check_main_grad(model, batch, ref_grads, tied, torch.bfloat16)
    ids, pos, labels, _, _ = batch
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), 1).view(1, 1, S, S)
    # without labels Megatron's head runs: the logits, as unpatched
    apply_fusedloss_to_megatron(**BASE)
    want = model(ids, pos, causal)
    apply_fusedloss_to_megatron(**BASE, linear_cross_entropy=True)
    torch.testing.assert_close(model(ids, pos, causal), want)
    # what the fused head cannot honour is refused, by name (at the head: these settings would
    # change the decoder's layers too)
    def head():
        return model._postprocess(hidden_states=torch.randn(S, B, H), labels=labels, input_ids=ids,
                                  position_ids=pos, rotary_pos_emb=None, rotary_pos_cos=None,
                                  rotary_pos_sin=None)
    for attr, value, match in (("mtp_num_layers", 1, r"multi-token prediction heads \(config.mtp_num_layers=1\)"),
                               ("defer_embedding_wgrad_compute", True, "defer_embedding_wgrad_compute"),
                               ("use_mup", True, "MuP")):
        saved = getattr(model.config, attr, None)
        setattr(model.config, attr, value)
        with pytest.raises(RuntimeError, match=match):
            head()
        setattr(model.config, attr, saved)
    model.output_layer.bias = torch.nn.Parameter(torch.zeros(V))
    with pytest.raises(RuntimeError, match="output layer has a bias"):
        head()


def test_gpt_tp1_matches_unpatched_tied_and_untied():
    run_world(1, _tp1, timeout_s=300)


def _tp2(rank, world):
    from megatron.core import parallel_state
    _cpu_megatron()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    with pytest.raises(RuntimeError, match="allow_vocab_parallel=True"):
        apply_fusedloss_to_megatron(cross_entropy=False, linear_cross_entropy=True)
    for sp in (False, True):
        for tied in (False, True):
            apply_fusedloss_to_megatron(**BASE)
            model = _model(2, sp, tied)
            assert model.output_layer.sequence_parallel is sp
            batch = _batch(3 + 2 * sp + tied)  # same batch on both ranks, as Megatron feeds
            ref_grads = _check_parity(model, batch)
            _check_masked_parity(model, batch)
            _check_main_grad(model, batch, ref_grads, tied)  # this rank's shard of main_grad


def test_gpt_tp2_sequence_parallel_on_and_off_matches_unpatched():
    run_world(2, _tp2, timeout_s=300)


def _tp2_one_rank_wrong(rank, world):
    """One rank's labels do not fit its hidden states: every rank raises the same error at the
    same call, before Megatron's gather or copy (which would hang or mix shards)."""
    from megatron.core import parallel_state
    from fusedloss.megatron import lm_head
    _cpu_megatron()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    apply_fusedloss_to_megatron(**BASE, linear_cross_entropy=True)
    for sp in (False, True):
        model = _model(2, sp, tied=False)
        hidden = torch.randn(S // 2 if sp else S, B, H, requires_grad=True)
        labels = torch.randint(0, V, (B, S))
        if rank == 1:
            labels = labels[:, :-1]
        with pytest.raises(ValueError, match=r"vocab-parallel rank 1: labels: got shape \(2, 15\)"):
            lm_head.fused_head_loss(model, hidden, labels)
        assert hidden.grad is None
        labels = torch.randint(0, V, (B, S))
        if rank == 1:  # a class id past the vocabulary: the op's own check, agreed at the head
            labels[0, 3] = V
        with pytest.raises(ValueError, match=rf"vocab-parallel rank 1: labels\[0, 3\]: got {V}, expected in \[0, {V}\)"):
            lm_head.fused_head_loss(model, hidden, labels)
        # what only the op checked before (it now runs without its own agreement): named by
        # the rank that fails it, on every rank
        weight = model.output_layer.weight
        if rank == 1:
            model.output_layer.weight = torch.nn.Parameter(weight.detach().unsqueeze(1))
        with pytest.raises(ValueError, match=r"vocab-parallel rank 1: hidden_states: got shape .* output weight of shape \(128, 1, 64\)"):
            lm_head.fused_head_loss(model, hidden, torch.randint(0, V, (B, S)))
        model.output_layer.weight = weight
        # a setting the fused head refuses, on one rank only: refused on every rank
        model.config.use_mup = rank == 1
        with pytest.raises(ValueError, match=r"vocab-parallel rank 1: fusedloss.megatron: "
                           r"linear_cross_entropy=True: config.use_mup=True scales the logits"):
            lm_head.fused_head_loss(model, hidden, torch.randint(0, V, (B, S)))
        model.config.use_mup = False
        with pytest.raises(ValueError, match="vocab-parallel rank 1: target.dtype: got torch.float32"):
            lm_head.fused_head_loss(model, hidden, torch.randint(0, V, (B, S)).float() if rank == 1
                                    else torch.randint(0, V, (B, S)))
        # one agreement (one host sync) a call: the head's stands for the op's
        calls = []
        agree = fusedloss._distributed.agree
        fusedloss._distributed.agree = lambda *a, **k: calls.append(a) or agree(*a, **k)
        try:
            lm_head.fused_head_loss(model, hidden, torch.randint(0, V, (B, S))).sum().backward()
        finally:
            fusedloss._distributed.agree = agree
        assert len(calls) == 1 and hidden.grad is not None
        hidden.grad = None
    # the gradients in the forward take one collective per token chunk: one rank chunking
    # otherwise (its own FUSEDLOSS_LCE_BUFFERS; the workspace itself is an agreed option) is
    # refused on every rank, not left to pair mismatched collectives
    apply_fusedloss_to_megatron(**BASE, linear_cross_entropy=True, linear_cross_entropy_backward="auto",
                                linear_cross_entropy_workspace_bytes=2 * 4 * (V // world) * 4)
    model = _model(2, False, tied=False)
    hidden = torch.randn(S, B, H, requires_grad=True)
    mask = torch.ones(B, S)
    os.environ["FUSEDLOSS_LCE_BUFFERS"] = "1" if rank == 1 else "2"
    try:
        with pytest.raises(ValueError, match="chunking"):
            lm_head.fused_head_loss(model, hidden, torch.randint(0, V, (B, S)), mask)
    finally:
        del os.environ["FUSEDLOSS_LCE_BUFFERS"]
    lm_head.fused_head_loss(model, hidden, torch.randint(0, V, (B, S)), mask).sum().backward()
    assert hidden.grad is not None
    # one rank without a gradient (no_grad: the forward alone, every row's statistics in one
    # gather) beside one computing it in the forward (a gather per chunk): refused on both
    labels = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(3))
    with torch.set_grad_enabled(rank == 1):
        with pytest.raises(ValueError, match=r"rank 1's gradient=True differs from rank 0's gradient=False"):
            lm_head.fused_head_loss(model, hidden, labels, mask)
    with torch.no_grad():  # no_grad on every rank agrees, and matches the gradient's loss
        forward_only = lm_head.fused_head_loss(model, hidden, labels, mask)
    torch.testing.assert_close(forward_only, lm_head.fused_head_loss(model, hidden, labels, mask).detach())
    # other labels, or another mask, on one rank: each rank would compute another token's
    # loss (the op's own agreement compares a checksum of both; the head's stands for it)
    other = labels.clone()
    other[0, 0] = (other[0, 0] + rank) % V
    with pytest.raises(ValueError, match=r"vocab-parallel targets: rank 1's differ from rank 0's"):
        lm_head.fused_head_loss(model, hidden, other)
    other_mask = mask.clone()
    other_mask[0, 1] = 1.0 - rank
    with pytest.raises(ValueError, match=r"rank 1's differ from rank 0's \(a checksum of their "
                                         r"values, and of the loss_mask\)"):
        lm_head.fused_head_loss(model, hidden, labels, other_mask)
    # the same values on rank 1 in another dtype or layout (transposed views, a slice, a mask
    # expanded from one element): agreed, and the same loss
    want = lm_head.fused_head_loss(model, hidden, labels, mask).detach()
    wide = torch.zeros(B, 2 * S, dtype=torch.int32)
    wide[:, ::2] = labels
    for same_labels, same_mask in ((labels.to(torch.int32), mask.bool()),
                                   (labels.t().contiguous().t(), mask.t().contiguous().t()),
                                   (wide[:, ::2], mask.to(torch.bfloat16)),
                                   (labels, torch.ones(1, 1).expand(B, S))):
        assert mask.eq(1).all()  # (the expanded one stands for it)
        got = lm_head.fused_head_loss(model, hidden, same_labels if rank == 1 else labels,
                                      same_mask if rank == 1 else mask)
        torch.testing.assert_close(got.detach(), want)
    # one rank patched with another workspace: named on every rank, before any collective
    apply_fusedloss_to_megatron(**BASE, linear_cross_entropy=True,
                                linear_cross_entropy_workspace_bytes=(1 << 20) * (2 if rank else 1))
    with pytest.raises(ValueError, match=r"rank 1's workspace_bytes=2097152 differs from rank 0's "
                                         r"workspace_bytes=1048576"):
        lm_head.fused_head_loss(model, hidden, torch.randint(0, V, (B, S)))


def test_gpt_tp2_one_rank_with_wrong_labels_raises_on_every_rank():
    run_world(2, _tp2_one_rank_wrong, timeout_s=300)


class _Module:
    """What compute_language_model_loss reads of its LanguageModule."""

    def __init__(self, impl):
        from megatron.core.transformer.transformer_config import TransformerConfig
        self.config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                                        cross_entropy_loss_fusion=True)
        self.config.cross_entropy_fusion_impl = impl
        self.pg_collection = None


def _lm_loss(impl, logits, labels):
    from megatron.core.models.common.language_module.language_module import LanguageModule
    return LanguageModule.compute_language_model_loss(_Module(impl), labels, logits)


def test_te_and_liger_routes_are_computed_by_fusedloss_or_named(monkeypatch):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(S, B, 100, generator=g)  # [s, b, V]
    labels = torch.randint(0, 100, (B, S), generator=g)  # [b, s]
    ref = torch.nn.functional.cross_entropy(logits.double().permute(1, 2, 0), labels, reduction="none")
    apply_fusedloss_to_megatron()
    loss = _lm_loss("te", logits.clone(), labels)  # TransformerEngine need not be installed
    assert loss.shape == (B, S) and loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref, rtol=2e-5, atol=1e-6)
    liger = importlib.util.find_spec(patch._LIGER) is not None
    if not liger:  # this megatron-core has no liger route: Megatron's own runs, named once
        with pytest.warns(UserWarning, match="cross_entropy_fusion_impl='liger' is not replaced"):
            with contextlib.suppress(Exception):
                _lm_loss("liger", logits.clone(), labels)
        # a megatron-core that has it: computed by fusedloss
        monkeypatch.setattr(patch, "_LIGER", "megatron.core.fusions.fused_cross_entropy")
        apply_fusedloss_to_megatron()
    torch.testing.assert_close(_lm_loss("liger", logits.clone(), labels).double(), ref, rtol=2e-5, atol=1e-6)


def test_head_patch_is_all_or_nothing_and_unpatch_restores(monkeypatch):
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import mappings
    before = (GPTModel.__dict__["_postprocess"], LanguageModule.__dict__["compute_language_model_loss"])
    monkeypatch.delattr(mappings, "copy_to_tensor_model_parallel_region")
    with pytest.raises(RuntimeError, match=r"mappings\.copy_to_tensor_model_parallel_region not found"):
        apply_fusedloss_to_megatron(linear_cross_entropy=True)
    assert not fusedloss.megatron.is_patched()
    monkeypatch.undo()
    apply_fusedloss_to_megatron(linear_cross_entropy=True)
    assert GPTModel._postprocess.__fusedloss_original__ is before[0]
    assert LanguageModule.compute_language_model_loss.__fusedloss_original__ is before[1]
    apply_fusedloss_to_megatron()  # linear_cross_entropy=False: the head goes back to Megatron's
    assert GPTModel.__dict__["_postprocess"] is before[0]
    unpatch_megatron()
    assert (GPTModel.__dict__["_postprocess"], LanguageModule.__dict__["compute_language_model_loss"]) == before


@pytest.mark.parametrize("option,value,message", [
    ("linear_cross_entropy_backward", "in_forward", r"linear_cross_entropy_backward: got 'in_forward', "
                                                     r"expected 'auto' or 'recompute'"),
    ("linear_cross_entropy_workspace_bytes", 0, r"linear_cross_entropy_workspace_bytes: got 0, expected None "
                                                r"or a positive number of bytes"),
    ("linear_cross_entropy_workspace_bytes", -4096, r"linear_cross_entropy_workspace_bytes: got -4096"),
    ("linear_cross_entropy_workspace_bytes", 1.5, r"linear_cross_entropy_workspace_bytes: got 1.5 \(float\), "
                                                  r"expected an int"),
    ("linear_cross_entropy_workspace_bytes", True, r"linear_cross_entropy_workspace_bytes: got True, expected an int"),
])
def test_head_options_are_checked_when_patching(option, value, message):
    unpatch_megatron()
    with pytest.raises((ValueError, TypeError), match=message):
        apply_fusedloss_to_megatron(linear_cross_entropy=True, **{option: value})
    assert not fusedloss.megatron.is_patched()


def test_the_head_gets_the_workspace_and_the_context_manager_restores_it(monkeypatch):
    from fusedloss.megatron import fusedloss_megatron, lm_head, state
    # an integer-like value is stored as the int, so ranks passing 2**30 as a tensor and as an
    # int agree
    apply_fusedloss_to_megatron(linear_cross_entropy=True, linear_cross_entropy_workspace_bytes=torch.tensor(1 << 30))
    assert type(state.lce_options()["workspace_bytes"]) is int and state.lce_options()["workspace_bytes"] == 1 << 30
    # the op receives it, and the head's TP agreement covers it
    seen = {}
    monkeypatch.setattr(fusedloss, "linear_cross_entropy", lambda *a, **kw: seen.update(kw) or torch.zeros(4, 2))
    model = SimpleNamespace(output_layer=SimpleNamespace(weight=torch.randn(16, 8), tp_group=None, sequence_parallel=False,
                                                         _forward_pre_hooks={}),
                            share_embeddings_and_output_weights=False, mtp_process=False)
    monkeypatch.setattr(lm_head, "_refuse_unsupported", lambda model: None)
    lm_head.fused_head_loss(model, torch.randn(4, 2, 8), torch.randint(0, 16, (2, 4)))
    assert seen["workspace_bytes"] == 1 << 30
    h, w, labels = torch.randn(4, 2, 8), torch.randn(16, 8), torch.randint(0, 16, (2, 4))
    assert "workspace_bytes=1073741824" in lm_head._fingerprint(state.lce_options(), h, w, labels, None, True).pairs
    # ranks that leave it to the default and ranks that pass the default agree
    prints = []
    for workspace in (None, 256 << 20):
        apply_fusedloss_to_megatron(linear_cross_entropy=True, linear_cross_entropy_workspace_bytes=workspace)
        prints.append(lm_head._fingerprint(state.lce_options(), h, w, labels, None, True))
    assert prints[0] == prints[1]
    apply_fusedloss_to_megatron(linear_cross_entropy=True, linear_cross_entropy_workspace_bytes=1 << 30)
    with fusedloss_megatron(linear_cross_entropy=True):
        assert state.lce_options()["workspace_bytes"] == 256 << 20  # the op's default, resolved
    assert state.lce_options()["workspace_bytes"] == 1 << 30
    unpatch_megatron()


def test_auto_reads_the_device_check_once(monkeypatch, device):
    # linear_cross_entropy_backward="auto" on CUDA: the device's verdict on the loss function is
    # read at the first backward after the patch, once (the CPU backward raises by itself)
    from fusedloss.megatron import lm_head, state
    calls = []
    monkeypatch.setattr(fusedloss, "check_device_errors", lambda dev=None: calls.append(dev))

    def step():
        h = torch.randn(3, 4, device=device, requires_grad=True)
        y = h * 2
        lm_head._check_loss_function_once(y)
        y.sum().backward()

    apply_fusedloss_to_megatron(linear_cross_entropy=True, linear_cross_entropy_backward="auto")
    for _ in range(2):
        step()
    assert len(calls) == (1 if device == "cuda" else 0)
    apply_fusedloss_to_megatron(linear_cross_entropy=True, linear_cross_entropy_backward="auto")
    assert not state.CONFIG.get("loss_function_checked")  # a new patch reads it again
    # a backward captured into a CUDA graph cannot sync: the next one outside a capture reads it
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    calls.clear()
    step()
    assert calls == []
    capturing[0] = False
    step()
    step()
    assert len(calls) == (1 if device == "cuda" else 0)


def test_head_agreement_covers_autocast():
    # the op casts hidden and weight to torch.autocast's dtype, which sets its chunking: ranks
    # whose autocast differs must not pass the head's agreement (it runs the op unchecked)
    from fusedloss.megatron import lm_head, state
    apply_fusedloss_to_megatron(linear_cross_entropy=True)
    h, w, labels = torch.randn(4, 2, 8), torch.randn(16, 8), torch.randint(0, 16, (2, 4))
    args = (state.lce_options(), h, w, labels, None, True)
    plain = lm_head._fingerprint(*args)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = lm_head._fingerprint(*args)
    assert plain != cast and "autocast='torch.bfloat16'" in cast.pairs
    unpatch_megatron()
