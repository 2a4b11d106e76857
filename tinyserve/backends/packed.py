"""Eager passes over weights packed once: the CPU fast path's prefill (and the engine's mixed
steps), where the matmuls have many rows and shapes that change with every prompt.

A compiled step has static shapes, so inductor packs its frozen weights at compile time
(:mod:`tinyserve.backends.fast`). A prefill's rows are the prompt's length, different each
request, so it runs eagerly, and eager ``F.linear`` on a CPU is MKL's ``sgemm`` over the plain
weight. A few-row product then pays two costs: one per call (MKL's GEMM copies its operands
into an internal packed layout within each call, whatever the rows) and one per row (each
row's multiply-adds at the rate the library's kernel reaches for that shape, which differs by
library and by CPU: MKL takes slower code paths on AMD CPUs, pytorch/builder#1245 and #460).
Chapter 3 prints both for one large weight (:func:`tinyserve.workbook.scale_sweeps.
linear_rates`): the one-row time and each library's per-row slope in FLOP/s beside the
ceiling. oneDNN offers the
other way: the weight
reordered once into the kernel's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``)
and every later call reads it as it is (``torch.ops.mkldnn._linear_pointwise``), whatever the
rows. Inductor itself takes that pair for bf16 and fp16 weights, under ACL (Arm) or AOT
compilation, and for a batch it cannot fix at compile time (torch 2.13's
``_inductor/fx_passes/mkldnn_fusion.py``); for fp32 it prefers MKL's.

Which of the two is faster depends on the CPU and the model, so the fast path measures whole
passes both ways (:func:`measure`) and packs from the pass size where that won
(:mod:`~tinyserve.backends.fast`'s ``eager_passes``). On CPUs where MKL's few-row ``sgemm`` is
slow, the packed linear wins at every row count past one, by a wide margin on a weight read
from memory; at one row both stream the weight once and come out close. The mode also costs
each operation of a pass some Python, so on a small model a pass of a few tokens can lose,
and a model small enough (the draft) can lose at every size. ``bench scale`` times the
eager step over packed weights against plain ``F.linear`` (its rows sweep), and
:class:`PassTimes` says what :func:`measure` found on the machine it ran on.

:class:`PackedLinears` is a :class:`~torch.overrides.TorchFunctionMode`: while it is held,
every fp32 CPU linear or matmul against a 2-D weight, with at least ``min_rows`` rows, runs on
that weight's packed copy. The model knows nothing of it (the loops hold it around their eager
passes), and nothing changes in the numbers but the order of a float sum's terms.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
import json
import os
from pathlib import Path
import platform
import statistics
from typing import Any
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from ..device import interleaved_seconds

__all__ = ["FLUSH_BYTES", "KEPT_FILE", "MIN_ROWS", "PROBE_ROWS", "PackedLinears", "PassTimes",
           "available", "linear", "measure", "measure_kept", "pack"]

#: The fewest rows a matmul needs to go to the packed copy. One row (a prompt's last position
#: at the LM head, a one-token prompt) stays on the plain weight: a one-row product streams
#: the weight once whichever kernel reads it, so the packed layout has little to win there,
#: and packing the LM head would hold another copy of the largest weight for it.
MIN_ROWS = 2

#: The rows a weight is packed for (a hint: the copy serves any number of rows).
HINT_ROWS = 64

_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}


def available() -> bool:
    """Whether this torch has oneDNN's packed linear (the ops ship with the CPU build)."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack(weight: Tensor, rows: int) -> Tensor:
    """``weight`` (out, in) reordered once for oneDNN's linear, laid out for ``rows`` rows (a
    hint: the packed weight serves any number of rows)."""
    with torch.inference_mode(False), torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows)


def linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN, ``packed`` being :func:`pack`'s copy of
    ``weight``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinears(TorchFunctionMode):
    """While held, fp32 CPU linears ``F.linear(x, w)`` and matmuls ``x @ w`` with 2-D ``w``
    and at least ``min_rows`` rows run on ``w``'s packed copy (see the module). Copies are
    made on first use and kept per weight tensor and version: a weight changed in place is
    packed again, and a copy goes when its weight does. ``packed``: how many copies are held."""

    def __init__(self, min_rows: int = MIN_ROWS, hint_rows: int = HINT_ROWS) -> None:
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
            held = (weight._version, pack(weight.t() if transposed else weight, self.hint_rows))
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
            return linear(args[0], self._copy(self._linear, args[1], False), bias)
        if func in _MATMULS and len(args) == 2 and not kwargs and self._takes(*args):
            return linear(args[0], self._copy(self._matmul, args[1], True), None)
        return func(*args, **kwargs)


