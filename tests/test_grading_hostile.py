"""The hostile-submission suite: every case gets its expected outcome in one batch.

All cases (tests/fixtures/hostile/*/) are collected next to one another and graded in a
single sandboxed, parallel autograde run, so one case can never change another's grade.
The attacks on the old design (test cells in the student's kernel) are graded a second time
through that design, kept as ``tests_in="kernel"`` for this purpose only, to show each one
earned marks there that it does not earn now.
"""
from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from autograder.pipeline.course import Course, hidden_test_lines, release
from autograder.pipeline.grade import autograde
from autograder.pipeline.report import export, feedback
from conftest import sandbox_skip_reason

FIXTURES = Path(__file__).parent / "fixtures"
CASES = sorted(p.name for p in (FIXTURES / "hostile").iterdir() if (p / "expected.json").exists())
EXPECTED = {c: json.loads((FIXTURES / "hostile" / c / "expected.json").read_text()) for c in CASES}
OLD_DESIGN = sorted(c for c in CASES if "old_design" in EXPECTED[c])
# The cases that run into a cell's time limit take 10-20 s each; the rest 1-4 s. Started
# first, they overlap the short ones instead of finishing alone after them (the order of a
# batch changes no grade: each submission has its own worker, kernel and sandbox).
SLOW_FIRST = ("swallows_interrupt", "infinite_loop", "input_transformer", "interrupt_returns",
              "str_never_returns_at_top",
              "str_never_returns", "imports_torch")
LIMITS = {"memory_mb": 1536, "processes": 256, "file_size_mb": 16, "scratch_mb": 64,
          "cpu_seconds": 60, "open_files": 1024}


def kernel_processes(marker: str) -> list[int]:
    """Grading kernels (kernel_boot) whose command line holds ``marker`` (a course path)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "autograder.kernel.boot" in text and marker in text:
            found.append(int(cmdline.parent.name))
    return found

pytestmark = pytest.mark.skipif(sandbox_skip_reason() is not None,
                                reason=str(sandbox_skip_reason()))


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("course")
    shutil.copytree(FIXTURES / "mini_assignment" / "mini", root / "solutions" / "mini")
    course = Course(root)
    release(course, "mini")
    for name in CASES:
        shutil.copytree(FIXTURES / "hostile" / name / "submission",
                        course.submitted / name / "mini")
    # 10 s per cell: long enough for `import torch` on a loaded machine, short enough for
    # the loops that must be interrupted.
    order = [c for c in SLOW_FIRST if c in CASES] + [c for c in CASES if c not in SLOW_FIRST]
    results = autograde(course, "mini", students=order, workers=2, cell_timeout=10,
                        total_timeout=90, limits=LIMITS, progress=False)
    feedback(course, "mini")
    export(course, ["mini"], course.work / "grades.csv")
    return course, {r["student"]: r for r in results}


@pytest.fixture(scope="module")
def old_design(graded):
    """The attacks on the old design, graded through it (test cells in the kernel)."""
    course, _ = graded
    results = autograde(course, "mini", students=OLD_DESIGN, workers=2, cell_timeout=10,
                        total_timeout=90, limits=LIMITS, progress=False, record=False,
                        tests_in="kernel")
    return {r["student"]: r for r in results}


@pytest.mark.parametrize("case", CASES)
def test_case_outcome(graded, case):
    course, results = graded
    expected = json.loads((FIXTURES / "hostile" / case / "expected.json").read_text())
    r = results[case]
    why = json.dumps({k: r[k] for k in ("status", "score", "reasons", "flags")}, indent=1)
    assert r["status"] == expected["status"], why
    if "score" in expected:
        assert r["score"] == expected["score"], why
    text = "; ".join(r["reasons"] + r["flags"])
    assert expected.get("reason", "") in text, why
    assert r["max_score"] == 4, why  # the release's points, whatever the submission claims
    if "max_notebook_mb" in expected:
        graded_nb = course.autograded / case / "mini" / "mini.ipynb"
        assert graded_nb.stat().st_size <= expected["max_notebook_mb"] * 2**20


@pytest.mark.parametrize("case", OLD_DESIGN)
def test_the_old_design_gave_this_attack_unearned_marks(graded, old_design, case):
    _, results = graded
    old, now = old_design[case], results[case]
    assert old["score"] == EXPECTED[case]["old_design"]["score"], json.dumps(old["notebooks"])
    if case != "cell_order":  # the control case: no design gives it anything
        assert old["score"] > now["score"], (old["score"], now["score"])


def test_no_grading_kernel_outlives_its_run(graded, old_design):
    course, _ = graded
    assert kernel_processes(str(course.root)) == []


def test_gradebook_holds_each_result_and_nothing_else(graded):
    from nbgrader.api import Gradebook
    course, results = graded
    with Gradebook(course.db_url) as gb:
        subs = {s.student.id: s for s in gb.find_assignment("mini").submissions}
        assert set(subs) == set(CASES)
        for name, sub in subs.items():
            auto = sum(g.auto_score or 0 for nb in sub.notebooks for g in nb.grades)
            assert auto == results[name]["score"], name
            flagged = any(nb.flagged for nb in sub.notebooks)
            assert flagged == (results[name]["status"] == "flagged"), name


def test_every_case_has_a_row_in_the_export(graded):
    course, _ = graded
    rows = list(csv.DictReader(open(course.work / "grades.csv")))
    assert [r["student"] for r in rows] == sorted(CASES)
    assert {r["status"] for r in rows} <= {"graded", "flagged", "failed"}
    assert list(rows[0]) == ["student", "assignment", "score", "max_score", "status", "reason"]


def test_no_feedback_leaks_hidden_tests_or_solutions(graded):
    course, _ = graded
    secret = hidden_test_lines(course, "mini")
    assert any("HIDDEN_SENTINEL" in s for s in secret)
    pages = list(course.feedback.rglob("*"))
    assert pages
    for page in pages:
        if not page.is_file():
            continue
        text = page.read_text()
        lines = {line.strip() for line in text.splitlines()}
        for marker in ("BEGIN HIDDEN TESTS", "BEGIN SOLUTION", "HIDDEN_SENTINEL",
                       "SOLUTION_SENTINEL", "Traceback"):
            assert marker not in text, (page, marker)
        assert not (secret & lines), page


def test_sandbox_kept_solutions_out_of_reach(graded):
    _, results = graded
    # The reads_outside case tried three paths; none existed inside the sandbox.
    flags = " ".join(results["reads_outside"]["flags"])
    assert "/work/main/solutions/mini/mini.ipynb" in flags or "solutions/mini" in flags
    assert results["reads_outside"]["score"] == 3
