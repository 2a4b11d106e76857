"""Pictures of a request's latency and of what each phase costs.

- :func:`latency_bars`: the two bars a user feels. TTFT = admission + queue + prefill (the
  wait before anything appears); completion = TTFT + every decode step (the wait for the
  whole answer). Drawing the decode steps one by one shows a stalled step as a wide block.
- :func:`phase_costs`: prefill time against prompt length, and decode time against output
  length, one line per series (e.g. with and without the KV cache).

Every function returns the matplotlib ``Figure`` (it never calls ``show``), so notebooks
display it and tests inspect it under the Agg backend.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure

from ..metrics import RequestTrace, summary_line

PHASE_COLORS = {"admission": "#9e9e9e", "queue": "#f4a261", "prefill": "#e76f51",
                "ttft": "#e76f51", "decode": ("#2a9d8f", "#76c7bd")}


def latency_segments(trace: RequestTrace) -> dict[str, object]:
    """The bars' pieces in milliseconds since arrival: admission, queue and prefill (which
    sum to TTFT) and the list of decode steps (which, after TTFT, sum to completion)."""
    if trace.admitted is None or trace.prefill_start is None or not trace.token_times:
        raise ValueError("the trace needs admitted, prefill_start and at least one token time")
    ms = lambda a, b: (b - a) * 1e3  # noqa: E731
    return {
        "admission": ms(trace.arrival, trace.admitted),
        "queue": ms(trace.admitted, trace.prefill_start),
        "prefill": ms(trace.prefill_start, trace.token_times[0]),  # up to the first token
        "decode_steps": [ms(a, b) for a, b in zip(trace.token_times, trace.token_times[1:])],
    }


def latency_bars(trace: RequestTrace) -> Figure:
    """Two horizontal bars: TTFT split into admission, queue and prefill; completion as TTFT
    followed by each decode step."""
    seg = latency_segments(trace)
    # TTFT is often a few percent of completion, too thin to read on the shared axis, so a
    # second panel draws it alone on its own scale (issue 17: every segment stays visible).
    fig = Figure(figsize=(9, 3.8), layout="constrained")
    ax, zoom = fig.subplots(2, 1, height_ratios=(2, 1))
    left = 0.0
    for name in ("admission", "queue", "prefill"):
        width = float(seg[name])  # type: ignore[arg-type]
        ax.barh("TTFT", width, left=left, color=PHASE_COLORS[name], label=name)
        left += width
    ttft_ms = left
    ax.barh("completion", ttft_ms, color=PHASE_COLORS["ttft"], alpha=0.6, label="TTFT")
    left = ttft_ms
    for i, width in enumerate(seg["decode_steps"]):  # type: ignore[arg-type]
        ax.barh("completion", width, left=left, color=PHASE_COLORS["decode"][i % 2],
                label="decode step" if i == 0 else None)
        left += width
    ax.invert_yaxis()  # TTFT on top: it happens first
    ax.set_xlabel("time since arrival (ms)")
    ax.set_title(summary_line(trace) if trace.finish is not None else "request latency",
                 fontsize=9)
    ax.legend(loc="lower right", fontsize=8, ncol=5)
    left = 0.0
    for name in ("admission", "queue", "prefill"):
        width = float(seg[name])  # type: ignore[arg-type]
        zoom.barh("TTFT", width, left=left, color=PHASE_COLORS[name])
        if width > 0.12 * ttft_ms:  # label the segments wide enough to hold their number
            zoom.text(left + width / 2, 0, f"{name} {width:.1f} ms", ha="center",
                      va="center", fontsize=8)
        left += width
    zoom.set_xlim(0, ttft_ms * 1.02 if ttft_ms > 0 else 1)
    zoom.set_xlabel("time since arrival (ms), TTFT only")
    zoom.set_title(f"TTFT zoomed: admission {float(seg['admission']):.2f} ms, queue "
                   f"{float(seg['queue']):.2f} ms, prefill {float(seg['prefill']):.2f} ms",
                   fontsize=9)
    return fig


def phase_costs(prefill: Mapping[str, Sequence[tuple[int, float]]],
                decode: Mapping[str, Sequence[tuple[int, float]]]) -> Figure:
    """Left: prefill time (ms) against prompt length; right: decode time (ms) against output
    length. Each mapping is series label -> [(tokens, milliseconds), ...]."""
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    ax_p, ax_d = fig.subplots(1, 2)
    for ax, series, xlabel, title in (
            (ax_p, prefill, "prompt length (tokens)", "prefill: one pass over the prompt"),
            (ax_d, decode, "output length (tokens)", "decode: one pass per output token")):
        for label, points in series.items():
            xs, ys = zip(*sorted(points)) if points else ((), ())
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("time (ms)")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)  # from zero, so a ratio reads off the picture honestly
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=8)
    return fig