@dataclass(frozen=True)
class PassTimes:
    """A model's eager pass timed both ways (:func:`measure`) at each of ``rows`` tokens:
    milliseconds a pass, plain ``F.linear`` and under :class:`PackedLinears`, caches flushed
    before each pass, median of the repeats; ``shape``: the model's widest linear."""
    rows: tuple[int, ...]
    plain_ms: tuple[float, ...]
    packed_ms: tuple[float, ...]
    shape: str

    @property
    def from_rows(self) -> int | None:
        """The fewest rows from which the packed pass won at every probe (None: at none).
        The mode costs every operation of a pass a little Python, so on a small model a
        pass of few rows can lose what its matmuls gain."""
        start = None
        for rows, plain, packed_ms in reversed(list(zip(self.rows, self.plain_ms,
                                                        self.packed_ms))):
            if packed_ms >= plain:
                break
            start = rows
        return start

    def sentence(self) -> str:
        timed = ", ".join(f"{r} tokens {b:.1f} against {a:.1f} ms"
                          for r, a, b in zip(self.rows, self.plain_ms, self.packed_ms))
        rule = ("plain F.linear at every size" if self.from_rows is None else
                f"oneDNN's linear over weights packed once from {self.from_rows} tokens a pass")
        return (f"eager passes (prefill): {rule}; a pass packed against plain, caches flushed "
                f"({self.shape}, fp32): {timed}")


#: Bytes written before each timed call or pass on a CPU (here, the autotuner's in
#: :mod:`~tinyserve.backends.fast`, ``bench scale``'s kernel probes): more than a last-level
#: cache holds (tens of MiB on most CPUs, around a hundred on large server parts), so the
#: weights come from memory, as in a decode step or a prefill.
FLUSH_BYTES = 256 * 2**20
#: The pass sizes :func:`measure` times: a short prompt's few tokens, to a prefill's many.
PROBE_ROWS = (4, 16, 64)


@torch.inference_mode()
def measure(model: torch.nn.Module, rows: tuple[int, ...] = PROBE_ROWS, repeats: int = 3,
            mode: PackedLinears | None = None) -> PassTimes:
    """Time ``model``'s eager pass (no cache, the last position's logits) of each of ``rows``
    pad tokens (at most its context window), plain and under ``mode`` (default: a new
    :class:`PackedLinears`; its copies are made before timing and kept), the two in turns,
    the caches flushed before each pass: the whole pass, so the mode's cost per operation is
    counted with its matmuls' gain."""
    config = model.config
    device = next(model.parameters()).device
    rows = tuple(sorted({min(r, config.max_position_embeddings) for r in rows}))
    mode = PackedLinears() if mode is None else mode
    flush = torch.empty(FLUSH_BYTES // 4)
    plain_ms, packed_ms = [], []
    for r in rows:
        ids = torch.full((1, r), config.pad_token_id, device=device)
        last = torch.tensor([r - 1], device=device)

        def plain() -> None:
            model(ids, logits_at=last)

        def packed() -> None:
            with mode:
                model(ids, logits_at=last)
        seconds = interleaved_seconds({"plain": plain, "packed": packed}, device, repeats,
                                      setup=lambda: flush.fill_(1.0))
        plain_ms.append(1e3 * statistics.median(seconds["plain"]))
        packed_ms.append(1e3 * statistics.median(seconds["packed"]))
    up = model.model.layers[0].mlp.up_proj
    return PassTimes(tuple(rows), tuple(plain_ms), tuple(packed_ms),
                     f"{config.num_hidden_layers} layers, up_proj {up.in_features} -> "
                     f"{up.out_features}")


#: Where :func:`measure_kept` keeps its measurements, in the folder it is given (the fast
#: path's kernel cache, one per torch version).
KEPT_FILE = "eager_passes.json"


def _processor() -> str:
    """The processor's name (``/proc/cpuinfo``'s model name where there is one)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_kept(model: torch.nn.Module, folder: Path | None,
                 mode: PackedLinears | None = None) -> PassTimes:
    """:func:`measure`, kept in ``folder`` / :data:`KEPT_FILE` per processor, thread count,
    model shape and dtype: a second process on this machine reads it instead of timing the
    passes again (a second or so on the scale model). ``folder=None``: measured, not kept.
    A file that cannot be read is measured over; one that cannot be written, a warning."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    key = (f"{_processor()} | {torch.get_num_threads()} threads | hidden {cfg.hidden_size}, "
           f"MLP {cfg.intermediate_size}, {cfg.num_hidden_layers} layers, vocab "
           f"{cfg.vocab_size}, {dtype}")
    path = None if folder is None else Path(folder) / KEPT_FILE
    kept: dict[str, Any] = {}
    if path is not None and path.is_file():
        try:
            kept = json.loads(path.read_text())
            entry = kept[key]
            return PassTimes(tuple(entry["rows"]), tuple(entry["plain_ms"]),
                             tuple(entry["packed_ms"]), entry["shape"])
        except (OSError, ValueError, KeyError, TypeError):
            kept = kept if isinstance(kept, dict) else {}
    times = measure(model, mode=mode)
    if path is not None:
        kept[key] = asdict(times)
        scratch = path.with_suffix(f".{os.getpid()}.tmp")   # whole or not at all
        try:
            scratch.write_text(json.dumps(kept, indent=1))
            os.replace(scratch, path)
        except OSError as err:   # a folder we may not write: the measurement still holds
            warnings.warn(f"could not keep the eager passes' measurement in {path} ({err}); "
                          "the next run measures again (a second or so)", stacklevel=2)
    return times
