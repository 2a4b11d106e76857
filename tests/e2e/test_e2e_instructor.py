"""An instructor in a real browser (`make lab-instructor`): after the README's grading commands (release, collect,
autograde, feedback) on a throwaway course, JupyterLab's formgrader lists the released
assignments and the autograded submission with its score, and the feedback page the student
receives shows each test with its points and the message that names the slip.

About 60 s on 2 cores, most of it the grading commands; screenshots in
artifacts/e2e/test_instructor_.../.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from .jlab import ROOT, copy_course, reveal

ASSIGNMENTS = ("kv_cache_basics", "harbor_capacity")
NAME = "kv_cache_basics"
SOLUTION_1A = "return 2 * layers * tokens * kv_heads * head_dim * bytes_per_elem"
SLIP_1A = "return layers * tokens * kv_heads * head_dim * bytes_per_elem"


def autograder(course: Path, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "autograder", "--root", str(course), *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"autograder {args[0]} failed:\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def graded_course(tmp_path: Path) -> Path:
    """A course with two released assignments and one autograded submission of the first."""
    course = copy_course(tmp_path / "course", "nbgrader_config.py")
    for name in ASSIGNMENTS:
        shutil.copytree(ROOT / "solutions" / name, course / "solutions" / name)
    autograder(course, "release", *ASSIGNMENTS)
    # Ada's notebook is the reference solution with the classic slip in 1a (no factor 2 for
    # keys and values), which also halves 1b: 16 - 2 - 2 = 12 autograded points. Trusted
    # code, so it is graded without the sandbox (the sandbox has its own tests).
    source = (ROOT / "solutions" / NAME / f"{NAME}.ipynb").read_text()
    assert source.count(SOLUTION_1A) == 1
    export = tmp_path / "export" / "ada" / NAME
    export.mkdir(parents=True)
    (export / f"{NAME}.ipynb").write_text(plant_active_content(source.replace(SOLUTION_1A,
                                                                              SLIP_1A)))
    autograder(course, "collect", NAME, str(tmp_path / "export"))
    out = autograder(course, "autograde", NAME, "--unsafe", "--no-progress", "--workers", "1")
    assert "ada" in out and "12/22" in out, out
    autograder(course, "feedback", NAME)
    return course


# Active content a student plants where the instructor will look: a written answer and an
# HTML output of an answer cell (made during grading, so it is in the autograded notebook).
# Each would set window.__pwned in the instructor's page if the formgrader let it run.
PLANTED_MARKDOWN = ("\n\n<img src=x onerror=\"window.__pwned = 'markdown img'\">"
                    "<script>window.__pwned = 'markdown script'</script>")
PLANTED_OUTPUT = r'''


class _Shown:
    def _repr_html_(self):
        return ("<b>planted</b><img src=x onerror=\"window.__pwned = 'output img'\">"
                "<script>window.__pwned = 'output script'</script>")


_Shown()
'''


def plant_active_content(text: str) -> str:
    import json
    nb = json.loads(text)
    for cell in nb["cells"]:
        gid = cell["metadata"].get("nbgrader", {}).get("grade_id")
        source = "".join(cell["source"])
        if gid == "written_double_context":
            cell["source"] = source + PLANTED_MARKDOWN
        elif SLIP_1A in source:
            cell["source"] = source + PLANTED_OUTPUT
    return json.dumps(nb)


def submission_id(course: Path) -> str:
    from nbgrader.api import Gradebook
    with Gradebook(f"sqlite:///{course / 'grading' / 'gradebook.db'}") as gb:
        return gb.find_submission_notebook(NAME, NAME, "ada").id


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary folder with a short path: the grader's kernels talk over Unix sockets under
    the course folder, and a socket path may not exceed 107 bytes (pytest's tmp_path can)."""
    folder = Path(tempfile.mkdtemp(prefix="e2e-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_instructor_sees_assignments_a_graded_submission_and_feedback(
        short_tmp: Path, start_lab, page: Page, artifacts: Path) -> None:
    course = graded_course(short_tmp)
    lab = start_lab(course, role="instructor")

    # 1. The instructor's Lab has nbgrader's tools: the Create Assignment sidebar, and
    # Nbgrader > Formgrader opens inside JupyterLab on Manage Assignments.
    page.goto(lab.url + "/lab")
    expect(page.locator(".lm-TabBar-tab[title='Nbgrader Create Assignment']")).to_have_count(1)
    page.locator(".lm-MenuBar-item").filter(has_text="Nbgrader").click()
    page.locator(".lm-Menu-item").filter(has_text="Formgrader").first.click()
    formgrader = page.frame_locator("#formgrader iframe")
    expect(formgrader.locator("h1").filter(has_text="Manage Assignments")).to_be_visible()
    rows = {name: formgrader.locator("tr").filter(has_text=name) for name in ASSIGNMENTS}
    for name, row in rows.items():
        reveal(row)
    # The "# Submissions" column: one for kv_cache_basics, none for the other.
    expect(rows[NAME].locator("td").nth(8)).to_have_text("1")
    expect(rows["harbor_capacity"].locator("td").nth(8)).to_have_text("0")
    page.screenshot(path=str(artifacts / "01-formgrader-assignments.png"))

    # 2. The submission, autograded (the written answers still to grade by hand).
    rows[NAME].locator("td").nth(8).get_by_role("link").click()
    expect(formgrader.locator("h1").filter(has_text="Manage Submissions")).to_be_visible()
    submission = reveal(formgrader.locator("tr").filter(has_text="ada"))
    expect(submission.locator("td.score")).to_have_text("12 / 22")
    page.screenshot(path=str(artifacts / "02-formgrader-submission.png"))

    # 3. The feedback page the student receives: tests by name and points, no test source.
    # (With no token, Jupyter serves /files/ only to pages of its own origin: say where from.)
    page.goto(f"{lab.url}/files/grading/feedback/ada/{NAME}/{NAME}.html", referer=lab.url + "/lab")
    body = page.locator("body")
    for text in ("Score: 12.0 / 22.0", "test_attend_gqa", "written_double_context",
                 "awaiting manual grading",
                 "half the expected size: the factor 2 for keys AND values is missing"):
        expect(body).to_contain_text(text)
    expect(body.locator("tr").filter(has_text="test_kv_bytes")).to_contain_text("0.0 / 2.0")
    expect(body).not_to_contain_text("BEGIN HIDDEN TESTS")
    page.screenshot(path=str(artifacts / "03-feedback.png"), full_page=True)

    # 4. The submission itself, as the formgrader shows it to grade the written answers: the
    # planted image and script are there as inert text or not at all, and none of them ran.
    page.goto(f"{lab.url}/formgrader/submissions/{submission_id(course)}/?index=0")
    expect(page.locator("body")).to_contain_text("planted")   # the output is shown...
    expect(page.locator(".cell").first).to_be_visible()
    page.wait_for_load_state("load")
    assert page.evaluate("() => window.__pwned") is None     # ...and nothing in it ran
    assert page.locator("script", has_text="__pwned").count() == 0
    assert page.locator("img[onerror]").count() == 0
    page.screenshot(path=str(artifacts / "04-formgrader-submission-view.png"), full_page=True)
