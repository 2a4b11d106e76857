"""Shared test set-up: deterministic torch on a small number of threads."""
from __future__ import annotations

import pytest
import torch

torch.set_num_threads(2)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # GPU tests are collected everywhere and skipped, with the reason, where CUDA is absent.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
