"""Count the host reads a piece of code makes: every point where Python waits for a tensor's
value (on a GPU, a synchronisation: the host stops until the device has caught up).

Two hooks, because the reads reach torch two ways:
- a torch-function mode sees the Python calls that read: ``.item()``, ``int(t)``,
  ``float(t)``, ``bool(t)``, and ``.tolist()``, ``.cpu()``, ``.numpy()``. The dispatcher alone
  would miss some: ``.tolist()`` of a CPU tensor reads its memory without dispatching
  anything, and under ``torch.inference_mode`` even ``.item()`` skips the Python dispatch key;
- a dispatch mode sees reads made below Python: ``aten._local_scalar_dense`` called by
  another operator, and the operators whose kernels read values themselves (``multinomial``
  checks its probabilities, ``nonzero`` and friends size their output).

A CPU tensor's read costs nothing, but the code path is the one that runs on a GPU: counted
on the CPU, the numbers hold for both devices. (A host-to-device copy made without
``non_blocking`` also waits on a GPU; the CPU cannot tell those apart, so they are not
counted here.)
"""
from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

READING_OPS = {"aten._local_scalar_dense", "aten.multinomial", "aten.nonzero",
               "aten.masked_select", "aten._unique2", "aten.unique_dim",
               "aten.unique_consecutive", "aten.repeat_interleave.Tensor"}
READING_METHODS = {"tolist", "cpu", "numpy", "item", "__int__", "__float__", "__bool__",
                   "__index__", "__complex__"}


class _Ops(TorchDispatchMode):
    def __init__(self, owner: "HostReads") -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket) if func.overloadpacket else str(func)
        if not self.owner._in_method and (name in READING_OPS
                                          or str(func).rsplit(".", 1)[0] in READING_OPS):
            self.owner._record(name)
        return func(*args, **(kwargs or {}))


class _Methods(TorchFunctionMode):
    def __init__(self, owner: "HostReads") -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") not in READING_METHODS or self.owner._in_method:
            return func(*args, **(kwargs or {}))
        self.owner._record(f"Tensor.{func.__name__}")
        self.owner._in_method = True   # the one read: not again as the op it dispatches
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.owner._in_method = False


class HostReads:
    """``with HostReads() as reads: ...`` then ``reads.count``; ``reads.where`` lists each
    read with the tinyserve line that made it, for the failure message."""

    def __init__(self) -> None:
        self.where: list[str] = []
        self._in_method = False

    @property
    def count(self) -> int:
        return len(self.where)

    def _record(self, what: str) -> None:
        frames = [f for f in traceback.extract_stack() if "/tinyserve/" in f.filename]
        at = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"
        self.where.append(f"{what} at {at}")

    def __enter__(self) -> "HostReads":
        self._modes = [_Methods(self), _Ops(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def count_reads(fn, *args, **kwargs) -> tuple[object, HostReads]:
    """``fn(*args, **kwargs)`` under a counter: (its result, the counter)."""
    with torch.no_grad(), HostReads() as reads:
        out = fn(*args, **kwargs)
    return out, reads
