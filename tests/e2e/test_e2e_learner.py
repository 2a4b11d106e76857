"""A learner's first hour in a real browser: `make lab` opens a learner's Lab (no instructor
tools, Validate only on assignments) on the landing page, the first
graded exercise runs, its predict-first widget answers input and draws its chart, and the
Validate button reports the visible tests, naming the learner's mistake.

Works on a copy of the course (exercises as released, no solutions) so nothing in the
repository changes. About 40 s on 2 cores; screenshots in artifacts/e2e/test_learner_.../.
"""
from __future__ import annotations

import re
from pathlib import Path

from playwright.sync_api import Page, expect

from .jlab import (close_dialog, copy_course, current_notebook, replace_cell_source, reveal,
                  run_all_cells, validate)

# What a learner types into 1a: first with the classic slip (no factor 2 for K and V), then right.
KV_BYTES_NO_FACTOR_2 = ("def kv_bytes(layers, tokens, kv_heads, head_dim, bytes_per_elem):\n"
                        "    return layers * tokens * kv_heads * head_dim * bytes_per_elem")
KV_BYTES_RIGHT = ("def kv_bytes(layers, tokens, kv_heads, head_dim, bytes_per_elem):\n"
                  "    return 2 * layers * tokens * kv_heads * head_dim * bytes_per_elem")
# testkit's failure prefix for 1a's visible check; the check's *source* (also shown by
# Validate) lists the mistakes, so only the error line proves the check ran and failed.
KV_BYTES_FAILED = "[kv_bytes(32, 8192, 8, 128, 2)] got 536,870,912: half the expected size"


def test_learner_runs_the_first_exercise_and_validates(start_lab, page: Page,
                                                       artifacts: Path, tmp_path: Path) -> None:
    course = copy_course(tmp_path / "course", "START_HERE.ipynb", "nbgrader_config.py",
                         "course", "exercises")
    lab = start_lab(course)

    # 1. The landing page opens by itself and links to the exercise.
    page.goto(lab.url + "/")
    landing = current_notebook(page)
    landing.get_by_role("heading", name="Start here").wait_for()
    expect(landing.get_by_role("heading", name="The four-hour path")).to_be_visible()
    page.screenshot(path=str(artifacts / "01-landing.png"))
    # `make lab` printed the address last, and opened a learner's Lab: none of nbgrader's
    # instructor tools, and no Validate button on a notebook that is not an assignment.
    assert lab.printed()[-1] == f"{lab.url}/lab/tree/START_HERE.ipynb", lab.printed()[-3:]
    expect(page.locator(".lm-MenuBar-item").filter(has_text="Run")).to_be_visible()
    expect(page.locator(".lm-MenuBar-item").filter(has_text="Nbgrader")).to_have_count(0)
    expect(page.locator(".lm-TabBar-tab[title='Nbgrader Create Assignment']")).to_have_count(0)
    expect(landing.locator(".validate-button")).to_have_count(1)   # added by nbgrader...
    expect(landing.locator(".validate-button")).to_be_hidden()     # ...hidden by the course
    landing.get_by_role("link", name="exercises/kv_cache_basics").click()

    # 2. Run all cells: the warm-up widget renders (later cells stop at the first blank answer).
    nb = current_notebook(page)
    nb.get_by_role("heading", name="Warm-up").wait_for()
    expect(nb.locator(".validate-button")).to_be_visible()        # an assignment: Validate
    run_all_cells(page)
    widget = reveal(nb.locator(".widget-vbox").filter(has_text="Predict first"))
    answer = widget.locator("pre")
    expect(answer).to_have_text("Answer hidden: type your guess in GB and press Commit.")
    chart = widget.locator(".widget-image")
    expect(chart).to_be_hidden()
    page.screenshot(path=str(artifacts / "02-widget.png"))

    # 3. It responds: a committed guess reveals the answer and draws the chart...
    widget.get_by_placeholder("e.g. 0.5").fill("1")
    widget.get_by_role("button", name="Commit guess").click()
    expect(answer).to_contain_text("= 1,073,741,824 bytes")
    expect(answer).to_contain_text("Your guess, 1 GB: within 1.5x of the answer")
    expect(chart).to_be_visible()
    assert chart.evaluate("img => img.naturalWidth") > 100, "the chart image did not load"
    chart.scroll_into_view_if_needed()
    page.screenshot(path=str(artifacts / "03-widget-answer.png"))
    # ...and a new case (twice the tokens) hides both until the learner predicts again.
    tokens = widget.locator(".widget-inline-hbox").filter(has_text="tokens cached").locator("input")
    tokens.fill("16384")
    tokens.press("Enter")
    expect(answer).to_have_text("Answer hidden: type your guess in GB and press Commit.")
    expect(chart).to_be_hidden()
    expect(widget).to_contain_text("The case changed: predict again, then commit.")

    # 4. Fill in 1a with the classic slip and validate: the visible test names it.
    replace_cell_source(page, "def kv_bytes(", KV_BYTES_NO_FACTOR_2)
    report = validate(page)
    page.screenshot(path=str(artifacts / "04-validate-mistake.png"))
    expect(report).to_have_class(re.compile(r"\bvalidation-failed\b"))
    first = report.inner_text()
    assert KV_BYTES_FAILED in first, first[:2000]
    failed_before = first.count("The following cell failed:")
    close_dialog(page)

    # 5. Fix it and validate again: that check now passes, the blank parts still fail.
    replace_cell_source(page, "def kv_bytes(", KV_BYTES_RIGHT)
    report = validate(page)
    page.screenshot(path=str(artifacts / "05-validate-fixed.png"))
    second = report.inner_text()
    assert KV_BYTES_FAILED not in second and "kv_bytes(32, 8192, 8, 128, 2)," not in second
    assert second.count("The following cell failed:") == failed_before - 1, second[:2000]
    close_dialog(page)

    # No news pop-up or update nag appeared at any point.
    expect(page.locator(".jp-toast-message, .Toastify__toast")).to_have_count(0)
