"""Plots: the latency bars add up to TTFT and completion, axes carry units, figures render
headless (Agg)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402

from tinyserve.metrics import RequestTrace, e2e, ttft  # noqa: E402
from tinyserve.workbook.plots import latency_bars, latency_segments, phase_costs  # noqa: E402


def _trace() -> RequestTrace:
    return RequestTrace(prompt_tokens=100, arrival=10.0, admitted=10.05, prefill_start=10.5,
                        prefill_end=10.7, token_times=[10.75, 10.85, 10.95, 11.35], finish=11.35)


def _render(fig) -> None:  # type: ignore[no-untyped-def]
    FigureCanvasAgg(fig).draw()


def test_segments_sum_to_ttft_and_completion() -> None:
    t = _trace()
    seg = latency_segments(t)
    assert seg["admission"] == pytest.approx(50) and seg["queue"] == pytest.approx(450)
    assert seg["admission"] + seg["queue"] + seg["prefill"] == pytest.approx(ttft(t) * 1e3)
    assert seg["prefill"] + seg["admission"] + seg["queue"] + sum(seg["decode_steps"]) == \
        pytest.approx(e2e(t) * 1e3)


def test_latency_bars_draw_two_bars_with_units() -> None:
    fig = latency_bars(_trace())
    _render(fig)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "time since arrival (ms)"
    assert {t.get_text() for t in ax.get_yticklabels()} == {"TTFT", "completion"}
    # 3 TTFT pieces + 1 TTFT block + 3 decode steps; the longest bar ends at completion.
    ends = [p.get_x() + p.get_width() for p in ax.patches]
    assert len(ax.patches) == 7 and max(ends) == pytest.approx(1350)


def test_latency_bars_zoom_keeps_every_ttft_segment_visible() -> None:
    fig = latency_bars(_trace())
    _render(fig)
    zoom = fig.axes[1]
    assert zoom.get_xlabel() == "time since arrival (ms), TTFT only"
    # TTFT is 750 ms of a 1,350 ms request; the zoom spans TTFT alone, so prefill (250 ms)
    # (to the first token) fills a third of its width, not a sliver of the shared axis.
    assert zoom.get_xlim()[1] == pytest.approx(750 * 1.02)
    assert [round(p.get_width()) for p in zoom.patches] == [50, 450, 250]
    assert "prefill 250.00 ms" in zoom.get_title()


def test_phase_costs_label_both_axes() -> None:
    fig = phase_costs({"KV cache": [(16, 2.0), (64, 5.0)], "no cache": [(16, 2.0), (64, 5.5)]},
                      {"KV cache": [(8, 20.0), (32, 80.0)]})
    _render(fig)
    left, right = fig.axes
    assert left.get_xlabel() == "prompt length (tokens)" and left.get_ylabel() == "time (ms)"
    assert right.get_xlabel() == "output length (tokens)" and right.get_ylabel() == "time (ms)"
    assert len(left.lines) == 2 and len(right.lines) == 1


def test_incomplete_trace_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        latency_bars(RequestTrace(prompt_tokens=1, arrival=0.0, admitted=0.0, prefill_start=0.0))


def test_latency_bars_of_a_real_request() -> None:
    import torch

    from tinyserve.config import ModelConfig
    from tinyserve.generate import generate
    from tinyserve.model import TinyLlama
    torch.manual_seed(0)
    model = TinyLlama(ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, max_position_embeddings=32)).eval()
    trace = generate(model, [1, 2, 3], 5)
    fig = latency_bars(trace)
    _render(fig)
    assert len(fig.axes[0].patches) == 3 + 1 + 4
