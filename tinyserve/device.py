"""Where tensors live: CPU by default, CUDA when present, ``TINYSERVE_DEVICE`` to override;
and how to time work on a device (:func:`sync`, :func:`clock`, :func:`timings`): the one
timing loop the chapters, :mod:`tinyserve.roofline` and the bench suites share."""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

ENV_VAR = "TINYSERVE_DEVICE"


def default_device() -> torch.device:
    """The device the course runs on unless told otherwise.

    ``TINYSERVE_DEVICE=cpu`` forces the CPU on a GPU machine (useful to compare the two);
    ``TINYSERVE_DEVICE=cuda:1`` picks a GPU.
    """
    wanted = os.environ.get(ENV_VAR, "").strip()
    if wanted:
        device = torch.device(wanted)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                f"{ENV_VAR}={wanted!r} but CUDA is not available on this machine; "
                f"unset {ENV_VAR} or set it to 'cpu'."
            )
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on GPU (half the bytes, tensor cores), fp32 on CPU (bf16 matmuls are slow there
    and fp32 keeps the equivalence tests tight)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def resolve(device: torch.device | str | None = None,
            dtype: torch.dtype | None = None) -> tuple[torch.device, torch.dtype]:
    """Fill in whatever the caller left out."""
    dev = torch.device(device) if device is not None else default_device()
    return dev, (dtype if dtype is not None else default_dtype(dev))


def upload(values: list[int] | list[float], device: torch.device | str,
           dtype: torch.dtype = torch.long) -> Tensor:
    """A host list as a tensor on ``device``, without the host waiting for the copy.

    On CUDA a plain ``torch.tensor(values, device=...)`` copies from pageable memory and
    blocks until the device has finished everything queued before it; from pinned (page-
    locked) memory the copy is queued behind that work instead (``non_blocking``). Torch's
    pinned-memory cache keeps the source block alive until the copy has run, so the list
    can be dropped at once. On the CPU the tensor is already where it belongs.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


# --- timing on a device ---------------------------------------------------------------------

def sync(device: torch.device | str) -> None:
    """Wait until ``device`` has finished the work queued on it (nothing to wait for on a
    CPU, where every call returns when its work is done)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device | str) -> float:
    """``time.perf_counter()`` after the device has finished its queued work.

    CUDA kernels run asynchronously: without the synchronise, a timestamp would record when
    work was *launched*, not when it was done, and prefill would look free.
    """
    sync(device)
    return time.perf_counter()


def timings(fn: Callable[[], Any], device: torch.device | str, repeats: int, *,
            warmup: int = 1, setup: Callable[[], Any] | None = None) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, after ``warmup`` untimed calls
    (first-touch page faults, lazy kernel loading, a first compile), each between two
    :func:`clock` readings, so queued GPU work is counted. ``setup`` runs before every call,
    the warm-up ones too, outside the clock.

    The caller takes what it quotes: the fastest (a machine's ceiling, a step against it:
    other programs only ever slow a run down) or the median (a figure one disturbed run
    should not move)."""
    times = []
    for r in range(warmup + repeats):
        if setup is not None:
            setup()
        start = clock(device)
        fn()
        if r >= warmup:
            times.append(clock(device) - start)
    return times


def in_turns(fns: dict[str, Callable[[], Any]], rounds: int,
             warmup: int = 1) -> dict[str, list[Any]]:
    """Call several ``fns`` in turns: each round calls every one once, the first to go
    rotating each round, after ``warmup`` untimed rounds. Returns what each call returned,
    one per round, by name.

    On a shared machine the speed drifts over seconds (other tenants, a core shared with
    another VM); timing A's runs, then B's, folds that drift into A/B. Taken in turns, the
    runs of one round are seconds apart, so a busy spell hits every function alike."""
    if not fns:
        raise ValueError("in_turns needs at least one function to call")
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    out: dict[str, list[Any]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name].append(fns[name]())
    return out


def interleaved_seconds(fns: dict[str, Callable[[], Any]], device: torch.device | str,
                        rounds: int = 5, warmup: int = 1, *,
                        setup: Callable[[], Any] | None = None) -> dict[str, list[float]]:
    """Seconds of every call of :func:`in_turns`, by name, each between two :func:`clock`
    readings; ``setup`` runs before every call, outside the clock (as in :func:`timings`: a
    cache flush). The ratio to quote is of two names' rounds (``bench.common.median_ratio``),
    or of their fastest."""
    def timed(fn: Callable[[], Any]) -> Callable[[], float]:
        def run() -> float:
            if setup is not None:
                setup()
            start = clock(device)
            fn()
            return clock(device) - start
        return run
    return in_turns({name: timed(fn) for name, fn in fns.items()}, rounds, warmup)
