"""``bench scale``'s decode step on the loops' path, timed in turns with the read probe it is
judged against (``scale_decode_mbu_b1``, ``scale_step_rows4_vs_rows1``).

Why in turns: on a shared machine the same eager step (the scale model, one thread, fastest
of 3 runs of 16 steps, a new process each minute) can move by a large fraction of itself from
one minute to the next, and the read probe with it. Taken in turns, the probe is read in the
same minutes as the steps, so the fastest read it finds is one the machine gave while the
steps ran. Each round's step is held against the run's fastest read (the most any probe of
the run read; :func:`paired_figures`' ``roof``), the median over rounds quoted: a busy round
slows its step, and the median sets it aside. A round's own probe is not the roof: a probe
can read slower than a step of the same round (seen in a run of this suite: the engine's
compiled step streamed its weights faster than the probe beside it read its buffer, in every
round), which would put the step above the memory (an MBU over 1).
"""
from __future__ import annotations

from collections.abc import Callable
import statistics
from typing import Any

import torch

from tinyserve.model import TinyLlama
from tinyserve.paths import cache_dir
from tinyserve.roofline import decode_cost, eager_step_seconds, per_token_seconds, read_bandwidth

from ..common import in_turns

__all__ = ["PROBE_BYTES", "loops_step_in_turns", "paired_figures"]

#: The probe's buffer: far above any last-level cache the course has met (32 and 105 MiB).
PROBE_BYTES = 512 * 2**20


@torch.no_grad()
def _fast_step(model: TinyLlama, prompts: torch.Tensor, n: int) -> Callable[[], float]:
    """The fast path's decode step for ``prompts`` (B, T), B a bucket (what
    ``generate_batch(..., path="fast")`` runs), prepared now (its first step chooses what every
    step runs here: compiled, eager over packed weights or eager): a function timing ``n``
    steps (seconds per step, one untimed run first)."""
    from tinyserve.backends.fast import fast_decoder
    B, T = prompts.shape
    decoder = fast_decoder(model, B, T + n, cache=cache_dir())
    first = decoder.prefill(prompts)[:, -1].argmax(-1)
    decoder.step(first, torch.full_like(first, T))          # compiles, and chooses
    return lambda: per_token_seconds(decoder.step, first, T, n, 1, lambda: None)


@torch.no_grad()
def loops_step_in_turns(model: TinyLlama, prompts: torch.Tensor, n: int, rounds: int,
                        probe_bytes: int = PROBE_BYTES) -> dict[str, Any]:
    """The loops' fast decode step at 1 and 4 rows (``prompts``: at least 4 rows of T
    tokens), the eager batch-1 step, and :func:`~tinyserve.roofline.read_bandwidth` over
    ``probe_bytes``, called in turns for ``rounds`` rounds after one untimed round: each
    call's seconds per step (or the probe's best rate), by name, one per round; and
    :func:`paired_figures` from them."""
    T = prompts.shape[1]
    device = model.device
    fns = {"fast_1": _fast_step(model, prompts[:1], n),
           "fast_4": _fast_step(model, prompts[:4], n),
           "eager_1": lambda: eager_step_seconds(model, prompts[:1], n, 1),
           "probe": lambda: read_bandwidth(device, probe_bytes, 2).best}
    runs = in_turns(fns, rounds)
    context = T + n // 2                       # the steps' mean position, as the sweep's
    return {"rounds": runs, "context": context,
            **paired_figures(runs, decode_cost(model, 1, context).bytes)}


def paired_figures(runs: dict[str, list[float]], step_bytes: int,
                   roof: float | None = None) -> dict[str, Any]:
    """From :func:`loops_step_in_turns`'s rounds: each path's MBU per round (its step's
    bytes over ``roof``, the run's fastest read in bytes a second, and the round's step time;
    default: the fastest of these rounds' probes) and their medians, the 4-row step over the
    1-row step per round and its median, and each figure's median time."""
    roof = max(runs["probe"]) if roof is None else roof

    def mbu_rounds(path: str) -> list[float]:
        return [step_bytes / roof / s for s in runs[path]]
    fast, eager = mbu_rounds("fast_1"), mbu_rounds("eager_1")
    rows4 = [a / b for a, b in zip(runs["fast_4"], runs["fast_1"], strict=True)]
    return {"bytes": step_bytes, "roof_gb_per_s": roof / 1e9,
            "mbu_fast": statistics.median(fast), "mbu_eager": statistics.median(eager),
            "mbu_fast_rounds": fast, "mbu_eager_rounds": eager,
            "rows4_vs_rows1": statistics.median(rows4), "rows4_vs_rows1_rounds": rows4,
            "median_ms": {k: 1e3 * statistics.median(v) for k, v in runs.items()
                          if k != "probe"},
            "probe_gb_per_s": {"median": statistics.median(runs["probe"]) / 1e9,
                               "min": min(runs["probe"]) / 1e9,
                               "max": max(runs["probe"]) / 1e9}}
