"""The fast path in the chapters: what chapters 1, 6b, 3 and 8 compile, and how they time it.

Each of those chapters keeps its eager measurement (the kernel lesson) and sets the fast path
(:mod:`tinyserve.backends.fast`: ``torch.compile`` with frozen weights on a CPU, CUDA graphs
on a GPU) beside it. A fast shape is a compile of its own, tens of seconds to a minute each on
two cores, so a chapter compiles exactly the shapes it times, up front, with
:func:`prepare_for_chapter` (a progress bar and a line per shape), and the kernels go to the
persistent cache (:func:`tinyserve.paths.cache_dir`), where the next chapter finds them:

- every chapter's decode step runs in one window, :data:`TOKENS` positions per row, so the
  scale model's batch-1 step that chapter 1 compiles is the one chapters 6b, 3 and 8 reuse;
- **quick mode** (``TINYSERVE_QUICK=1``, what the notebook tests set: :func:`quick`) prepares
  fewer shapes: batch 1 and 4 in chapter 3's sweep, ``k = 1`` in chapter 8. It still compiles
  for real; each chapter prints which mode it ran in and which shapes.

The timing is the course's one loop (:func:`tinyserve.device.timings`, through
:func:`tinyserve.roofline.per_token_seconds` for decode steps): the fastest of a few runs.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
import os
import time

import torch
from torch import Tensor

from ..backends.fast import Shape, ShapeCost, draft_shape, verify_shape
from ..device import timings
from ..model import TinyLlama
from ..roofline import RowPoint, eager_step_seconds, per_token_seconds

__all__ = ["FULL_K", "FULL_ROWS", "PROMPT", "QUICK_CHANGES", "QUICK_ENV", "QUICK_K", "QUICK_ROWS",
           "TOKENS", "decode_shapes", "describe_shapes", "fast_pass_seconds", "fast_row_sweep",
           "fast_step_seconds", "mode_line", "prepare_for_chapter", "quick", "rows", "spec_k",
           "spec_shapes"]

#: The environment variable that asks for quick mode ("1").
QUICK_ENV = "TINYSERVE_QUICK"
#: Positions per row of every chapter's fast decode step and speculative passes: one window
#: (a power of two) shared by the chapters, so a shape compiled in one is found by the next.
#: 128 holds chapter 8's longest prompt (89 tokens) and its 32 tokens at scale.
TOKENS = 128
#: Prompt tokens per row before a timed fast step (the step then attends over ~PROMPT).
PROMPT = 32
#: Chapter 3's rows on the fast path: the full sweep, and quick mode's two points.
FULL_ROWS = (1, 2, 4, 8, 16, 32)
QUICK_ROWS = (1, 4)
#: Drafts per speculative step at scale in chapter 8 (full and quick mode).
FULL_K = 4
QUICK_K = 1      # the target's verify passes of 1 and 2 tokens: three compiles fewer than k = 4's


def quick() -> bool:
    """Whether the chapters run in quick mode: ``TINYSERVE_QUICK=1`` (the notebook tests set
    it; read at each call). Quick mode compiles fewer shapes, never fakes one."""
    return os.environ.get(QUICK_ENV, "").strip() == "1"


def rows() -> tuple[int, ...]:
    """Chapter 3's batch sizes on the fast path: :data:`QUICK_ROWS` or :data:`FULL_ROWS`."""
    return QUICK_ROWS if quick() else FULL_ROWS


def spec_k() -> int:
    """Chapter 8's drafts per step at scale: :data:`QUICK_K` or :data:`FULL_K`."""
    return QUICK_K if quick() else FULL_K


def decode_shapes(batches: Iterable[int]) -> list[Shape]:
    """The fast decode step for each batch size, in the shared window (:data:`TOKENS`)."""
    return [Shape(TOKENS, b) for b in batches]


def spec_shapes(k: int) -> tuple[Shape, Shape]:
    """(the target's verify passes of 1..k + 1 tokens, the draft's passes of 1 and 2) in the
    shared window: what ``speculative_generate(..., path="fast")`` runs."""
    return verify_shape(k, TOKENS), draft_shape(TOKENS)


def describe_shapes(shapes: Sequence[Shape]) -> str:
    """The shapes in words: "decode batch 1, passes of 1-3 tokens" (window :data:`TOKENS`)."""
    def one(s: Shape) -> str:
        if not s.widths:
            return f"decode batch {s.batch}"
        w = sorted(s.widths)
        return f"passes of {w[0]}-{w[-1]} tokens" if len(w) > 2 else \
            f"passes of {' and '.join(map(str, w))} tokens"
    return ", ".join(one(s) for s in shapes)


