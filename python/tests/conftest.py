import os
import random

import pytest
import torch

import fusedloss  # noqa: F401  (registers the ops)

_SEED = int(os.environ.get("FUSEDLOSS_SEED", random.SystemRandom().randrange(2**31)))


def pytest_report_header(config):
    try:
        from importlib.metadata import version
        megatron = f"megatron-core {version('megatron-core')}"
    except Exception:
        megatron = "megatron-core not installed"
    return [f"fusedloss random seed {_SEED} (set FUSEDLOSS_SEED={_SEED} to replay)", megatron]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(_SEED)


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        params = [pytest.param("cpu")]
        params.append(pytest.param("cuda", marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="CUDA backend: no CUDA device in this process")))
        metafunc.parametrize("device", params)
