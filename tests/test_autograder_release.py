"""Release drift and leaks, plus fast unit tests of the grading pieces (no kernel)."""
from __future__ import annotations

import filecmp
import json
from pathlib import Path

import nbformat
import pytest

from autograder import testkit
from autograder.pipeline.course import Course, hidden_test_lines
from autograder.submitted.scan import names_bound, scan_cell
from autograder.submitted.submission import Unreadable, load, merge
from exercise_checks import fresh_release

ROOT = Path(__file__).resolve().parents[1]
COURSE = Course(ROOT)
MARKERS = ("### BEGIN SOLUTION", "### END SOLUTION", "### BEGIN HIDDEN TESTS",
           "### END HIDDEN TESTS")


@pytest.mark.parametrize("assignment", COURSE.assignments())
def test_committed_exercises_match_a_fresh_release(assignment):
    out, _ = fresh_release(assignment)   # the one the sandboxed grading tests grade against
    committed = COURSE.release / assignment
    fresh = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    have = sorted(p.relative_to(committed) for p in committed.rglob("*") if p.is_file())
    assert fresh == have, "exercises/ is out of date: run `make release` and commit"
    for rel in fresh:
        assert filecmp.cmp(out / rel, committed / rel, shallow=False), (
            f"exercises/{assignment}/{rel} differs from a fresh release: run `make release`")


@pytest.mark.parametrize("assignment", COURSE.assignments())
def test_exercises_hold_no_solutions_or_hidden_tests(assignment):
    secret = hidden_test_lines(COURSE, assignment)
    for path in (COURSE.release / assignment).rglob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        lines = {line.strip() for cell in nb.cells for line in cell.source.splitlines()}
        text = path.read_text()
        for marker in MARKERS:
            assert marker not in text, (path, marker)
        assert not (secret & lines), sorted(secret & lines)[:3]
        # No rubric of a written answer reaches the learner: every line of every mark scheme
        # in the source is cut from the release.
        assert "Rubric" not in text and "MARK SCHEME" not in text, path
        leaked = mark_scheme_lines(COURSE.source / assignment / path.name) & lines
        assert not leaked, sorted(leaked)[:3]


def mark_scheme_lines(source: Path) -> set[str]:
    """The non-blank lines inside ### BEGIN/END MARK SCHEME regions of a source notebook."""
    found, inside = set(), False
    for cell in nbformat.read(source, as_version=4).cells:
        for line in cell.source.splitlines():
            if "BEGIN MARK SCHEME" in line:
                inside = True
            elif "END MARK SCHEME" in line:
                inside = False
            elif inside and line.strip():
                found.add(line.strip())
    return found


def test_every_rubric_sits_in_a_mark_scheme_region():
    """Rubrics are written inside mark-scheme regions, so release cuts them."""
    for path in sorted(COURSE.source.glob("*/*.ipynb")):
        regions = sum("BEGIN MARK SCHEME" in c.source for c in nbformat.read(path, as_version=4).cells)
        rubrics = path.read_text().count("*Rubric (")
        assert rubrics == regions, f"{path}: {rubrics} rubrics, {regions} mark-scheme regions"


# testkit ------------------------------------------------------------------------------------

def test_check_close_names_the_classic_mistake():
    with pytest.raises(AssertionError, match="query heads"):
        testkit.check_close(4.0, 1.0, name="kv", mistakes={4.0: "query heads instead of KV"})
    with pytest.raises(AssertionError, match=r"\[kv\] expected 1"):
        testkit.check_close(2.0, 1.0, name="kv")
    testkit.check_close(1.0 + 1e-9, 1.0, name="kv")


def test_check_equal_never_calls_a_student_eq():
    class Liar(int):
        def __eq__(self, other):
            return True
    with pytest.raises(AssertionError, match="expected a int"):
        testkit.check_equal(Liar(0), 4, name="x")
    with pytest.raises(AssertionError):
        testkit.check_equal({"a": Liar(0)}, {"a": 4}, name="d")
    testkit.check_equal({"a": [1, (2, "x")]}, {"a": [1, (2, "x")]}, name="d")


def test_check_close_rejects_bools_and_float_subclasses():
    class F(float):
        pass
    for bad in (True, F(1.0), "1.0", None):
        with pytest.raises(AssertionError):
            testkit.check_close(bad, 1.0, name="n")


def test_testkit_detects_patched_isclose(monkeypatch):
    import math
    monkeypatch.setattr(math, "isclose", lambda *a, **k: True)
    with pytest.raises(AssertionError, match=r"\[integrity\] math.isclose"):
        testkit.check(True, name="x", message="m")


