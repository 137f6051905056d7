"""The Megatron-core patch against the real megatron-core (CPU, gloo worlds)."""
import importlib
import warnings

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

import fusedloss  # noqa: E402
from fusedloss.megatron import apply_fusedloss_to_megatron, fusedloss_megatron, unpatch_megatron  # noqa: E402
from dist_util import run_world  # noqa: E402

PATCHED = [("megatron.core.fusions.fused_cross_entropy", "_VocabParallelCrossEntropy"),
           ("megatron.core.tensor_parallel.cross_entropy", "_VocabParallelCrossEntropy"),
           ("megatron.core.fusions.fused_bias_swiglu", "SwiGLUFunction"),
           ("megatron.core.fusions.fused_bias_swiglu", "BiasSwiGLUFunction"),
           ("megatron.core.fusions.fused_bias_swiglu", "WeightedSwiGLUFunction")]


def _objects():
    return {(m, a): getattr(importlib.import_module(m), a) for m, a in PATCHED}


@pytest.fixture(autouse=True)
def _clean():
    yield
    unpatch_megatron()


def test_patch_replaces_every_symbol_idempotently_and_unpatch_restores():
    before = _objects()
    apply_fusedloss_to_megatron()
    after = _objects()
    assert all(after[k] is not before[k] for k in before)
    assert all(after[k].__fusedloss_original__ is before[k] for k in before)
    apply_fusedloss_to_megatron()  # again: no stacking
    assert all(_objects()[k].__fusedloss_original__ is before[k] for k in before)
    unpatch_megatron()
    assert all(_objects()[k] is before[k] for k in before)
    with fusedloss_megatron(swiglu=False):
        assert _objects()[PATCHED[0]] is not before[PATCHED[0]]
        assert _objects()[PATCHED[2]] is before[PATCHED[2]]
    assert all(_objects()[k] is before[k] for k in before)


def test_a_later_apply_sets_exactly_what_it_asks_and_blocks_nest():
    before = _objects()
    apply_fusedloss_to_megatron()
    apply_fusedloss_to_megatron(cross_entropy=False)  # the cross-entropy goes back to Megatron's
    assert _objects()[PATCHED[0]] is before[PATCHED[0]]
    assert _objects()[PATCHED[2]] is not before[PATCHED[2]]
    apply_fusedloss_to_megatron()
    with fusedloss_megatron(swiglu=False):
        with fusedloss_megatron(cross_entropy=False):
            assert _objects()[PATCHED[0]] is before[PATCHED[0]]
            assert _objects()[PATCHED[2]] is not before[PATCHED[2]]
        # the enclosing block's patch again, not none
        assert _objects()[PATCHED[0]] is not before[PATCHED[0]]
        assert _objects()[PATCHED[2]] is before[PATCHED[2]]
    assert all(_objects()[k] is not before[k] for k in before)  # the explicit patch stays
    with pytest.raises(TypeError, match="inplace_backward: got 'no'"):
        apply_fusedloss_to_megatron(inplace_backward="no")


def test_unsupported_megatron_fails_clearly_and_patches_nothing(monkeypatch):
    from megatron.core.fusions import fused_bias_swiglu
    before = _objects()
    monkeypatch.delattr(fused_bias_swiglu, "WeightedSwiGLUFunction")
    with pytest.raises(RuntimeError, match=r"fused_bias_swiglu\.WeightedSwiGLUFunction not found in "
                                           r"megatron-core [0-9.]+"):
        apply_fusedloss_to_megatron()
    monkeypatch.undo()
    assert _objects() == before  # all or nothing: the cross-entropy was not patched either

    class Renamed(torch.autograd.Function):  # a forward whose parameters moved on
        @staticmethod
        def forward(ctx, x, bias, fp8_input_store, cpu_offload_input):
            return x
    monkeypatch.setattr(fused_bias_swiglu, "BiasSwiGLUFunction", Renamed)
    with pytest.raises(RuntimeError, match=r"BiasSwiGLUFunction\.forward has no parameter input"):
        apply_fusedloss_to_megatron(cross_entropy=False)
    assert not fusedloss.megatron.is_patched()


def test_consumers_that_imported_by_name_see_the_patch():
    from megatron.core.models.common.language_module import language_module
    from megatron.core.transformer import mlp
    apply_fusedloss_to_megatron()
    x = torch.randn(4, 2, 64, requires_grad=True)
    t = torch.randint(0, 64, (4, 2))
    loss = language_module.fused_vocab_parallel_cross_entropy(x, t, None)  # imported by name
    ref = torch.nn.functional.cross_entropy(x.detach().double().view(-1, 64), t.view(-1), reduction="none")
    torch.testing.assert_close(loss.double().view(-1), ref, rtol=2e-5, atol=1e-6)
    y = torch.randn(3, 2, 32)
    out = mlp.bias_swiglu_impl(y, None)
    a, b = y.chunk(2, -1)
    torch.testing.assert_close(out, torch.nn.functional.silu(a) * b, rtol=1e-5, atol=1e-6)


