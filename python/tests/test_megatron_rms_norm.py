"""apply_fusedloss_to_megatron(rms_norm=True) against the real megatron-core (CPU, gloo): a GPT
model from the local spec with normalization="RMSNorm", patched vs unpatched (outputs and every
gradient), zero-centred gamma, and TP=2 with sequence parallelism against the unpatched TP=2
model (the norm weights' gradients after Megatron's sequence-parallel all-reduce)."""
import inspect
import types

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

import fusedloss  # noqa: E402
from fusedloss.megatron import FusedLossRMSNorm, apply_fusedloss_to_megatron, unpatch_megatron  # noqa: E402
from dist_util import run_world  # noqa: E402

S, B, H = 8, 2, 64


def _config(tp=1, sequence_parallel=False, zero_centered=False):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(num_layers=2, hidden_size=H, ffn_hidden_size=96, num_attention_heads=4,
                             use_cpu_initialization=True, normalization="RMSNorm", layernorm_epsilon=1e-6,
                             gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                             bias_activation_fusion=False, tensor_model_parallel_size=tp,
                             sequence_parallel=sequence_parallel,
                             layernorm_zero_centered_gamma=zero_centered, qk_layernorm=True)


def _spec_norms(cfg):
    """Every norm the GPT local spec and the transformer block build for normalization="RMSNorm"
    (input, pre-MLP, q and k norms of a layer; the block's final norm), built through Megatron's
    own build_module, as the model does. (Attention itself needs CUDA in this megatron-core, so
    the norms are built and run on their own here.)"""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, _get_block_submodules
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True)
    sub = spec.submodules
    attn = sub.self_attention.submodules
    block = _get_block_submodules(cfg, spec)
    specs = [sub.input_layernorm, sub.pre_mlp_layernorm, block.layer_norm]
    built = [build_module(s, config=cfg, hidden_size=H, eps=cfg.layernorm_epsilon) for s in specs]
    built += [build_module(s, hidden_size=16, config=cfg, eps=cfg.layernorm_epsilon)
              for s in (attn.q_layernorm, attn.k_layernorm)]
    return built


def _run_norms(norms, gen_seed=1):
    g = torch.Generator().manual_seed(gen_seed)
    outs, grads = [], []
    for m in norms:
        hidden = m.weight.numel()
        x = (torch.randn(S, B, hidden, generator=g) * 2).requires_grad_(True)
        m.weight.grad = None
        y = m(x)
        (y * torch.randn(y.shape, generator=g)).sum().backward()
        outs.append(y.detach())
        grads += [x.grad, m.weight.grad.clone()]
    return outs, grads


def _tp1(rank, world, zero_centered):
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    ref_norms = _spec_norms(_config())
    assert all(type(m) is torch.nn.RMSNorm for m in ref_norms)
    with torch.no_grad():
        for m in ref_norms:
            m.weight.uniform_(0.5, 1.5)
    ref = _run_norms(ref_norms)
    apply_fusedloss_to_megatron(cross_entropy=False, swiglu=False)
    norms = _spec_norms(_config(zero_centered=zero_centered))
    assert all(type(m) is FusedLossRMSNorm for m in norms)
    assert all(m.eps == 1e-6 and m.zero_centered_gamma == zero_centered for m in norms)
    with torch.no_grad():
        for m, r in zip(norms, ref_norms):
            assert torch.equal(m.weight, torch.zeros_like(m.weight) if zero_centered else torch.ones_like(m.weight))
            m.weight.copy_(r.weight - 1 if zero_centered else r.weight)  # zero-centred: gamma - 1
    ours = _run_norms(norms)
    for got, want in zip(ours[0] + ours[1], ref[0] + ref[1]):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    unpatch_megatron()
    assert all(type(m) is torch.nn.RMSNorm for m in _spec_norms(_config()))


@pytest.mark.parametrize("zero_centered", [False, True])
def test_local_spec_rms_norms_patched_match_unpatched(zero_centered):
    run_world(1, _tp1, zero_centered)


