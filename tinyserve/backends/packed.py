"""Eager passes over weights packed once: the CPU fast path's prefill (and the engine's mixed
steps), where the matmuls have many rows and shapes that change with every prompt.

A compiled step has static shapes, so inductor packs its frozen weights at compile time
(:mod:`tinyserve.backends.fast`). A prefill's rows are the prompt's length, different each
request, so it runs eagerly, and eager ``F.linear`` on a CPU is MKL's ``sgemm`` over the plain
weight: it re-lays the weight out in every call. oneDNN offers the other way: the weight
reordered once into the kernel's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``)
and every later call reads it as it is (``torch.ops.mkldnn._linear_pointwise``), whatever the
rows. Inductor itself takes that pair for bf16 and fp16 weights and for a batch it cannot
fix at compile time (``_inductor/fx_passes/mkldnn_fusion.py``); for fp32 it prefers MKL's.

Which of the two is faster depends on the CPU, so the fast path measures (:func:`measure`)
and keeps the winner (:mod:`~tinyserve.backends.fast`'s ``eager_passes``). Measured on a 2-core
AMD EPYC (Zen 5, one thread, a 5504 x 2048 fp32 weight read from memory): oneDNN's packed
linear ran 2.3-2.5x as fast as ``F.linear`` at every row count from 2 to 512 (225 against 96
GFLOP/s at 128 rows); at one row the two were within 20%.

:class:`PackedLinears` is a :class:`~torch.overrides.TorchFunctionMode`: while it is held,
every fp32 CPU linear or matmul against a 2-D weight, with at least ``min_rows`` rows, runs on
that weight's packed copy. The model knows nothing of it (the loops hold it around their eager
passes), and nothing changes in the numbers but the order of a float sum's terms.
"""
from __future__ import annotations

from dataclasses import dataclass
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["KernelTimes", "MIN_ROWS", "PROBE_ROWS", "PackedLinears", "available", "measure"]

#: The fewest rows a matmul needs to go to the packed copy. One row (a prompt's last position
#: at the LM head, a one-token prompt) stays on the plain weight: the two kernels were within
#: 20% of each other there, and packing the LM head would hold another copy of the largest
#: weight for it.
MIN_ROWS = 2
#: The rows :func:`measure` times the two kernels at: a short prompt's prefill.
PROBE_ROWS = 64

_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}


def available() -> bool:
    """Whether this torch has oneDNN's packed linear (the ops ship with the CPU build)."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _pack(weight: Tensor, rows: int) -> Tensor:
    """``weight`` (out, in) reordered once for oneDNN's linear, laid out for ``rows`` rows (a
    hint: the packed weight serves any number of rows)."""
    with torch.inference_mode(False), torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows)


def _linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinears(TorchFunctionMode):
    """While held, fp32 CPU linears ``F.linear(x, w)`` and matmuls ``x @ w`` with 2-D ``w``
    and at least ``min_rows`` rows run on ``w``'s packed copy (see the module). Copies are
    made on first use and kept per weight tensor and version: a weight changed in place is
    packed again, and a copy goes when its weight does. ``packed``: how many copies are held."""

    def __init__(self, min_rows: int = MIN_ROWS, hint_rows: int = PROBE_ROWS) -> None:
        super().__init__()
        self.min_rows, self.hint_rows = min_rows, hint_rows
        # weight -> (its version when packed, the packed copy); one map per layout, as
        # ``x @ w`` holds w as (in, out) and ``F.linear`` as (out, in).
        self._linear: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._matmul: WeakIdKeyDictionary = WeakIdKeyDictionary()

    @property
    def packed(self) -> int:
        return len(self._linear) + len(self._matmul)

    def _copy(self, table: WeakIdKeyDictionary, weight: Tensor, transposed: bool) -> Tensor:
        held = table.get(weight)
        if held is None or held[0] != weight._version:
            held = (weight._version, _pack(weight.t() if transposed else weight, self.hint_rows))
            table[weight] = held
        return held[1]

    def _takes(self, x: Any, w: Any) -> bool:
        return (isinstance(x, Tensor) and isinstance(w, Tensor) and w.dim() == 2
                and x.dim() >= 2 and x.dtype == w.dtype == torch.float32
                and x.device.type == w.device.type == "cpu"
                and not (w.requires_grad and torch.is_grad_enabled())   # autograd: as it was
                and x.numel() >= self.min_rows * x.shape[-1] > 0)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and self._takes(args[0], args[1]):
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return _linear(args[0], self._copy(self._linear, args[1], False), bias)
        if func in _MATMULS and len(args) == 2 and not kwargs and self._takes(*args):
            return _linear(args[0], self._copy(self._matmul, args[1], True), None)
        return func(*args, **kwargs)


@dataclass(frozen=True)
class KernelTimes:
    """One fp32 linear timed both ways (:func:`measure`): milliseconds a call, caches flushed
    before each, median of the calls; ``shape``: rows x in -> out."""
    plain_ms: float
    packed_ms: float
    shape: str

    @property
    def winner(self) -> str:
        return "packed" if self.packed_ms < self.plain_ms else "plain"

    def sentence(self) -> str:
        kernel = ("oneDNN's linear over weights packed once" if self.winner == "packed"
                  else "F.linear on the plain weights")
        return (f"eager passes (prefill): {kernel}; measured at {self.shape}, fp32: packed "
                f"{self.packed_ms:.2f} ms, F.linear {self.plain_ms:.2f} ms a call "
                f"({self.plain_ms / self.packed_ms:.2f}x)")


#: Bytes written before each timed call: more than a last-level cache holds, so the weight
#: comes from memory as in a real pass (the course's machines: 32 and 105 MiB).
FLUSH_BYTES = 256 * 2**20


@torch.no_grad()
def measure(weight: Tensor, rows: int = PROBE_ROWS, repeats: int = 5) -> KernelTimes:
    """Time ``F.linear`` on ``weight`` (out, in) against oneDNN's linear on its packed copy,
    ``rows`` rows of input, the two in turns, each call after the caches are flushed."""
    weight = weight.detach()
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    packed = _pack(weight, rows)
    flush = torch.empty(FLUSH_BYTES // 4)
    calls = {"plain": lambda: F.linear(x, weight), "packed": lambda: _linear(x, packed, None)}
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        fn()                                   # the first call pays for anything lazy
    for _ in range(repeats):
        for name, fn in calls.items():
            flush.fill_(1.0)
            start = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - start)
    plain, packed_ms = (1e3 * statistics.median(seconds[n]) for n in ("plain", "packed"))
    return KernelTimes(plain, packed_ms, f"{rows} x {weight.shape[1]} -> {weight.shape[0]}")