# static scan --------------------------------------------------------------------------------

PROTECTED = names_bound("from autograder.testkit import check_close, check\nimport json\n"
                        "CONST = json.load(open('c.json'))")


@pytest.mark.parametrize("source, needle", [
    ("get_ipython().input_transformers_cleanup.append(f)", "get_ipython"),
    ("import sys\nsys.settrace(f)", "settrace"),
    ("import math\nmath.isclose = lambda *a: True", "math.isclose"),
    ("import torch\ntorch.allclose = f", "torch.allclose"),
    ("class A:\n    def __eq__(s, o):\n        return True", "__eq__"),
    ("import os\nos._exit(0)", "os._exit"),
    ("def check_close(*a, **k):\n    pass", "check_close"),
    ("CONST['x'] = 1", "CONST"),
    ("try:\n    pass\nexcept KeyboardInterrupt:\n    pass", "KeyboardInterrupt"),
    ("!cat /etc/passwd", "get_ipython"),
    ("import builtins", "builtins"),
    ("exec('x=1')", "exec"),
])
def test_scan_flags_tampering(source, needle):
    findings = scan_cell(source, "answer", PROTECTED)
    assert any(needle in str(f) for f in findings), findings


def test_scan_allows_measuring_magics_but_scans_their_code():
    assert scan_cell("%timeit kv(2, 3)\n%matplotlib inline", "answer", PROTECTED) == []
    assert scan_cell("%%time\ntotal = kv(2, 3)", "answer", PROTECTED) == []
    assert any("settrace" in str(f) for f in
               scan_cell("%time sys.settrace(None)", "answer", PROTECTED))
    assert any("get_ipython" in str(f) for f in
               scan_cell("%load_ext autoreload", "answer", PROTECTED))


def test_scan_passes_honest_code():
    honest = ("import json\nimport math\nimport re\nimport numpy as np\n"
              "def kv(layers, heads):\n    total = 2 * layers * heads\n"
              "    return math.ceil(total / 1.5)\npat = re.compile('x')\n"
              "rows = [dict(a=1)]\nrows[0]['a'] = 2\n")
    assert scan_cell(honest, "answer", PROTECTED) == []


# reading and merging submissions ------------------------------------------------------------

MINI = Path(__file__).parent / "fixtures" / "mini_assignment" / "mini" / "mini.ipynb"


def test_invalid_json_is_unreadable_with_a_clear_reason(tmp_path):
    bad = tmp_path / "x.ipynb"
    bad.write_text(MINI.read_text()[:-50])
    with pytest.raises(Unreadable, match="not valid JSON"):
        load(bad)


def test_merge_restores_deleted_tests_and_keeps_answers(tmp_path):
    nb = nbformat.read(MINI, as_version=4)
    student = json.loads(nbformat.writes(nb))
    student["cells"] = [c for c in student["cells"]
                        if c["metadata"].get("nbgrader", {}).get("grade_id") != "test_double"]
    path = tmp_path / "s.ipynb"
    path.write_text(json.dumps(student))
    sub, _ = load(path)
    merged = merge(nb, nb, sub)
    ids = [c.metadata.get("nbgrader", {}).get("grade_id") for c in merged.nb.cells]
    assert ids.index("answer_double") < ids.index("test_double")
    assert "restored deleted cells: test_double" in merged.notes


# collect ------------------------------------------------------------------------------------

def test_collect_from_a_wrapped_folder_skips_links_and_bad_ids(tmp_path):
    import shutil
    from autograder.pipeline.collect import collect
    course = Course(tmp_path / "course")
    shutil.copytree(MINI.parent, course.source / "mini")
    export = tmp_path / "export" / "lms-2026"
    (export / "ann" / "mini").mkdir(parents=True)
    (export / "ann" / "mini" / "mini.ipynb").write_text("{}")
    (export / "ann" / "mini" / "secret.ipynb").symlink_to("/etc/hostname")
    (export / "bad id" / "mini").mkdir(parents=True)
    (export / "bad id" / "mini" / "mini.ipynb").write_text("{}")
    students, warnings = collect(course, "mini", tmp_path / "export")
    assert students == ["ann"]
    assert any("bad id" in w for w in warnings)
    assert sorted(p.name for p in (course.submitted / "ann" / "mini").iterdir()) == ["mini.ipynb"]


def test_second_coordinator_is_refused(tmp_path):
    from autograder.pipeline.course import CourseError
    from autograder.pipeline.grade import coordinator_lock
    course = Course(tmp_path)
    with coordinator_lock(course):
        with pytest.raises(CourseError, match="another autograde"):
            with coordinator_lock(course):
                pass