#: What quick mode leaves out, by what it changes (:func:`prepare_for_chapter`'s ``quick``).
QUICK_CHANGES = {
    "rows": f"batch sizes {', '.join(map(str, QUICK_ROWS))} instead of "
            f"{', '.join(map(str, FULL_ROWS))}",
    "k": f"k = {QUICK_K} draft instead of {FULL_K}, so fewer verify passes",
}


def mode_line(quick_change: str | None) -> str:
    """Which mode a chapter's preparation runs in, where quick mode changes what it prepares
    (``quick_change``: a key of :data:`QUICK_CHANGES`); else nothing (no offer of a switch
    that changes nothing). How to set it in a notebook: ``%env``."""
    if quick_change is None:
        return ""
    change = QUICK_CHANGES[quick_change]
    if quick():
        return f"quick mode ({QUICK_ENV}=1: {change}); "
    return (f"full mode (for {change}, put `%env {QUICK_ENV}=1` in a cell at the top and run "
            f"all again); ")


def prepare_for_chapter(model: TinyLlama, shapes: Sequence[Shape], name: str = "model",
                        *, only: Iterable[int] | None = None, progress: bool = True,
                        quick: str | None = None) -> list[ShapeCost]:
    """Compile ``shapes`` of ``model`` on the fast path before a chapter times them
    (:func:`tinyserve.generate.prepare`: a progress bar, a line per compiled function),
    saying first which mode the chapter runs in and what it prepares, and after it what that
    cost. A function already held in this process costs nothing; one compiled by an earlier
    run (or chapter) is rebuilt from the persistent cache, faster than cold.

    ``only``: of the pass shapes (speculation's), compile just these widths now, so a chapter
    can split one set over cells, each within a notebook runner's per-cell time limit; the
    loops find every width held once all are prepared. (On CUDA a set is captured whole.)
    ``quick``: what quick mode changes in these shapes (a key of :data:`QUICK_CHANGES`),
    for the line that names the mode; None where it changes nothing (the mode goes unsaid)."""
    from ..generate import prepare
    mode = mode_line(quick)
    widths = None if only is None else sorted(set(only))
    if widths is not None and not any(w in s.widths for s in shapes for w in widths):
        # a chapter splits a pass set over cells sized for full mode; a smaller k leaves a
        # cell with no width of its own
        print(f"fast path, {mode}{name}: nothing left to prepare in this cell "
              f"({describe_shapes(shapes)}, prepared above)", flush=True)
        return []
    what = describe_shapes(shapes) + ("" if widths is None else
                                      f" (now the widths {', '.join(map(str, widths))})")
    print(f"fast path, {mode}{name}, window {TOKENS}: {what}", flush=True)
    start = time.perf_counter()
    if widths is None or model.device.type == "cuda":
        costs = prepare(model, shapes, progress=progress)
    else:
        costs = [cost for s in shapes for cost in _prepare_widths(model, s, widths)]
        from ..backends.fast import prepare_eager
        from ..paths import cache_dir
        packing = prepare_eager(model, say=print if progress else None,   # as prepare() does
                                cache=cache_dir())
        costs += [packing] if packing is not None else []
    fresh = sum(c.compiled for c in costs)
    print(f"prepared in {time.perf_counter() - start:.0f} s ({fresh} of {len(costs)} "
          f"function(s) built in this process, the rest held already)", flush=True)
    return costs


@torch.no_grad()
def _prepare_widths(model: TinyLlama, shape: Shape, widths: Sequence[int]) -> list[ShapeCost]:
    """Compile the ``widths`` of ``shape``'s pass set that are not held yet (a CPU): each by
    one pass of pad tokens at position 0, as :func:`tinyserve.backends.fast.prepare` does; a
    line per width. A decode shape is prepared whole."""
    from ..generate import prepare
    if not shape.widths:
        return prepare(model, [shape])
    from ..backends.fast import fast_passes
    from ..paths import cache_dir
    passes = fast_passes(model, shape.tokens, shape.widths, cache=cache_dir())
    costs = []
    try:
        for w in (w for w in widths if w in shape.widths):
            fresh = w not in passes.compile_seconds
            if fresh:
                passes.reset()
                passes.feed(torch.full((1, w), model.config.pad_token_id, device=model.device))
                passes.rewind(0)
            seconds = passes.compile_seconds[w] if fresh else 0.0
            label = f"pass width {w} x window {passes.window}"
            choice = getattr(passes, "choices", {}).get(w)      # what the width runs here
            print(f"{label}: {seconds:.1f} s" + ("" if fresh else " (held)")
                  + (f"; {choice.sentence()}" if choice is not None else ""), flush=True)
            costs.append(ShapeCost(label, seconds, fresh))
    finally:
        passes.release()
    return costs


