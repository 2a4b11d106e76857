"""Chapter 6b's long-context section: the plan of what it times, and the lines it prints.

The measuring is :mod:`tinyserve.long_context` (caches filled directly, steps in turns, the
fit); this module chooses the contexts (fewer in quick mode, :func:`tinyserve.workbook.
fast_lab.quick`) and writes each printed line from the figures, so the notebook's cells stay
a few lines each and ``bench scale_long_context`` prints the same split.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..long_context import ContextFit

#: A context short enough that its KV reads are a rounding error: the step's weights alone.
SHORT = 64


@dataclass(frozen=True)
class Plan:
    """Contexts as multiples of the predicted crossover (plus :data:`SHORT`), steps a run,
    rounds in turns, and rounds for the levers."""
    multiples: tuple[float, ...]
    n: int
    rounds: int
    lever_rounds: int


FULL = Plan((0.5, 1.0, 1.5, 2.0), n=4, rounds=3, lever_rounds=2)
QUICK = Plan((1.0, 2.0), n=2, rounds=1, lever_rounds=1)


def plan(quick: bool) -> Plan:
    return QUICK if quick else FULL


def contexts(crossover: float, chosen: Plan) -> list[int]:
    """:data:`SHORT` and the plan's multiples of ``crossover``, in cached tokens."""
    return [SHORT, *(round(m * crossover) for m in chosen.multiples)]


def split_lines(steps: dict[int, float], fit: ContextFit, weight_bytes: float,
                kv_token_bytes: float, bandwidth: float) -> list[str]:
    """One line per context: the step's time, its weights part (the fit's fixed part) and its
    KV part (the rest), each beside the time its bytes take at ``bandwidth``, and the MBU."""
    lines = [f"{'context':>8s} {'step':>9s} {'weights part':>13s} {'(floor)':>9s} "
             f"{'KV part':>9s} {'(floor)':>9s} {'KV share of bytes':>18s} {'MBU':>5s}"]
    for context, seconds in sorted(steps.items()):
        kv_bytes = context * kv_token_bytes
        kv_part = seconds - fit.fixed_s
        mbu = (weight_bytes + kv_bytes) / bandwidth / seconds
        lines.append(f"{context:8,d} {seconds * 1e3:7.1f}ms {fit.fixed_s * 1e3:11.1f}ms "
                     f"{weight_bytes / bandwidth * 1e3:7.1f}ms {kv_part * 1e3:7.1f}ms "
                     f"{kv_bytes / bandwidth * 1e3:7.1f}ms "
                     f"{kv_bytes / (weight_bytes + kv_bytes):17.0%} {mbu:5.2f}")
    return lines


def rate_lines(fit: ContextFit, weight_bytes: float, kv_token_bytes: float,
               bandwidth: float, predicted: float) -> list[str]:
    """The two read rates the fit implies, against ``bandwidth``, and the two crossovers."""
    weights_rate, kv_rate = fit.read_rates(weight_bytes, kv_token_bytes)
    return [f"weights read at {weights_rate / 1e9:5.1f} GB/s "
            f"({weights_rate / bandwidth:.2f} of the fastest read, {bandwidth / 1e9:.1f} GB/s)",
            f"KV cache read at {kv_rate / 1e9:5.1f} GB/s ({kv_rate / bandwidth:.2f} of it)",
            f"crossover by bytes: {predicted:,.0f} tokens; measured (where the KV part equals "
            f"the weights part): {fit.crossover:,.0f} tokens, {fit.crossover / predicted:.2f}x "
            f"the bytes' (= the KV rate over the weights' rate)"]


def lever_lines(levers: dict[str, tuple[float, float]], base: str) -> list[str]:
    """``levers`` maps a name to (bytes a step reads, seconds a step): a line each with both,
    and each as a multiple of ``base``'s."""
    base_bytes, base_s = levers[base]
    return [f"{name:30s} {nbytes / 1e6:6,.0f} MB a step ({nbytes / base_bytes:4.2f}x the "
            f"bytes), {seconds * 1e3:7.1f} ms ({seconds / base_s:4.2f}x the time)"
            for name, (nbytes, seconds) in levers.items()]
