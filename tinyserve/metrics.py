"""Latency metrics of a request, from its timestamps, as the serving benchmarks define them.

Definitions follow vLLM's ``benchmark_serving`` (and the course glossary):

- **TTFT** (time to first token) = first token time - arrival. It covers admission, queueing
  and prefill: everything before the user sees anything.
- **ITL** (inter-token latency) = every gap between two consecutive output tokens. A request
  with n tokens has n - 1 of them; across requests the lists are pooled, so one stalled step
  shows up in the p99 even when the mean hides it.
- **TPOT** (time per output token) = (E2E - TTFT) / (output tokens - 1): the mean decode
  gap of one request, undefined for a single-token output (the first token is TTFT's).
- **E2E** (end-to-end latency) = finish - arrival.
- Percentiles use linear interpolation (``numpy.percentile``'s default), as vLLM does.

All times are seconds from ``time.perf_counter``; reports convert to milliseconds.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


@dataclass
class RequestTrace:
    """The timeline of one request. Times are ``time.perf_counter()`` seconds.

    arrival -> admitted (checked, KV memory reserved) -> prefill_start (left the queue)
    -> prefill_end -> token_times[0] (first token sampled) -> ... -> finish.
    """

    prompt_tokens: int
    arrival: float
    admitted: float | None = None
    prefill_start: float | None = None
    prefill_end: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None
    finish_reason: str | None = None   # "length", "stop" or "window"
    tokens: list[int] = field(default_factory=list)
    use_cache: bool = True

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    # The RequestTimes protocol, so SLO.met and summarize read a trace as they read a client's
    # view of a request (tinyserve.loadgen's Result).
    @property
    def ttft(self) -> float:
        return ttft(self)

    @property
    def tpot(self) -> float | None:
        return tpot(self)

    @property
    def e2e(self) -> float:
        return e2e(self)

    @property
    def itl(self) -> list[float]:
        return itl(self)


class RequestTimes(Protocol):
    """What the latency figures read of one request, in seconds: the engine's
    :class:`RequestTrace` (server side) and the load generator's ``Result`` (client side)."""

    prompt_tokens: int

    @property
    def output_tokens(self) -> int: ...
    @property
    def ttft(self) -> float: ...
    @property
    def tpot(self) -> float | None: ...
    @property
    def e2e(self) -> float: ...
    @property
    def itl(self) -> list[float]: ...


def _require(value: float | None, name: str) -> float:
    if value is None:
        raise ValueError(f"the trace has no {name} timestamp; was the request run to the end?")
    return value


def ttft(trace: RequestTrace) -> float:
    """Seconds from arrival to the first output token."""
    if not trace.token_times:
        raise ValueError("the request produced no tokens, so it has no time to first token")
    return trace.token_times[0] - trace.arrival


def itl(trace: RequestTrace) -> list[float]:
    """Every gap between consecutive output tokens (n - 1 values for n tokens)."""
    t = trace.token_times
    return [b - a for a, b in zip(t, t[1:])]


def e2e(trace: RequestTrace) -> float:
    """Seconds from arrival to finish."""
    return _require(trace.finish, "finish") - trace.arrival


def tpot(trace: RequestTrace) -> float | None:
    """(E2E - TTFT) / (output tokens - 1); None when there is one token or none."""
    n = trace.output_tokens
    if n < 2:
        return None
    return (e2e(trace) - ttft(trace)) / (n - 1)


def prefill_tokens_per_s(trace: RequestTrace) -> float:
    """Prompt tokens processed per second of the prefill forward pass."""
    seconds = _require(trace.prefill_end, "prefill_end") - _require(trace.prefill_start, "prefill_start")
    return trace.prompt_tokens / seconds


def decode_tokens_per_s(trace: RequestTrace) -> float | None:
    """Output tokens per second after the first (the decode phase); None for < 2 tokens."""
    n = trace.output_tokens
    if n < 2:
        return None
    return (n - 1) / (trace.token_times[-1] - trace.token_times[0])