def _tp1_parity(rank, world, device):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.fusions import fused_bias_swiglu as fbs
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tp = parallel_state.get_tensor_model_parallel_group()
    torch.manual_seed(0)
    x = (torch.randn(8, 2, 300) * 2).to(device)
    t = torch.randint(0, 300, (8, 2)).to(device)

    def run(fn):
        v = x.clone().requires_grad_(True)
        loss = fn(v * 1)  # non-leaf: the patched path writes the gradient in place
        loss.backward(torch.linspace(0.5, 1.5, loss.numel(), device=loss.device).view_as(loss))
        return loss.detach(), v.grad

    for ls in (0.0, 0.1):
        ref = run(lambda v: tensor_parallel.vocab_parallel_cross_entropy(v, t, label_smoothing=ls))
        apply_fusedloss_to_megatron()
        ours = run(lambda v: tensor_parallel.vocab_parallel_cross_entropy(v, t, label_smoothing=ls))
        unpatch_megatron()
        torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours[1], ref[1], rtol=1e-5, atol=1e-6)
    ref = run(lambda v: fused_vocab_parallel_cross_entropy(v, t, tp))
    apply_fusedloss_to_megatron()
    ours = run(lambda v: fused_vocab_parallel_cross_entropy(v, t, tp))
    unpatch_megatron()
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-5)
    # Megatron's fused backward rounds its gradient to bf16 whatever the logits' dtype
    torch.testing.assert_close(ours[1], ref[1], rtol=8e-3, atol=1e-4)
    # SwiGLU: plain, bias, weighted
    y = torch.randn(6, 2, 64, device=device)
    bias = torch.randn(64, device=device) * 0.1
    w = torch.rand(12, 1, device=device)
    for call in (lambda v, b, ww: fbs.bias_swiglu_impl(v, None),
                 lambda v, b, ww: fbs.bias_swiglu_impl(v, b),
                 lambda v, b, ww: fbs.weighted_bias_swiglu_impl(v.view(12, 64), None, ww)):
        def grads(patched):
            if patched:
                apply_fusedloss_to_megatron()
            v, b, ww = (y.clone().requires_grad_(True), bias.clone().requires_grad_(True),
                        w.clone().requires_grad_(True))
            out = call(v, b, ww)
            out.backward(torch.ones_like(out))
            unpatch_megatron()
            return out.detach(), v.grad, b.grad, ww.grad
        for got, want in zip(grads(True), grads(False)):
            if want is None:
                assert got is None
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # MoE router probabilities as Megatron passes them: a bf16 column slice of [T, k]
    probs = torch.rand(12, 4, device=device).to(torch.bfloat16)

    def weighted(patched):
        if patched:
            apply_fusedloss_to_megatron()
        v, p = y.clone().view(12, 64).requires_grad_(True), probs.clone().requires_grad_(True)
        out = fbs.weighted_bias_swiglu_impl(v, None, p[:, :1])
        out.backward(torch.ones_like(out))
        unpatch_megatron()
        return out.detach(), v.grad, p.grad
    for got, want in zip(weighted(True), weighted(False)):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def _run_tp1(fn):
    """fn(rank, world, device) in a one-process world: on the GPU when there is one (Megatron's
    fused paths are torch.compile'd for CUDA), else on the CPU."""
    if torch.cuda.is_available():
        run_world(1, fn, "cuda", backend="nccl")
    else:
        run_world(1, fn, "cpu")


def test_tp1_parity_with_megatron_functions():
    _run_tp1(_tp1_parity)


def _mlp_parity(rank, world, device):
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    cfg = TransformerConfig(num_layers=1, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                            use_cpu_initialization=True, gated_linear_unit=True, activation_func=F.silu,
                            bias_activation_fusion=True, add_bias_linear=False)
    torch.manual_seed(0)
    mlp = MLP(cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)).to(device)
    x = torch.randn(5, 2, 64, device=device)

    def step():
        for p in mlp.parameters():
            p.grad = None
        v = x.clone().requires_grad_(True)
        out, _ = mlp(v)
        out.square().sum().backward()
        return [out.detach(), v.grad] + [p.grad.clone() for p in mlp.parameters()]

    ref = step()
    apply_fusedloss_to_megatron()
    ours = step()
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_megatron_mlp_forward_backward_with_and_without_patch():
    _run_tp1(_mlp_parity)


def _guard_patch_time(rank, world):
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    with pytest.raises(RuntimeError, match="allow_vocab_parallel=True"):
        apply_fusedloss_to_megatron()
    apply_fusedloss_to_megatron(cross_entropy=False)  # SwiGLU alone is fine at TP>1
    unpatch_megatron()


