"""How a loop runs its decode steps: one argument, ``path``, for one choice.

Every loop (``generate``, ``generate_batch``, speculation and its drafters, the engine) takes
the same ``path`` (as nano-vllm's runner takes one ``enforce_eager``):

    "auto"      CUDA graphs on CUDA, the eager step elsewhere (the default)
    "eager"     the plain step on the KV cache: the reference every other path is tested against
    "graph"     the step on static buffers (:mod:`tinyserve.backends`): captured once and
                replayed as a CUDA graph on CUDA, run eagerly on a CPU (the same code)
    "compiled"  ``torch.compile``'s default mode: for one request, the step on static buffers
                (:mod:`~tinyserve.backends.compiled`); in the engine, its token-wise layers
    "fast"      the fastest this machine has (:mod:`~tinyserve.backends.fast`): the CUDA
                graphs on CUDA; on a CPU each step shape's fastest way, timed here and kept

:func:`resolve` turns it into the switches a loop reads. Where nothing can compile here
(:mod:`tinyserve.toolchain`), ``"compiled"`` runs the eager step and says why once; ``"fast"``
decides per shape (its compiled way dropped).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["PATHS", "PathName", "StepPath", "resolve"]

PathName = Literal["auto", "eager", "graph", "compiled", "fast"]
#: Every ``path`` a loop may be given.
PATHS: tuple[str, ...] = ("auto", "eager", "graph", "compiled", "fast")


@dataclass(frozen=True)
class StepPath:
    """What a loop runs for a ``path`` on a device: ``graph`` (static buffers: CUDA graphs on
    CUDA), ``compiled`` (a ``torch.compile``'d step) and ``fast`` (the fast path's steps: on a
    CPU the compiled decoders with their measured choice, on CUDA the graphs)."""
    name: str
    graph: bool = False
    compiled: bool = False
    fast: bool = False


def resolve(path: str, device: torch.device | str, *, use_cache: bool = True,
            allowed: tuple[str, ...] = PATHS, where: str = "this loop") -> StepPath:
    """``path`` for a loop on ``device`` (``where`` names the loop in errors), checked:
    a path outside ``allowed`` or one that needs the KV cache without it is a ValueError
    that names what is allowed."""
    if path not in allowed:
        raise ValueError(f"{where}: path={path!r} is not one of {', '.join(map(repr, allowed))}")
    cuda = torch.device(device).type == "cuda"
    if not use_cache and path not in ("auto", "eager"):
        raise ValueError(f"{where}: path={path!r} needs the KV cache; without it "
                         f"(use_cache=False, --no-cache) pass path='eager'")
    if path == "auto":
        return StepPath(path, graph=cuda and use_cache)
    if path == "graph":
        return StepPath(path, graph=True)
    if path == "compiled":
        if not cuda:
            from .toolchain import ready
            if not ready(device):          # nothing compiles here: the eager step, said once
                return StepPath(path)
        return StepPath(path, compiled=True)
    if path == "fast":
        return StepPath(path, graph=cuda, compiled=not cuda, fast=True)
    return StepPath(path)
