"""The lab widget's chart, without a browser (the browser half is in test_e2e_learner.py):
drawn only once a guess is committed, hidden with the answer when the case changes.

Runs everywhere (no Chromium needed): it exercises the widget objects in Python.
"""
from __future__ import annotations

from tinyserve.workbook.lab import KVCacheLab, KVCase, growth_chart_png

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_chart_is_a_png_for_any_guess() -> None:
    case = KVCase(layers=32, kv_heads=8, head_dim=128, dtype="fp16", tokens=8192)
    for guess in (None, 1.0, 500.0):   # none, on the chart, far off it (said in the legend)
        png = growth_chart_png(case, guess)
        assert png.startswith(PNG_SIGNATURE) and len(png) > 5_000


def test_chart_follows_the_answer_in_the_widget() -> None:
    lab = KVCacheLab(layers=32, kv_heads=8, head_dim=128, dtype="fp16", tokens=8192)
    lab.ui()
    controls = lab._ui
    assert controls.chart.layout.display == "none" and bytes(controls.chart.value) == b""
    controls.guess.value = "1"
    assert controls.chart.layout.display == "none"          # typed, not committed
    controls._on_commit()
    assert controls.chart.layout.display is None
    assert bytes(controls.chart.value).startswith(PNG_SIGNATURE)
    controls.inputs["tokens"].value = 16384                 # a new case: predict again
    assert controls.chart.layout.display == "none" and bytes(controls.chart.value) == b""
