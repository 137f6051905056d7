"""fusedloss.huggingface on tiny random-weight transformers models of every family: the patched
model's training loss and every parameter's gradient against the unpatched model's (fp32), the
modules each swap takes, evaluation and label-free calls untouched, and the class-level patch in
a fresh process."""
import copy
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
from fusedloss import huggingface  # noqa: E402

_TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _config(family):
    if family == "llama":
        return transformers.LlamaConfig(**_TINY)
    if family == "mistral":
        return transformers.MistralConfig(**_TINY, sliding_window=None)
    if family == "qwen2":
        return transformers.Qwen2Config(**_TINY)
    if family == "qwen3":
        return transformers.Qwen3Config(**_TINY, head_dim=8)
    if family == "gemma2":
        return transformers.Gemma2Config(**_TINY, head_dim=8, final_logit_softcapping=5.0,
                                         hidden_activation="gelu_pytorch_tanh")
    if family == "gemma3":
        return transformers.Gemma3TextConfig(**_TINY, head_dim=8, final_logit_softcapping=5.0)
    raise AssertionError(family)


def _model(family):
    cfg = _config(family)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # non-trivial norm weights (Gemma's start at zero)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.train()


def _step(model, ids, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_patched_model_matches_the_model(family):
    torch.manual_seed(0)
    model = _model(family)
    patched = copy.deepcopy(model)
    counts = huggingface.apply_fusedloss(patched)
    layers = _TINY["num_hidden_layers"]
    # input and post-attention norms; Gemma pre- and post-feedforward ones; q and k norms
    norms_per_layer = {"gemma2": 4, "gemma3": 4 + 2, "qwen3": 2 + 2}.get(family, 2)
    assert counts["rms_norm"] == layers * norms_per_layer + 1, counts
    assert counts["swiglu"] == (0 if family.startswith("gemma") else layers), counts
    assert counts["linear_cross_entropy"] == 1
    ids = torch.randint(0, _TINY["vocab_size"], (3, 17))
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt
    want, want_grads = _step(model, ids, labels)
    got, got_grads = _step(patched, ids, labels)
    assert got.logits is None  # no [tokens, V] logits in training
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert set(got_grads) == set(want_grads)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{family} {name}: {m}")
    # gradient accumulation: the sum over num_items_in_batch, as transformers' loss
    n = torch.tensor(int((labels[:, 1:] != -100).sum()) + 3)
    want, _ = _step(model, ids, labels, num_items_in_batch=n)
    got, _ = _step(patched, ids, labels, num_items_in_batch=n)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    # evaluation and calls without labels: the model's own forward, logits included
    patched.eval()
    model.eval()
    with torch.no_grad():
        a, b = patched(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)


def test_other_models_are_refused_by_name():
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2,
                                                                 vocab_size=50))
    with pytest.raises(ValueError, match=r"model: got a GPT2LMHeadModel \(model_type='gpt2'\)"):
        huggingface.apply_fusedloss(model)


def test_class_level_patch_in_a_fresh_process():
    code = (
        "import torch, copy, transformers\n"
        "from fusedloss import huggingface\n"
        "torch.manual_seed(0)\n"
        "cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,"
        " num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)\n"
        "cfg._attn_implementation = 'eager'\n"
        "ref = transformers.AutoModelForCausalLM.from_config(cfg).train()\n"
        "state = copy.deepcopy(ref.state_dict())\n"
        "ids = torch.randint(0, 64, (2, 9))\n"
        "want = ref(input_ids=ids, labels=ids).loss\n"
        "huggingface.apply_fusedloss_to_llama()\n"
        "model = transformers.AutoModelForCausalLM.from_config(cfg).train()\n"
        "model.load_state_dict(state)\n"
        "out = model(input_ids=ids, labels=ids)\n"
        "assert out.logits is None, 'logits were computed'\n"
        "torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-6)\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr
