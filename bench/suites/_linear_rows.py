"""``bench scale``'s kernel check: one of the scale model's projections alone, at 1 row and at
a verify pass's rows, eager and compiled with the fast path's recipe, the caches flushed
before each call, the rows taken in turns. It says how much of a few-row step's extra cost is
the matmul kernel itself: a weight read once serves every row, so a kernel that streams at
the memory's rate costs about the same at 5 rows as at 1 (``scale_verify_k4_vs_step``,
``scale_step_rows4_vs_rows1``, and through them speculation's and the engine's ratios).

How fast a few-row product streams its weight depends on the CPU and its BLAS. Other ways
to take it were tried while writing this (the weight transposed, the product as ``W @ x.T``,
a multiply-and-sum that inductor turns into a reduction) and none held a 5-row product at the
one-row rate where ``F.linear`` and the compiled recipe did not, so only those two are timed.
Each run's figures are in its report (``linear_rows`` in bench/results/scale.json).
"""
from __future__ import annotations

from collections.abc import Callable
import statistics
import time
from typing import Any

import torch
from torch import nn

from tinyserve.backends.packed import FLUSH_BYTES   # the one flush size: caches out
from tinyserve.model import TinyLlama

from ..common import in_turns

__all__ = ["FLUSH_BYTES", "kernel_sentence", "linear_rows", "one_row_sentence"]


def _cold(fn: Callable[[], Any], flush: torch.Tensor) -> Callable[[], float]:
    """``fn`` timed once after the caches are flushed: seconds."""
    def run() -> float:
        flush.fill_(1.0)
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return run


@torch.no_grad()
def linear_rows(model: TinyLlama, rows: tuple[int, ...], rounds: int,
                compiled: bool = True, flush_bytes: int = FLUSH_BYTES) -> dict[str, Any]:
    """The first layer's ``down_proj`` and ``up_proj`` (a weight each way round) at each of
    ``rows``, eager ``F.linear`` and (``compiled``) the fast path's recipe over a copy of the
    projection, every variant timed cold once a round, in turns, for ``rounds`` rounds:
    each one's median milliseconds and read rate, and each shape's and path's
    ``rows[-1]`` / ``rows[0]`` time ratio (the median of the rounds' ratios)."""
    from tinyserve.backends.compiled import compiling
    from tinyserve.backends.fast import CPU_RECIPE, compile_settings
    mlp = model.model.layers[0].mlp
    device = model.device
    flush = torch.empty(flush_bytes // 4, device=device)
    fns: dict[str, Callable[[], float]] = {}
    sizes: dict[str, int] = {}
    for name in ("down_proj", "up_proj"):
        lin = getattr(mlp, name)
        weight = lin.weight.detach()
        sizes[name] = weight.numel() * weight.element_size()
        paths = {"eager": lin}
        if compiled:
            copy = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=device,
                             dtype=weight.dtype)
            copy.weight.copy_(weight)
            paths["compiled"] = torch.compile(copy.eval(), backend=CPU_RECIPE.backend,
                                              options=CPU_RECIPE.compile_options(),
                                              fullgraph=True, dynamic=False)
        for path, fn in paths.items():
            for r in rows:
                x = torch.randn(r, weight.shape[1], device=device, dtype=weight.dtype)
                if path == "compiled":
                    settings = (lambda r=r: compile_settings(True, r)) \
                        if CPU_RECIPE.freezing else None          # as the loops compile r rows
                    with compiling(settings):
                        fn(x)                                   # compiles this shape
                fns[f"{name}/{path}/{r}"] = _cold(lambda fn=fn, x=x: fn(x), flush)
    runs = in_turns(fns, rounds)
    out: dict[str, Any] = {"rows": list(rows), "weight_bytes": sizes, "ms": {}, "gb_per_s": {},
                           "ratio": {}}
    for key, seconds in runs.items():
        ms = 1e3 * statistics.median(seconds)
        out["ms"][key] = ms
        out["gb_per_s"][key] = sizes[key.split("/")[0]] / ms / 1e6
    for key in {k.rsplit("/", 1)[0] for k in runs}:
        first, last = runs[f"{key}/{rows[0]}"], runs[f"{key}/{rows[-1]}"]
        out["ratio"][key] = statistics.median(b / a for a, b in zip(first, last, strict=True))
    return out


def kernel_sentence(k: dict[str, Any], name: str = "down_proj") -> str:
    """What :func:`linear_rows` found for one projection, as a clause for a note."""
    first, last = k["rows"][0], k["rows"][-1]
    parts = []
    for path in ("compiled", "eager"):
        key = f"{name}/{path}"
        if key in k["ratio"]:
            parts.append(f"{path} {k['ratio'][key]:.2f}x ({k['gb_per_s'][f'{key}/{first}']:.1f} "
                         f"against {k['gb_per_s'][f'{key}/{last}']:.1f} GB/s)")
    head = (f"one {name} alone ({k['weight_bytes'][name] / 1e6:.0f} MB, caches flushed) costs at "
            f"{last} rows, against {first}: " + ", ".join(parts))
    cheapest = min(k["ratio"][f"{name}/{path}"] for path in ("compiled", "eager")
                   if f"{name}/{path}" in k["ratio"])
    if cheapest < ROWS_AT_ONE_ROW_COST:
        return head + (f": at {last} rows the matmul kernel alone takes under "
                       f"{ROWS_AT_ONE_ROW_COST:g}x one row's time, so the step's extra cost is "
                       "not this kernel's alone")
    return head + (": the matmul kernel itself does not stream its weight at the memory's rate "
                   "when it serves several rows")


#: A kernel whose few-row call costs less than this many times its one-row call counts as
#: serving the rows at about one row's cost (the knee's factor, ``bench scale``).
ROWS_AT_ONE_ROW_COST = 1.5


#: Where a kernel alone counts as streaming at the memory's rate: this share of the fastest read.
STREAMS_AT = 0.85


def one_row_sentence(k: dict[str, Any], read_gb_per_s: float, name: str = "down_proj") -> str:
    """What :func:`linear_rows` found for one projection at one row against the run's fastest
    read, as a clause for a batch-1 MBU note: whether the matmul kernel alone reads at the
    memory's rate (then the rest of the step is what falls short) or not (then the kernel is)."""
    first = k["rows"][0]
    rates = {path: k["gb_per_s"][f"{name}/{path}/{first}"] for path in ("compiled", "eager")
             if f"{name}/{path}/{first}" in k["gb_per_s"]}
    read = ", ".join(f"{path} {rate:.1f} GB/s ({rate / read_gb_per_s:.2f} of the fastest read)"
                     for path, rate in rates.items())
    head = (f"one {name} alone ({k['weight_bytes'][name] / 1e6:.0f} MB, caches flushed) at "
            f"{first} row reads {read}")
    if rates.get("compiled", max(rates.values())) < STREAMS_AT * read_gb_per_s:
        return head + (": the one-row matmul kernel itself streams its weight below the "
                       "memory's rate")
    return head + (": the kernel alone streams near the memory's rate, so the step's shortfall "
                   "lies outside its matmuls (attention, norms, activations, dispatch)")