def _pre_mlp_norm(cfg):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    return build_module(spec.submodules.pre_mlp_layernorm, config=cfg, hidden_size=H,
                        eps=cfg.layernorm_epsilon)


def _tp2_sequence_parallel(rank, world):
    # (Megatron's sequence-parallel linears allocate their gather buffers on CUDA, so the norm
    # runs on its own here: each rank normalises its slice of the tokens, as under SP.)
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(S, B, H, generator=g) * 2
    gy = torch.randn(S, B, H, generator=g)
    # The unpatched local spec cannot run sequence parallel (WrappedTorchNorm refuses it): the
    # reference is the same TP=2 norm without it, every rank seeing every token.
    ref = _pre_mlp_norm(_config(tp=2))
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
    xr = x.clone().requires_grad_(True)
    ref_out = ref(xr)
    ref_out.backward(gy)
    apply_fusedloss_to_megatron(cross_entropy=False, swiglu=False)
    cfg = _config(tp=2, sequence_parallel=True)
    block = torch.nn.Module()
    block.norm = _pre_mlp_norm(cfg)
    assert type(block.norm) is FusedLossRMSNorm and block.norm.weight.sequence_parallel is True
    block.norm.load_state_dict(ref.state_dict(), strict=True)
    rows = slice(rank * S // 2, (rank + 1) * S // 2)  # this rank's tokens under sequence parallel
    xs = x[rows].clone().requires_grad_(True)
    out = block.norm(xs)
    out.backward(gy[rows])
    torch.testing.assert_close(out, ref_out[rows].detach(), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(xs.grad, xr.grad[rows], rtol=2e-5, atol=2e-5)
    partial = block.norm.weight.grad.clone()  # this rank's tokens only
    assert not torch.allclose(partial, ref.weight.grad, rtol=1e-3, atol=1e-5)
    # Megatron's own all-reduce of sequence-parallel parameters' gradients (finalize_model_grads)
    block.ddp_config = types.SimpleNamespace(use_megatron_fsdp=False)
    _allreduce_non_tensor_model_parallel_grads([block], cfg)
    torch.testing.assert_close(block.norm.weight.grad, ref.weight.grad, rtol=2e-5, atol=2e-5)
    unpatch_megatron()


def test_tp2_sequence_parallel_matches_unpatched():
    run_world(2, _tp2_sequence_parallel)


def test_patch_and_unpatch_restore_the_norm_exactly():
    from megatron.core.transformer import torch_norm
    raw = inspect.getattr_static(torch_norm.WrappedTorchNorm, "__new__")
    apply_fusedloss_to_megatron()
    apply_fusedloss_to_megatron()  # idempotent: the original is kept once
    patched = inspect.getattr_static(torch_norm.WrappedTorchNorm, "__new__")
    assert patched is not raw and patched.__func__.__fusedloss_original__ is raw
    unpatch_megatron()
    assert inspect.getattr_static(torch_norm.WrappedTorchNorm, "__new__") is raw
    apply_fusedloss_to_megatron(rms_norm=False)
    assert inspect.getattr_static(torch_norm.WrappedTorchNorm, "__new__") is raw
    unpatch_megatron()


def test_layer_norm_and_spec_providers_still_get_megatron_modules():
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig
    apply_fusedloss_to_megatron()
    try:
        cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, normalization="LayerNorm")
        assert type(WrappedTorchNorm(cfg, H)) is torch.nn.LayerNorm
        cfg.normalization = "RMSNorm"
        norm_cls = LocalSpecProvider().layer_norm(rms_norm=True)
        built = norm_cls(config=cfg, hidden_size=H, eps=1e-6)
        assert type(built) is FusedLossRMSNorm and built.eps == 1e-6
    finally:
        unpatch_megatron()


def test_patch_log_names_what_is_left_alone(caplog):
    import logging
    with caplog.at_level(logging.INFO, logger="fusedloss.megatron"):
        apply_fusedloss_to_megatron()
    unpatch_megatron()
    assert "TransformerEngine" in caplog.text and "left as it is" in caplog.text
