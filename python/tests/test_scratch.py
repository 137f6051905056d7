"""fusedloss.set_scratch_allocator: where the CUDA kernels take the memory a call needs only
while it runs. "torch" (the default where the C++ nodes load): torch's caching allocator,
counted in torch's statistics; "cuda": cudaMallocAsync."""
import os
import subprocess
import sys

import pytest
import torch

import fusedloss
from test_linear_cross_entropy import _problem

_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA backend: no CUDA device in this process")


_DEFAULT = fusedloss._native.scratch  # as this process's import set it


@pytest.fixture
def restore_default():
    yield
    fusedloss.set_scratch_allocator(_DEFAULT)


def test_names_its_choices(restore_default):
    with pytest.raises(ValueError, match=r"source: got 'cudaMallocAsync', expected 'torch' .* or 'cuda'"):
        fusedloss.set_scratch_allocator("cudaMallocAsync")
    if fusedloss._native.ops is None:
        with pytest.raises(RuntimeError, match="needs the C++ nodes' library"):
            fusedloss.set_scratch_allocator("torch")
    else:
        fusedloss.set_scratch_allocator("torch")
    fusedloss.set_scratch_allocator("cuda")


def _import_with(env):
    return subprocess.run([sys.executable, "-c", "import fusedloss; print(fusedloss._native.scratch)"],
                          capture_output=True, text=True, env={**os.environ, **env})


def test_the_environment_sets_it_at_import():
    run = _import_with({"FUSEDLOSS_SCRATCH": ""})  # unset: torch's wherever the C++ nodes load
    assert run.returncode == 0 and run.stdout.split()[-1] == ("torch" if fusedloss._native.ops else "cuda")
    run = _import_with({"FUSEDLOSS_SCRATCH": "cuda"})
    assert run.returncode == 0 and run.stdout.split()[-1] == "cuda"
    run = _import_with({"FUSEDLOSS_SCRATCH": "", "FUSEDLOSS_NATIVE_NODES": "0"})
    assert run.returncode == 0 and run.stdout.split()[-1] == "cuda" and "FUSEDLOSS_SCRATCH" not in run.stderr
    run = _import_with({"FUSEDLOSS_SCRATCH": "pool"})  # a name it does not know: the import fails
    assert run.returncode != 0 and "FUSEDLOSS_SCRATCH: source: got 'pool'" in run.stderr
    run = _import_with({"FUSEDLOSS_SCRATCH": "torch"})
    assert run.returncode == 0 and run.stdout.split()[-1] == ("torch" if fusedloss._native.ops else "cuda")
    run = _import_with({"FUSEDLOSS_SCRATCH": "torch", "FUSEDLOSS_NATIVE_NODES": "0"})
    assert run.returncode == 0 and run.stdout.split()[-1] == "cuda"  # the ops work on, with a warning
    assert "FUSEDLOSS_SCRATCH=torch: fusedloss.set_scratch_allocator('torch'): needs" in run.stderr


def _lce_step(h, w, t):
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fusedloss.linear_cross_entropy(hh, ww, t, reduction="none")
    loss.backward(torch.ones_like(loss))
    return loss.detach(), hh.grad, ww.grad


@_CUDA
@pytest.mark.skipif(fusedloss._native.ops is None, reason="the C++ nodes are not loaded")
def test_torch_scratch_is_counted_by_torch_and_keeps_the_bits(restore_default):
    N, H, V = 512, 64, 32000
    h, w, t = _problem("cuda", torch.bfloat16, shape=(N,), H=H, V=V)
    fusedloss.set_scratch_allocator("cuda")
    by_cuda = _lce_step(h, w, t)
    fusedloss.set_scratch_allocator("torch")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    by_torch = _lce_step(h, w, t)
    torch.cuda.synchronize()
    chunk_buffer = N * V * 2  # the whole [N, V] fits the default 256 MiB workspace: one chunk
    assert torch.cuda.max_memory_allocated() - base >= chunk_buffer  # seen by torch
    grads = 2 * (N * H + V * H) + 4 * N  # what the step keeps: the gradients and the loss
    assert torch.cuda.memory_allocated() - base <= grads + (1 << 20)  # the scratch went back
    for a, b in zip(by_cuda, by_torch):
        assert torch.equal(a, b)