def _guard_call_time(rank, world):
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    apply_fusedloss_to_megatron()  # before parallel state exists: allowed
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tp = parallel_state.get_tensor_model_parallel_group()
    with pytest.raises(RuntimeError, match="allow_vocab_parallel=True"):
        fused_vocab_parallel_cross_entropy(torch.randn(4, 1, 32), torch.randint(0, 64, (4, 1)), tp)
    # the same under torch.compile (the refusal's agreement is never traced)
    compiled = torch.compile(lambda logits, t: fused_vocab_parallel_cross_entropy(logits, t, tp))
    with pytest.raises(RuntimeError, match="vocab-parallel rank 0: .*allow_vocab_parallel=True"):
        compiled(torch.randn(4, 1, 32), torch.randint(0, 64, (4, 1)))
    unpatch_megatron()


def _guard_on_one_rank(rank, world):
    # rank 1 allows vocab-parallel, rank 0 does not (patched before the parallel state, so the
    # patch could not refuse): rank 0's refusal reaches rank 1, which waits in the op's
    # agreement, and both raise it, rather than one raising while the other waits
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    apply_fusedloss_to_megatron(allow_vocab_parallel=rank == 1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tp = parallel_state.get_tensor_model_parallel_group()
    with pytest.raises((RuntimeError, ValueError), match=r"vocab-parallel rank 0: fused vocab_parallel_"
                       r"cross_entropy was called with a tensor-parallel group of size 2\. .*"
                       r"allow_vocab_parallel=True"):
        fused_vocab_parallel_cross_entropy(torch.randn(4, 1, 32), torch.randint(0, 64, (4, 1)), tp)
    unpatch_megatron()


def test_tp2_guard_on_one_rank_raises_on_both():
    run_world(2, _guard_on_one_rank, timeout_s=30)


def _vocab_parallel_matches_megatron(rank, world):
    from megatron.core import parallel_state, tensor_parallel
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    g = torch.Generator().manual_seed(7)
    V = 128 * world
    full = torch.randn(6, 2, V, generator=g) * 2
    t = torch.randint(0, V, (6, 2), generator=g)
    shard = full[..., rank * 128:(rank + 1) * 128]

    def run():
        v = shard.clone().requires_grad_(True)
        loss = tensor_parallel.vocab_parallel_cross_entropy(v * 1, t)
        loss.backward(torch.ones_like(loss))
        return loss.detach(), v.grad

    ref = run()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_fusedloss_to_megatron(allow_vocab_parallel=True)
        ours = run()
    assert any("experimental" in str(w.message) for w in caught)
    unpatch_megatron()
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-5, atol=1e-6)


def test_tp2_guard_at_patch_time():
    run_world(2, _guard_patch_time)


def test_tp2_guard_at_call_time():
    run_world(2, _guard_call_time)


def test_tp2_allow_vocab_parallel_matches_megatron():
    run_world(2, _vocab_parallel_matches_megatron)


def test_mode2_language_model_loss_and_swiglu_module():
    from fusedloss.megatron import FusedLossSwiGLU, fused_language_model_loss
    logits = torch.randn(16, 3, 200)  # [s, b, V]
    labels = torch.randint(0, 200, (3, 16))  # [b, s]
    loss = fused_language_model_loss(labels, logits, inplace_backward=False)
    assert loss.shape == (3, 16) and loss.dtype == torch.float32
    ref = torch.nn.functional.cross_entropy(logits.double().permute(1, 2, 0), labels, reduction="none")
    torch.testing.assert_close(loss.double(), ref, rtol=2e-5, atol=1e-6)
    y = torch.randn(4, 2, 64)
    a, b = y.chunk(2, -1)
    torch.testing.assert_close(FusedLossSwiGLU(clamp_value=1.0)(y),
                               torch.nn.functional.silu(a.clamp(max=1.0)) * b.clamp(-1.0, 1.0))


def test_stand_in_binds_by_name_and_tells_omitted_from_default():
    from megatron.core.tensor_parallel import cross_entropy as unfused
    apply_fusedloss_to_megatron(label_smoothing=0.1)
    x = torch.randn(4, 2, 32)
    t = torch.randint(0, 32, (4, 2))
    omitted = unfused._VocabParallelCrossEntropy.apply(x.clone(), t)  # the patch's smoothing
    torch.testing.assert_close(omitted, unfused._VocabParallelCrossEntropy.apply(x.clone(), t, 0.1))
    # 0.0 is what Megatron's own wrapper passes on when its caller (GPT's loss) passes nothing:
    # the patch's smoothing, as on the fused route and the linear head
    torch.testing.assert_close(omitted, unfused.vocab_parallel_cross_entropy(x.clone(), t))
    torch.testing.assert_close(omitted, unfused._VocabParallelCrossEntropy.apply(x.clone(), t, 0.0))
    assert not torch.equal(omitted, unfused._VocabParallelCrossEntropy.apply(x.clone(), t, 0.3))
    with pytest.raises(TypeError, match=r"missing \['target'\]"):
        unfused._VocabParallelCrossEntropy.apply(x.clone())
    with pytest.raises(TypeError, match="takes"):
        unfused._VocabParallelCrossEntropy.apply(x, t, 0.0, None, None, None)