def output_tokens_per_s(trace: RequestTrace) -> float:
    """Output tokens over the whole request (what a naive "tokens/s" reports: it mixes the
    prefill wait into the rate, so it says nothing about either phase)."""
    return trace.output_tokens / e2e(trace)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear interpolation between the closest ranks."""
    if not len(values):
        raise ValueError("no values to take a percentile of")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarize(traces: Sequence[RequestTimes],
              percentiles: Sequence[float] = (50, 90, 99)) -> dict[str, Any]:
    """Mean, median and percentiles of TTFT, TPOT, ITL and E2E in milliseconds, with the
    key names of vLLM's benchmark report (``mean_ttft_ms``, ``p99_itl_ms`` ...), of completed
    requests: engine traces or the load generator's results."""
    if not traces:
        raise ValueError("no requests to summarize")
    series = {
        "ttft": [t.ttft for t in traces],
        "tpot": [x for t in traces if (x := t.tpot) is not None],
        "itl": [gap for t in traces for gap in t.itl],   # pooled across requests
        "e2el": [t.e2e for t in traces],
    }
    out: dict[str, Any] = {"completed": len(traces),
                           "total_output_tokens": sum(t.output_tokens for t in traces),
                           "total_input_tokens": sum(t.prompt_tokens for t in traces)}
    for name, values in series.items():
        ms = [v * 1e3 for v in values]
        if not ms:  # e.g. every request produced one token: no TPOT or ITL exists
            continue
        out[f"mean_{name}_ms"] = float(np.mean(ms))
        out[f"median_{name}_ms"] = float(np.median(ms))
        for q in percentiles:
            out[f"p{q:g}_{name}_ms"] = percentile(ms, q)
    return out


def summary_line(trace: RequestTrace) -> str:
    """One human line: TTFT, ITL p50/p99, decode and overall tokens/s."""
    parts = [f"{trace.output_tokens} tokens", f"TTFT {ttft(trace) * 1e3:.1f} ms"]
    gaps = itl(trace)
    if gaps:
        parts.append(f"ITL p50 {percentile(gaps, 50) * 1e3:.2f} ms / "
                     f"p99 {percentile(gaps, 99) * 1e3:.2f} ms")
        parts.append(f"decode {decode_tokens_per_s(trace):.1f} tok/s")
    parts.append(f"overall {output_tokens_per_s(trace):.1f} tok/s")
    parts.append("KV cache" if trace.use_cache else "no cache")
    return ", ".join(parts)


@dataclass(frozen=True)
class SLO:
    """Service-level objectives a request must meet to count toward goodput, in milliseconds
    (None = no limit). The one SLO type: the engine's traces and the load generator's results
    are both :class:`RequestTimes`."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def met(self, request: RequestTimes) -> bool:
        checks = ((self.ttft_ms, request.ttft), (self.tpot_ms, request.tpot),
                  (self.e2el_ms, request.e2e))
        return all(limit is None or value is None or value * 1e3 <= limit
                   for limit, value in checks)


def throughput(traces: Sequence[RequestTrace], slo: SLO | None = None) -> dict[str, float]:
    """Request and output-token throughput over the run's span (first arrival to last
    finish), and **goodput**: completed requests per second that met every SLO.

    Goodput is what a fleet is sized on: requests served too late count for nothing, so a
    policy that raises throughput by making some users wait past the SLO can lower it."""
    if not traces:
        raise ValueError("no requests to measure")
    span = max(_require(t.finish, "finish") for t in traces) - min(t.arrival for t in traces)
    good = sum(1 for t in traces if slo is None or slo.met(t))
    return {"duration_s": span,
            "request_throughput": len(traces) / span,
            "output_throughput": sum(t.output_tokens for t in traces) / span,
            "goodput": good / span,
            "slo_attainment": good / len(traces)}