@_CUDA
@pytest.mark.skipif(fusedloss._native.ops is None, reason="the C++ nodes are not loaded")
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_peak_is_the_gradients_and_the_workspace(restore_default, reduction):
    # With torch's allocator every byte of the call is in torch's peak: the gradients dhidden and
    # dweight plus workspace_bytes (the chunk buffer and cuBLASLt's workspace), never [N, V].
    N, H, V = 4096, 256, 32000  # logits: 250 MiB
    workspace = 40 << 20
    h, w, t = (x.requires_grad_(x.is_floating_point()) for x in
               _problem("cuda", torch.bfloat16, shape=(N,), H=H, V=V))
    upstream = torch.rand(N, device="cuda")
    fusedloss.set_scratch_allocator("torch")
    for _ in range(2):  # the second step: cuBLASLt's plans are made, torch's cache is warm
        h.grad = w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = fusedloss.linear_cross_entropy(h, w, t, reduction=reduction, workspace_bytes=workspace,
                                              dweight_accumulation="weight_dtype")
        (loss if reduction == "mean" else (loss * upstream).sum()).backward()
        torch.cuda.synchronize()
    grads = 2 * (N * H + V * H)
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= grads + workspace + (2 << 20), f"peak extra {extra / 2**20:.1f} MiB"
    assert extra < N * V * 2  # not the logits


@_CUDA
@pytest.mark.parametrize("source", ["torch", "cuda"])
def test_out_of_memory_is_torchs_error(restore_default, source):
    # Tiny inputs, a chunk buffer beyond the device ([2^19 tokens, 2^18 columns] bf16: 256 GiB):
    # torch.OutOfMemoryError from either source, and the next call works.
    if source == "torch" and fusedloss._native.ops is None:
        pytest.skip("the C++ nodes are not loaded")
    fusedloss.set_scratch_allocator(source)
    N, V, H = 1 << 19, 1 << 18, 8
    h, w, t = _problem("cuda", torch.bfloat16, shape=(N,), H=H, V=V)
    for grad in (False, True):  # the forward alone (the _C path), and through the autograd node
        with pytest.raises(torch.OutOfMemoryError, match="fusedloss scratch of"):
            fusedloss.linear_cross_entropy(h.requires_grad_(grad), w, t, workspace_bytes=1 << 40)
    loss = fusedloss.linear_cross_entropy(h[:64], w[:1024], t[:64] % 1024)
    assert torch.isfinite(loss)


@_CUDA
def test_torchs_memory_fraction_bounds_the_scratch(restore_default):
    # A chunk buffer (2 GiB: 2^15 tokens x 2^15 columns bf16) beyond torch's share of the
    # device but well within the device: torch.OutOfMemoryError, not a cudaMallocAsync block
    # taken behind torch's back; the next call within the share works.
    if fusedloss._native.ops is None:
        pytest.skip("the C++ nodes are not loaded")
    fusedloss.set_scratch_allocator("torch")
    N, V, H = 1 << 15, 1 << 15, 8
    h, w, t = _problem("cuda", torch.bfloat16, shape=(N,), H=H, V=V)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated() + (1 << 30)) / total)
    try:
        with pytest.raises(torch.OutOfMemoryError, match="installed scratch allocator has no memory"):
            fusedloss.linear_cross_entropy(h, w, t, workspace_bytes=N * V * 2 * 2)
        loss = fusedloss.linear_cross_entropy(h, w, t)  # 256 MiB of chunk buffers
        assert torch.isfinite(loss)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def _lce_problem():  # 384 tokens, V 4000: several chunks at the workspace below
    h, w, t = _problem("cuda", torch.bfloat16, shape=(384,), H=64, V=4000)
    return h.requires_grad_(), w.requires_grad_(), t


@_CUDA
@pytest.mark.parametrize("mode", ["in_forward", "recompute"])
def test_graph_capture_with_the_default_scratch(mode):
    # Captured on a side stream with torch's graph pool: the scratch inside the capture comes
    # from cudaMallocAsync (graph-owned), outside it from the default source; replay = eager.
    h, w, t = _lce_problem()

    def step():
        loss = fusedloss.linear_cross_entropy(h, w, t, backward_mode=mode, workspace_bytes=100 * 4000 * 2)
        return (loss, *torch.autograd.grad(loss, (h, w)))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, step()):
        assert torch.equal(a, b)


@_CUDA
@pytest.mark.skipif(fusedloss._native.ops is None, reason="the C++ nodes are not loaded")
def test_both_sources_give_the_same_bits_with_two_buffers(restore_default, monkeypatch):
    # FUSEDLOSS_LCE_BUFFERS=2: the cross-entropy steps on the side stream read the chunk buffers
    # while the caller's stream runs the GEMMs; many chunks, so buffers are refilled.
    monkeypatch.setenv("FUSEDLOSS_LCE_BUFFERS", "2")
    h, w, t = _lce_problem()
    results = []
    for source in ("cuda", "torch"):
        fusedloss.set_scratch_allocator(source)
        for mode in ("in_forward", "recompute"):
            loss = fusedloss.linear_cross_entropy(h, w, t, backward_mode=mode, workspace_bytes=100 * 4000 * 2)
            results.append((loss.detach(), *torch.autograd.grad(loss, (h, w))))
    for a, b in zip(results[:2], results[2:]):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
