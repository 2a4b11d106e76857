"""``bench scale``'s fast batch-1 decode step against eager's, as the loops run them, in turns:
whether the fast path loses to eager here (issue 50 asks that it never does;
``scale_fast_vs_eager_b1``, and the engine's ``scale_engine_fast_vs_eager_b1`` from
:func:`.scale.engine_fast`'s rounds).

Why in turns and per round: on a shared machine a step's time drifts by a large fraction of
itself from one minute to the next, so a fast run timed in one moment and an eager run in
another compare the moments. Each round runs both seconds apart; the ratio of the two from
the same round cancels a busy spell, and the median over rounds is quoted
(:mod:`._loops_step` says the same of the MBU).

A loop's decode step here is what a request waits between two tokens: the gap between two
consecutive token times of a ``generate`` trace (the step, sampling, the token read back),
the median gap of a run, so one interrupted step does not move it.
"""
from __future__ import annotations

from collections.abc import Sequence
import functools
import statistics
from typing import Any

import torch

from tinyserve.generate import generate
from tinyserve.model import TinyLlama

from ..common import in_turns
from ._fast_choices import batch1

__all__ = ["decode_step_seconds", "in_turns_figures", "loops_fast_vs_eager", "notes"]


def decode_step_seconds(token_times: Sequence[float]) -> float:
    """The median gap between consecutive token times of one request: its decode step as a
    loop runs it (the first token comes from the prefill, so a trace of n tokens has n - 1
    decode steps)."""
    gaps = [b - a for a, b in zip(token_times, token_times[1:])]
    if not gaps:
        raise ValueError("a decode step needs a trace of two tokens or more")
    return statistics.median(gaps)


def in_turns_figures(fast_s: Sequence[float], eager_s: Sequence[float]) -> dict[str, Any]:
    """From the same rounds' fast and eager step seconds: each round's fast / eager, their
    median (the ratio quoted: below 1 the fast step was faster), and each side's
    milliseconds per round and median."""
    rounds = [f / e for f, e in zip(fast_s, eager_s, strict=True)]
    if not rounds:
        raise ValueError("no rounds to compare")
    return {"ratio": statistics.median(rounds), "ratio_rounds": rounds,
            "fast_ms": [1e3 * s for s in fast_s], "eager_ms": [1e3 * s for s in eager_s],
            "fast_median_ms": 1e3 * statistics.median(fast_s),
            "eager_median_ms": 1e3 * statistics.median(eager_s)}


@torch.no_grad()
def loops_fast_vs_eager(model: TinyLlama, prompt: list[int], n: int,
                        rounds: int) -> dict[str, Any]:
    """``generate(model, prompt, n, path="fast")`` against ``path="auto"`` (greedy), one of each
    a round for ``rounds`` rounds after one untimed round (the fast side's first request
    prepares its shape there, unless it is held already): each run's decode step
    (:func:`decode_step_seconds`), :func:`in_turns_figures` of them, and whether both sides
    emitted the same tokens (the fast path's promise; recorded, not asserted: the tests
    assert it)."""
    def run(fast: bool) -> tuple[float, list[int]]:
        trace = generate(model, prompt, n, path="fast" if fast else "auto")
        return decode_step_seconds(trace.token_times), list(trace.tokens)
    runs = in_turns({"fast": functools.partial(run, True),
                     "eager": functools.partial(run, False)}, rounds)
    tokens = [t for _, t in runs["fast"] + runs["eager"]]
    return {**in_turns_figures([s for s, _ in runs["fast"]], [s for s, _ in runs["eager"]]),
            "tokens_equal": all(t == tokens[0] for t in tokens),
            "prompt_tokens": len(prompt), "new_tokens": n, "rounds": rounds}


def _rounds(f: dict[str, Any]) -> str:
    r = f["ratio_rounds"]
    return (f"median of {len(r)} rounds in turns; per round {min(r):.2f} to {max(r):.2f}x")


def _choice_clause(choice: dict[str, Any] | None, f: dict[str, Any], missed: bool) -> str:
    """'; its shape (...) runs ...' and, where the goal was missed, what the choice's own
    timing said against what the rounds measured."""
    if choice is None:
        return "; no choice recorded for its shape (CUDA graphs, or the shape never ran)"
    text = f"; its shape ({choice['shape']}) runs {choice['sentence']}"
    if not missed:
        return text
    timed = choice["seconds"]
    if choice["kernel"] == "compiled" and "eager" in timed:
        return (text + f": at its first step the compiled step timed "
                f"{1e3 * timed['compiled']:.2f} ms against the same shape eager "
                f"{1e3 * timed['eager']:.2f}, and in the rounds the fast step took "
                f"{f['fast_median_ms']:.2f} against the eager path's "
                f"{f['eager_median_ms']:.2f}: the choice holds the compiled step against "
                f"eager on the fast path's own static buffers, not against the eager path's")
    return (text + f": the fast step then runs the forward pass eagerly on the fast path's "
            f"static buffers (every slot of its window, masked), where the eager path's "
            f"cache holds only the tokens so far; the choice times the ways of the first, "
            f"never the second")


def notes(m: dict[str, Any], missed: set[str]) -> dict[str, str]:
    """The sentences of ``scale_fast_vs_eager_b1`` and ``scale_engine_fast_vs_eager_b1``,
    met or not: both steps' medians, the spread of the rounds, and which way the batch-1
    shape chose here with the times that chose it (``m["fast_choices"]``)."""
    out: dict[str, str] = {}
    choices = m.get("fast_choices", [])
    f = m.get("fast_vs_eager", {})
    if "ratio" in f:
        name = "scale_fast_vs_eager_b1"
        out[name] = (
            f"the loops' batch-1 decode step (generate, {f['new_tokens']} tokens after a "
            f"{f['prompt_tokens']}-token prompt, the median gap between tokens) took "
            f"{f['fast_median_ms']:.2f} ms with path='fast' against {f['eager_median_ms']:.2f} "
            f"with path='auto' ({_rounds(f)})"
            + ("" if f["tokens_equal"] else "; the two paths' tokens differed")
            + _choice_clause(batch1(choices, "loops", "decode"), f, name in missed))
    e = m.get("engine_fast", {}).get("fast_vs_eager_b1", {})
    if "ratio" in e:
        name = "scale_engine_fast_vs_eager_b1"
        out[name] = (
            f"the engine's batch-1 decode step (each run's median pure-decode step) took "
            f"{e['fast_median_ms']:.2f} ms with EngineConfig(path='fast') against "
            f"{e['eager_median_ms']:.2f} with path='auto' ({_rounds(e)})"
            + _choice_clause(batch1(choices, "engine", "engine decode"), e, name in missed))
    return out