@torch.no_grad()
def fast_step_seconds(model: TinyLlama, prompts: Tensor, n: int = 16, repeats: int = 3) -> float:
    """Seconds per fast decode step after ``prompts`` (B, T), the greedy token fed back, the
    fastest of ``repeats`` runs of ``n`` steps (:func:`~tinyserve.roofline.per_token_seconds`,
    as :func:`~tinyserve.roofline.eager_step_seconds` times eager): the compiled step of the
    shared window on a CPU, its CUDA graph on a GPU. B should be a bucket size (1, 2, 4, ...);
    the step compiles here unless :func:`prepare_for_chapter` prepared it."""
    from ..paths import cache_dir
    B, T = prompts.shape
    if T + n > TOKENS:
        raise ValueError(f"{T} prompt tokens + {n} steps do not fit the shared window of "
                         f"{TOKENS}; time fewer")
    if model.device.type == "cuda":
        from ..backends.cuda_graph import graph_decoder
        graphed = graph_decoder(model, B, tokens=TOKENS)
        try:
            first = graphed.prefill(prompts, [T] * B).argmax(-1)
            at = [T]

            def graph_step(tokens: Tensor, _positions: Tensor) -> Tensor:
                out = graphed.step(tokens, [at[0]] * B)   # positions known on the host
                at[0] += 1
                return out
            return per_token_seconds(graph_step, first, T, n, repeats,
                                     lambda: at.__setitem__(0, T))
        finally:
            graphed.release()
    from ..backends.fast import fast_decoder
    decoder = fast_decoder(model, B, TOKENS, cache=cache_dir())
    if decoder.cache.batch_size != B:
        raise ValueError(f"time the fast step at a bucket size, not {B}")
    first = decoder.prefill(prompts)[:, -1].argmax(-1)
    return per_token_seconds(decoder.step, first, T, n, repeats, lambda: None)


def fast_row_sweep(model: TinyLlama, prompts: Tensor, batches: Iterable[int], n: int = 8,
                   repeats: int = 3,
                   after: Callable[[RowPoint], None] | None = None) -> dict[int, RowPoint]:
    """For each ``B`` in ``batches``, the first B rows of ``prompts`` timed eagerly
    (:func:`~tinyserve.roofline.eager_step_seconds`) and on the fast path
    (:func:`fast_step_seconds`, ``compiled_s``), one after the other so both see the same
    moment of load; ``after(point)`` once each B is measured."""
    out = {}
    for B in batches:
        out[B] = RowPoint(B, eager_step_seconds(model, prompts[:B], n, repeats),
                          fast_step_seconds(model, prompts[:B], n, repeats))
        if after is not None:
            after(out[B])
    return out


@torch.no_grad()
def fast_pass_seconds(model: TinyLlama, widths: Sequence[int], timed: Iterable[int] | None = None,
                      context: int = 64, repeats: int = 15, seed: int = 0) -> dict[int, float]:
    """Seconds of one fast pass (one row) over ``w`` new tokens after ``context`` cached
    ones, for each ``w`` in ``timed`` (default: all of ``widths``): the passes the
    speculative loops run on the fast path (:func:`tinyserve.backends.fast.fast_passes`, the
    set of ``widths`` and the shared window naming which compiled set), the fastest of
    ``repeats`` after a warm-up, the cache rewound before each."""
    from ..backends.fast import fast_passes
    from ..paths import cache_dir
    timed = list(widths if timed is None else timed)
    if context + max(timed) > TOKENS:
        raise ValueError(f"{context} cached + {max(timed)} tokens exceed the window {TOKENS}")
    ids = torch.randint(0, model.config.vocab_size, (1, context + max(timed)),
                        generator=torch.Generator().manual_seed(seed)).to(model.device)
    passes = fast_passes(model, TOKENS, widths, cache=cache_dir())
    try:
        passes.reset()
        passes.prefill(ids[:, :context])
        return {w: min(timings(lambda w=w: passes.feed(ids[:, context:context + w]),
                               model.device, repeats, setup=lambda: passes.rewind(context)))
                for w in timed}
    finally:
        passes.release()
