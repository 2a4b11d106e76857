"""Shared test set-up: deterministic torch on a small number of threads."""
from __future__ import annotations

import functools
import os

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


@functools.lru_cache(maxsize=1)
def sandbox_skip_reason() -> str | None:
    """Why sandboxed grading tests cannot run here, or None when they can.

    On a learner's laptop without bubblewrap these tests skip with the reason. In CI
    (``CI`` set) they never skip: a missing sandbox there must fail the run, not hide."""
    from autograder.sandbox import sandbox_available
    ok, why = sandbox_available()
    if ok or os.environ.get("CI"):
        return None
    return f"needs the bubblewrap sandbox: {why}"
