"""SDPA's output in the memory-efficient kernel's layout, imposed on the CPU.

``F.scaled_dot_product_attention`` returns ``(B, H, M, K)`` values, but which *strides* it
returns depends on the kernel the dispatcher picks. On CUDA a masked call (and every fp32
call) goes to the memory-efficient kernel, which writes a ``(B, M, H, K)`` buffer and returns
it transposed to ``(B, H, M, K)`` (PyTorch's meta registration of
``_scaled_dot_product_efficient_attention`` says so, 2.5 to 2.13); CPU SDPA on torch >= 2.5
returns the query's layout. Code that calls ``.view`` on the output therefore passes on a
CPU and crashes on a GPU ("view size is not compatible with input tensor's size and
stride"). Inside :func:`efficient_layout` every SDPA call returns the same values in the
memory-efficient layout, so the CPU tests catch such code.

Two ways in: the ``sdpa_efficient_layout`` fixture (tests/conftest.py), and the environment
switch ``TINYSERVE_SDPA_LAYOUT=efficient``, which imposes it on a whole pytest run::

    TINYSERVE_SDPA_LAYOUT=efficient .venv/bin/python -m pytest tests/test_generate.py -q
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

ENV = "TINYSERVE_SDPA_LAYOUT"
_REAL_SDPA = F.scaled_dot_product_attention


def as_efficient_layout(out: torch.Tensor) -> torch.Tensor:
    """The same values as ``out`` (B, H, M, K), stored as (B, M, H, K) and seen transposed:
    the memory-efficient kernel's output layout."""
    if out.dim() != 4:
        return out
    return out.transpose(1, 2).contiguous().transpose(1, 2)


class EfficientLayoutSDPA:
    """A stand-in for ``F.scaled_dot_product_attention``: the real call, its output
    re-laid as the memory-efficient kernel's. Counts its eager calls (a test that imposes
    the layout on code that never reached SDPA would prove nothing)."""

    def __init__(self) -> None:
        self.calls = 0
        # What torch's override machinery reads off every function of torch.nn.functional
        # (torch.compile walks them): a name, like the function it stands in for.
        self.__name__ = self.__qualname__ = "scaled_dot_product_attention"

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            # eager calls only: a count that changes inside a traced step would be guarded
            # on, and each new value would recompile it
            self.calls += 1
        return as_efficient_layout(_REAL_SDPA(*args, **kwargs))


@contextlib.contextmanager
def efficient_layout() -> Iterator[EfficientLayoutSDPA]:
    """Every ``F.scaled_dot_product_attention`` call inside returns the memory-efficient
    layout. The code under test reads ``F.scaled_dot_product_attention`` at call time (as
    ``torch.nn.functional``'s attribute), so replacing the attribute reaches it, eager and
    traced by ``torch.compile`` alike."""
    fake = EfficientLayoutSDPA()
    F.scaled_dot_product_attention = fake   # type: ignore[assignment]
    try:
        yield fake
    finally:
        F.scaled_dot_product_attention = _REAL_SDPA
