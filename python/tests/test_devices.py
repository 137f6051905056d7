"""Tensors on a CUDA device other than the current one: every op runs on the tensors' device, as
torch's own ops do, through the C++ nodes and the Python nodes alike (the same values as with
that device current)."""
import importlib

import pytest
import torch

import fusedloss

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                reason=f"needs two CUDA devices, this process sees {torch.cuda.device_count()}")

_MODULES = [importlib.import_module(f"fusedloss.{m}")
            for m in ("cross_entropy", "linear_cross_entropy", "rms_norm", "swiglu")]


def _ops(device):
    g = torch.Generator(device=device).manual_seed(0)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=g, dtype=torch.bfloat16) * scale).requires_grad_()

    t = torch.randint(0, 256, (64,), device=device, generator=g)
    return {
        "cross_entropy": lambda: (lambda x: (fusedloss.cross_entropy(x, t), [x]))(leaf(64, 256)),
        "linear_cross_entropy": lambda: (lambda h, w: (fusedloss.linear_cross_entropy(h, w, t), [h, w]))(
            leaf(64, 32), leaf(256, 32, scale=0.1)),
        "rms_norm": lambda: (lambda x, w: (fusedloss.rms_norm(x, w).float().square().sum(), [x, w]))(
            leaf(64, 96), leaf(96)),
        "swiglu": lambda: (lambda y: (fusedloss.swiglu(y).float().square().sum(), [y]))(leaf(64, 128)),
    }


def _run(make):
    loss, leaves = make()
    loss.backward()
    return [loss.detach()] + [x.grad for x in leaves]


@pytest.mark.parametrize("nodes", ["cpp", "python"])
@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy", "rms_norm", "swiglu"])
def test_runs_on_the_tensors_device(monkeypatch, nodes, op):
    if nodes == "cpp" and fusedloss._native.ops is None:
        pytest.skip(f"the C++ nodes are {fusedloss._native.status}")
    if nodes == "python":
        for m in _MODULES:
            for name in ("_EAGER", "_EAGER_RESIDUAL"):
                if hasattr(m, name):
                    monkeypatch.setattr(m, name, None)
    with torch.cuda.device(1):
        expected = _run(_ops("cuda:1")[op])
    with torch.cuda.device(0):
        got = _run(_ops("cuda:1")[op])
        assert torch.cuda.current_device() == 0  # the op gave the current device back
    torch.cuda.synchronize(1)
    for a, b in zip(got, expected):
        assert a.device == torch.device("cuda:1")
        assert torch.equal(a, b)
