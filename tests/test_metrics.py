"""Metrics from hand-built timestamps: each definition checked against numbers worked by hand
(vLLM benchmark_serving conventions)."""
from __future__ import annotations

import pytest

from tinyserve.metrics import (RequestTrace, decode_tokens_per_s, e2e, itl, output_tokens_per_s,
                               percentile, prefill_tokens_per_s, summarize, summary_line, tpot,
                               ttft)


def _trace() -> RequestTrace:
    # Arrives at 10.0 s, waits 0.5 s in the queue, prefill of 100 tokens takes 0.2 s, the first
    # token is sampled at 10.75; then gaps of 0.1, 0.1, 0.4 (one slow step); finish at 11.40.
    return RequestTrace(prompt_tokens=100, arrival=10.0, admitted=10.05, prefill_start=10.5,
                        prefill_end=10.7, token_times=[10.75, 10.85, 10.95, 11.35],
                        finish=11.40)


def test_ttft_is_first_token_minus_arrival() -> None:
    assert ttft(_trace()) == pytest.approx(0.75)


def test_itl_is_every_gap() -> None:
    assert itl(_trace()) == pytest.approx([0.1, 0.1, 0.4])


def test_e2e_is_finish_minus_arrival() -> None:
    assert e2e(_trace()) == pytest.approx(1.40)


def test_tpot_excludes_the_first_token() -> None:
    # (E2E - TTFT) / (n - 1) = (1.40 - 0.75) / 3
    assert tpot(_trace()) == pytest.approx(0.65 / 3)
    one = RequestTrace(prompt_tokens=3, arrival=0.0, token_times=[0.2], finish=0.2)
    assert tpot(one) is None and itl(one) == []


def test_tokens_per_second_by_phase() -> None:
    t = _trace()
    assert prefill_tokens_per_s(t) == pytest.approx(100 / 0.2)
    assert decode_tokens_per_s(t) == pytest.approx(3 / 0.6)
    # The naive overall rate hides both phases: 4 tokens over 1.4 s.
    assert output_tokens_per_s(t) == pytest.approx(4 / 1.4)


def test_percentiles_interpolate_linearly() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_summary_pools_itl_across_requests_and_uses_vllm_names() -> None:
    a = _trace()
    b = RequestTrace(prompt_tokens=10, arrival=0.0, token_times=[0.1, 0.3], finish=0.3)
    s = summarize([a, b])
    assert s["completed"] == 2 and s["total_output_tokens"] == 6 and s["total_input_tokens"] == 110
    assert s["mean_ttft_ms"] == pytest.approx((750 + 100) / 2)
    assert s["median_itl_ms"] == pytest.approx(150.0)           # gaps 100, 100, 400, 200 ms
    assert s["mean_itl_ms"] == pytest.approx(200.0)
    assert s["p99_itl_ms"] == pytest.approx(percentile([100, 100, 400, 200], 99))
    assert s["mean_tpot_ms"] == pytest.approx((650 / 3 + 200) / 2)
    assert s["median_e2el_ms"] == pytest.approx((1400 + 300) / 2)


def test_missing_timestamps_are_named() -> None:
    with pytest.raises(ValueError, match="no tokens"):
        ttft(RequestTrace(prompt_tokens=1, arrival=0.0))
    with pytest.raises(ValueError, match="no finish timestamp"):
        e2e(RequestTrace(prompt_tokens=1, arrival=0.0, token_times=[1.0]))


def test_summary_line_reports_ttft_itl_and_rates() -> None:
    line = summary_line(_trace())
    assert "TTFT 750.0 ms" in line and "ITL p50 100.00 ms" in line and "tok/s" in line


def test_one_slo_and_one_summary_for_engine_traces_and_client_results() -> None:
    """A trace and the load generator's Result with the same timeline are the same request to
    SLO.met and summarize (both are RequestTimes)."""
    from tinyserve.loadgen.generator import Result
    from tinyserve.metrics import SLO
    trace = _trace()
    client = Result(prompt_tokens=100, start=10.0, chunk_times=list(trace.token_times),
                    end=trace.finish, output_tokens=4, ok=True)
    assert summarize([client]) == pytest.approx(summarize([trace]))
    for slo in (SLO(), SLO(ttft_ms=750.1), SLO(ttft_ms=749), SLO(tpot_ms=217),
                SLO(tpot_ms=216), SLO(e2el_ms=1399)):
        assert slo.met(client) == slo.met(trace), slo
    assert SLO(ttft_ms=750.1, tpot_ms=217).met(trace) and not SLO(e2el_ms=1399).met(trace)
