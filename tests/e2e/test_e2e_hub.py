"""A class on the hub in a real browser: a student logs in with their Unix password, fetches
kv_cache_basics from the Assignments tab, answers 1a, validates and submits; the instructor
collects, grades and returns feedback through our CLI (their terminal); the student fetches
the feedback and sees the score.

Needs what tests/test_hub.py needs (root, jupyterhub, the proxy) and the browser; the
session's class hub (tests/conftest.py's class_hub, shared with tests/test_hub.py), with a
fresh class for this module. About 2-3 minutes on 2 cores; screenshots in
artifacts/e2e/test_student_.../.
"""
from __future__ import annotations

import re
import urllib.parse
from pathlib import Path

from playwright.sync_api import Page, expect

from test_hub import (ADA, INSTRUCTOR, NAME, REASON, Hub, as_user, home,  # noqa: F401
                      hub, pytestmark, released)

from .jlab import close_dialog, current_notebook, replace_cell_source, validate

KV_BYTES_RIGHT = ("def kv_bytes(layers, tokens, kv_heads, head_dim, bytes_per_elem):\n"
                  "    return 2 * layers * tokens * kv_heads * head_dim * bytes_per_elem")


def assignments_tab(page: Page) -> None:
    """Nbgrader > Assignment List: the student's Assignments tab."""
    page.locator(".lm-MenuBar-item").filter(has_text="Nbgrader").click()
    page.locator(".lm-Menu-item").filter(has_text="Assignment List").click()


def row(page: Page, listing: str):  # -> Locator
    """The assignment's row in one of the tab's lists (not its nested notebook rows)."""
    return page.locator(f"#{listing} .list_item:not(.nested_list_item)").filter(has_text=NAME)


def test_student_fetches_submits_and_reads_feedback_through_the_hub(
        released: Hub, page: Page, artifacts: Path) -> None:
    hub = released
    user_url = f"{hub.url}/user/{ADA}"
    # 1. Log in: the hub starts her JupyterLab (as her, from the course's environment).
    page.goto(f"{hub.url}/hub/login")
    page.locator("#username_input").fill(ADA)
    page.locator("#password_input").fill(hub.password)
    page.locator("#login_submit").click()
    page.wait_for_url(re.compile(rf"/user/{ADA}/lab"), timeout=240_000)
    expect(page.locator(".lm-MenuBar-item").filter(has_text="Nbgrader")).to_be_visible()
    page.screenshot(path=str(artifacts / "01-student-lab.png"))

    # 2. The Assignments tab lists the released assignment; Fetch copies it to her home.
    assignments_tab(page)
    fetch = row(page, "released_assignments_list").get_by_role("button", name="Fetch")
    fetch.click()
    expect(row(page, "fetched_assignments_list")).to_be_visible()
    page.screenshot(path=str(artifacts / "02-assignments-fetched.png"))
    assert (home(ADA) / NAME / f"{NAME}.ipynb").is_file()

    # 3. She answers 1a and validates (the other answers are still blank, so some fail).
    page.goto(f"{user_url}/lab/tree/{NAME}/{NAME}.ipynb")
    current_notebook(page).get_by_role("heading", name="Warm-up").wait_for()
    replace_cell_source(page, "def kv_bytes(", KV_BYTES_RIGHT)
    report = validate(page)
    expect(report).to_have_class(re.compile(r"\bvalidation-failed\b"))
    assert "kv_bytes(32, 8192, 8, 128, 2)," not in report.inner_text()
    page.screenshot(path=str(artifacts / "03-validate.png"))
    close_dialog(page)

    # 4. Submit from the Assignments tab.
    assignments_tab(page)
    row(page, "fetched_assignments_list").get_by_role("button", name="Submit").click()
    expect(row(page, "submitted_assignments_list")).to_be_visible()
    page.screenshot(path=str(artifacts / "04-submitted.png"))

    # 5. The instructor, in their terminal: collect, grade, return.
    ag = [hub.python, "-m", "autograder"]
    out = as_user(INSTRUCTOR, hub.dir, *ag, "collect", NAME, "--from-exchange",
                  "--student", ADA).stdout
    assert f"collected 1 submission(s) of {NAME}" in out, out
    out = as_user(INSTRUCTOR, hub.dir, *ag, "autograde", NAME, "--student", ADA,
                  "--no-progress", "--workers", "1").stdout   # sandboxed, as the README says
    assert re.search(rf"{ADA}\s+graded\s+2/22", out), out
    as_user(INSTRUCTOR, hub.dir, *ag, "feedback", NAME, "--return")

    # 6. She fetches the feedback from the same tab and reads her score.
    page.locator("#refresh_assignments_list").click()
    row(page, "submitted_assignments_list").get_by_role("button", name="Fetch Feedback").click()
    pages = []
    for _ in range(60):
        pages = list((home(ADA) / NAME / "feedback").glob(f"*/{NAME}.html"))
        if pages:
            break
        page.wait_for_timeout(1000)
    assert pages, "no feedback arrived in her home"
    rel = urllib.parse.quote(pages[0].relative_to(home(ADA)).as_posix())
    page.goto(f"{user_url}/files/{rel}", referer=f"{user_url}/lab")
    body = page.locator("body")
    expect(body).to_contain_text("Score: 2.0 / 22.0")
    expect(body).not_to_contain_text("BEGIN HIDDEN TESTS")
    page.screenshot(path=str(artifacts / "05-feedback.png"), full_page=True)
