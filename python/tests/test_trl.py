"""fusedloss.trl: one step of TRL's GRPOTrainer on a tiny random Qwen2 on the CPU (rollout,
rewards, the reference model's log-probs, the clipped loss with the KL penalty and the entropy
bonus, backward) in fp32 gives the same loss and every parameter's gradient with and without
the patch, and the patched step's log-probs and entropy come from fusedloss.linear_log_probs.
Network-free: the model is built from a config and saved to a temporary folder (TRL loads the
reference model from the policy's path), the tokenizer is a word-level one made here. Also: the
kernel calls the patch takes, and those it hands back to TRL's own kernel, against float64."""
import pytest
import torch

trl = pytest.importorskip("trl", reason="trl is not installed (launch/python.sh installs it)")
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, TrainerCallback

import fusedloss.trl
from fusedloss.linear_log_probs import linear_log_probs

_V = 96


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"t{i}": i for i in range(_V - 2)}
    vocab.update({"<pad>": _V - 2, "<eos>": _V - 1})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    config = Qwen2Config(vocab_size=_V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(7)
    path = str(tmp_path_factory.mktemp("qwen2"))
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


class _Gradients(TrainerCallback):
    """Every parameter's gradient just before the optimizer step."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                      if p.grad is not None}


def _grpo_step(model_path, tmp_path):
    """(loss, {name: gradient}) of one GRPO step."""
    from datasets import Dataset
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", seed=11,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=6, max_steps=1,
        beta=0.04, entropy_coef=0.05, temperature=0.7, max_grad_norm=0.0, logging_steps=1,
        learning_rate=1e-3, bf16=False)  # fp32: the two heads differ by rounding alone
    prompts = Dataset.from_dict({"prompt": ["t1 t2 t3", "t4 t5", "t6", "t7 t8 t9 t10"]})
    gradients = _Gradients()
    trainer = trl.GRPOTrainer(
        model=model_path, args=args, train_dataset=prompts, processing_class=_tokenizer(),
        reward_funcs=lambda completions, **kw: [float(len(c) % 5) for c in completions],
        callbacks=[gradients])
    losses = []
    compute_loss = trainer.compute_loss

    def recorded(*a, **k):
        loss = compute_loss(*a, **k)
        losses.append(loss.detach().clone())
        return loss
    trainer.compute_loss = recorded
    trainer.train()
    assert len(losses) == 1
    return losses[0], gradients.grads


def test_one_grpo_step_equals_the_unpatched_trainer(model_path, tmp_path, monkeypatch):
    calls = []

    def counted(hidden, weight, tokens, **kw):
        calls.append(kw)
        return linear_log_probs(hidden, weight, tokens, **kw)
    monkeypatch.setattr(fusedloss.trl, "linear_log_probs", counted)

    fusedloss.trl.unpatch_trl()
    loss_trl, grads_trl = _grpo_step(model_path, tmp_path / "trl")
    assert not calls
    fusedloss.trl.apply_fusedloss_to_trl()
    try:
        assert fusedloss.trl.is_patched()
        loss_fl, grads_fl = _grpo_step(model_path, tmp_path / "fusedloss")
    finally:
        fusedloss.trl.unpatch_trl()
    assert not fusedloss.trl.is_patched()
    # the reference model (log-probs alone) and the policy (log-probs and entropy, with gradient)
    assert {c["entropy"] for c in calls} == {False, True}
    assert all(c["temperature"] == pytest.approx(0.7) for c in calls)
    torch.testing.assert_close(loss_fl, loss_trl, rtol=1e-5, atol=1e-6)
    assert grads_fl.keys() == grads_trl.keys() and len(grads_trl) > 20
    for name, g in grads_trl.items():
        err = (grads_fl[name] - g).norm() / g.norm().clamp(min=1e-12)
        assert err <= 1e-5, f"{name}: relative gradient difference {err:.2e}"


def _kernel_call(dtype, bias=False, softcap=None, logit_scale=1.0, outputs=("log_probs", "entropy")):
    h = torch.randn(23, 16, dtype=dtype, requires_grad=True)
    w = (torch.randn(50, 16) * 0.5).to(dtype).requires_grad_()
    b = torch.randn(50, dtype=dtype) if bias else None
    t = torch.randint(0, 50, (23,))
    return h, w, b, t, 0.8, 4096, softcap, logit_scale, outputs


def _float64(h, w, b, t, temperature, softcap, logit_scale):
    z = (h.double() @ w.double().t() + (0 if b is None else b.double())) * logit_scale
    z = z if softcap is None else softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z / temperature, -1)
    return logp.gather(1, t[:, None])[:, 0], -(logp.exp() * logp).sum(-1), z.argmax(-1) == t


@pytest.mark.parametrize("case", [
    dict(), dict(logit_scale=0.25), dict(outputs=("log_probs", "entropy", "is_top1")),
    dict(bias=True), dict(softcap=3.0), dict(outputs=("log_probs", "mean_logits"))])
def test_the_kernel_call_against_float64(case, monkeypatch):
    """What linear_log_probs takes (a logit scale folds into the temperature, is_top1 from the
    arg-max) and what goes back to TRL's kernel (a bias, a soft cap, other outputs) give TRL's
    results."""
    calls = []

    def counted(*a, **kw):
        calls.append(kw)
        return linear_log_probs(*a, **kw)
    monkeypatch.setattr(fusedloss.trl, "linear_log_probs", counted)
    import trl.trainer.utils as utils
    kernel = fusedloss.trl.FusedLossLogProbs(utils._ChunkedLogProbFunction)
    h, w, b, t, temperature, chunk, softcap, scale, outputs = _kernel_call(torch.float32, **case)
    lp, ent, _, _, top1 = kernel.apply(h, w, b, t, temperature, chunk, softcap, scale, outputs)
    assert bool(calls) == (not case.get("bias") and softcap is None and "mean_logits" not in outputs)
    lp64, ent64, top1_64 = _float64(h, w, b, t, temperature, softcap, scale)
    torch.testing.assert_close(lp.double(), lp64, rtol=1e-5, atol=1e-5)
    if "entropy" in outputs:
        torch.testing.assert_close(ent.double(), ent64, rtol=1e-5, atol=1e-5)
    else:
        assert ent is None
    if "is_top1" in outputs:
        assert torch.equal(top1, top1_64)
    c = 1.0 if "entropy" in outputs else 0.0
    a = torch.randn(t.shape)
    (a * lp + (c * ent if c else 0)).sum().backward()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    lp64, ent64, _ = _float64(h64, w64, b, t, temperature, softcap, scale)
    (a.double() * lp64 + c * ent64).sum().backward()
    for mine, want in ((h.grad, h64.grad), (w.grad, w64.grad)):
        assert ((mine.double() - want).norm() / want.norm()).item() <= 1e-4


def test_autocast_and_a_weight_of_another_dtype():
    """Under autocast the GEMMs run in its dtype; outside it a weight of another dtype runs in
    hidden's dtype, as in TRL's kernel."""
    import trl.trainer.utils as utils
    kernel = fusedloss.trl.FusedLossLogProbs(utils._ChunkedLogProbFunction)
    h, w, b, t, temperature, chunk, softcap, scale, outputs = _kernel_call(torch.float32)
    lp64, ent64, _ = _float64(h, w, b, t, temperature, softcap, scale)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent, *_ = kernel.apply(h, w, b, t, temperature, chunk, softcap, scale, outputs)
    torch.testing.assert_close(lp.double(), lp64, rtol=3e-2, atol=3e-2)
    lp, ent, *_ = kernel.apply(h, w.detach().double(), b, t, temperature, chunk, softcap, scale,
                               outputs)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(ent.double(), ent64, rtol=1e-5, atol=1e-5)


def test_patch_is_idempotent_and_checks_trls_kernel(monkeypatch):
    import trl.trainer.utils as utils
    original = utils._ChunkedLogProbFunction
    try:
        fusedloss.trl.apply_fusedloss_to_trl()
        fusedloss.trl.apply_fusedloss_to_trl()
        assert utils._ChunkedLogProbFunction.original is original
    finally:
        fusedloss.trl.unpatch_trl()
    assert utils._ChunkedLogProbFunction is original

    class Changed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, targets, temperature):
            return hidden

    monkeypatch.setattr(utils, "_ChunkedLogProbFunction", Changed)
    with pytest.raises(RuntimeError, match=r"kernel takes \['ctx', 'hidden', 'weight', "
                                           r"'targets', 'temperature'\], expected"):
        fusedloss.trl.apply_fusedloss_to_trl()
