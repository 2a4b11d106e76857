"""Device choice: CPU by default here, TINYSERVE_DEVICE overrides, bf16 only on GPU."""
from __future__ import annotations

import pytest
import torch

from tinyserve.device import ENV_VAR, default_device, default_dtype, resolve


def test_env_var_forces_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "cpu")
    assert default_device() == torch.device("cpu")
    assert resolve() == (torch.device("cpu"), torch.float32)


def test_default_follows_cuda_availability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert default_device().type == expected


def test_bf16_on_gpu_fp32_on_cpu() -> None:
    assert default_dtype("cpu") == torch.float32
    assert default_dtype("cuda") == torch.bfloat16


def test_asking_for_missing_cuda_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA, so the request is valid")
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(RuntimeError, match=ENV_VAR):
        default_device()
