"""End to end: release -> collect (zip) -> autograde -> feedback -> export, and self-check.

Runs on the mini assignment (fast) and on the real Harbor worksheet against the expected
outcomes in tests/fixtures/harbor/expected.json.
"""
from __future__ import annotations

import csv
import json
import shutil
import sqlite3
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from autograder.pipeline.course import Course, CourseError, hidden_test_lines, release
from autograder.pipeline.grade import autograde, load_results
from autograder.pipeline.report import export, feedback
from autograder.runner.sandbox import sandbox_available
from conftest import sandbox_skip_reason

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
needs_sandbox = pytest.mark.skipif(sandbox_skip_reason() is not None,
                                   reason=str(sandbox_skip_reason()))


def cli(*args: str, root: Path | None = None) -> subprocess.CompletedProcess:
    extra = ["--root", str(root)] if root else []
    return subprocess.run([sys.executable, "-m", "autograder", *extra, *args],
                          capture_output=True, text=True, timeout=600)


def solved_mini(release_nb: Path, double: str) -> str:
    nb = json.loads(release_nb.read_text())
    for cell in nb["cells"]:
        gid = cell["metadata"].get("nbgrader", {}).get("grade_id")
        if gid == "answer_kv_bytes":
            cell["source"] = ("def kv_bytes(layers, kv_heads, head_dim, seq_len, dtype_bytes=2):\n"
                              "    return 2 * layers * kv_heads * head_dim * seq_len * "
                              "dtype_bytes")
        elif gid == "answer_double":
            cell["source"] = double
        elif gid == "written_decode":
            cell["source"] = "Each step streams every weight for one token."
    return json.dumps(nb)


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    root = tmp_path_factory.mktemp("mini_course")
    shutil.copytree(FIXTURES / "mini_assignment" / "mini", root / "solutions" / "mini")
    assert cli("release", root=root).returncode == 0
    rel = root / "exercises" / "mini" / "mini.ipynb"
    export_zip = root.parent / f"{root.name}-lms.zip"
    with zipfile.ZipFile(export_zip, "w") as zf:  # LMS exports wrap the layout in a folder
        zf.writestr("export/ann/mini/mini.ipynb", solved_mini(rel, "def double(x):\n    return 2 * x"))
        zf.writestr("export/ben/mini/mini.ipynb", rel.read_text())
        zf.writestr("export/cat/mini/mini.ipynb", solved_mini(rel, "def double(x):\n    return x + 3"))
        zf.writestr("export/../evil/mini/mini.ipynb", "{}")
    out = cli("collect", "mini", str(export_zip), root=root)
    assert out.returncode == 0, out.stderr
    course = Course(root)
    if sandbox_available()[0]:
        run = cli("autograde", "mini", "--workers", "2", "--no-progress", root=root)
        assert run.returncode == 0, run.stderr
    return course


@needs_sandbox
def test_scores_statuses_and_export(mini):
    assert cli("feedback", "mini", root=mini.root).returncode == 0
    assert cli("export", root=mini.root).returncode == 0
    rows = {r["student"]: r for r in csv.DictReader(open(mini.work / "grades.csv"))}
    assert set(rows) == {"ann", "ben", "cat"}
    assert rows["ann"]["score"] == "3.0" and rows["ann"]["status"] == "graded"
    assert "await manual grading" in rows["ann"]["reason"]
    assert rows["ben"]["score"] == "0.0" and rows["ben"]["max_score"] == "4.0"
    assert rows["cat"]["score"] == "2.0"
    assert list(rows["ann"]) == ["student", "assignment", "score", "max_score", "status", "reason"]


@needs_sandbox
def test_feedback_names_tests_and_messages_without_leaking(mini):
    feedback(mini, "mini")
    page = (mini.feedback / "cat" / "mini" / "mini.html").read_text()
    assert "test_double" in page and "test_kv_bytes" in page
    assert "expected 4" in page  # the testkit's message says what was expected
    # The written answer's mark scheme, from the grader's copy, escaped; never in the release.
    assert "Mark scheme" in page and "MARK_SCHEME_SENTINEL &lt;b&gt;" in page
    assert "MARK_SCHEME_SENTINEL" not in (mini.release / "mini" / "mini.ipynb").read_text()
    secret = hidden_test_lines(mini, "mini")
    for path in mini.feedback.rglob("*.html"):
        text = path.read_text()
        assert "HIDDEN_SENTINEL" not in text and "SOLUTION_SENTINEL" not in text
        assert "BEGIN HIDDEN TESTS" not in text and "Traceback" not in text
        assert not (secret & {line.strip() for line in text.splitlines()})


@needs_sandbox
def test_nbgrader_feedback_preprocessor_strips_hidden_tests_and_tracebacks(mini):
    import nbformat
    from autograder.nbfeedback import SanitizeFeedback
    nb = nbformat.read(mini.autograded / "cat" / "mini" / "mini.ipynb", as_version=4)
    assert "HIDDEN_SENTINEL" in nbformat.writes(nb)  # the instructor's copy has them
    nb, _ = SanitizeFeedback().preprocess(nb, {})
    text = nbformat.writes(nb)
    assert "HIDDEN_SENTINEL" not in text and "BEGIN HIDDEN TESTS" not in text
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert errors and all(len(o.traceback) == 1 for o in errors)


@needs_sandbox
def test_regrading_is_idempotent_and_keeps_manual_grades(mini):
    from nbgrader.api import Gradebook
    with Gradebook(mini.db_url) as gb:
        g = gb.find_grade("written_decode", "mini", "mini", "ann")
        g.manual_score = 1.0
        gb.db.commit()
    # The first grading is the fixture's (`autograde` through the CLI); this is the regrade.
    before = {name: r["score"] for name, r in load_results(mini, "mini").items()}
    again = {r["student"]: r["score"] for r in autograde(mini, "mini", workers=2, progress=False)}
    assert before == again == {"ann": 3.0, "ben": 0.0, "cat": 2.0}
    export(mini, ["mini"], mini.work / "grades.csv")
    rows = {r["student"]: r for r in csv.DictReader(open(mini.work / "grades.csv"))}
    assert rows["ann"]["score"] == "4.0"  # 3 autograded + the manual point, kept
    backups = sorted(mini.backups.glob("gradebook-*.db"))
    assert len(backups) >= 2
    con = sqlite3.connect(backups[-1])
    assert con.execute("select count(*) from submitted_assignment").fetchone()[0] == 3


def test_unsafe_mode_grades_without_the_sandbox(mini):
    results = autograde(mini, "mini", students=["ann"], unsafe=True, progress=False,
                        record=False)
    assert [(r["student"], r["status"], r["score"]) for r in results] == [("ann", "graded", 3.0)]


def test_collect_refuses_path_tricks(mini):
    assert not (mini.submitted / "evil").exists()
    assert not (mini.work / "evil").exists()


def test_autograde_refuses_without_sandbox_unless_unsafe(mini, monkeypatch):
    import autograder.pipeline.grade as grade_mod
    monkeypatch.setattr(grade_mod, "sandbox_available", lambda: (False, "bwrap missing"))
    with pytest.raises(CourseError, match="--unsafe"):
        autograde(mini, "mini", progress=False)


def test_self_check_reports_visible_tests(mini, tmp_path):
    nb = tmp_path / "mini.ipynb"
    rel = mini.release / "mini"
    data = json.loads(solved_mini(rel / "mini.ipynb", "def double(x):\n    return x + 3"))
    data["cells"] = data["cells"][1:]  # the read-only setup cell is now the first cell
    nb.write_text(json.dumps(data))
    shutil.copy(rel / "constants.json", tmp_path)
    out = cli("check", str(nb))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "PASS  test_kv_bytes (2 pts)" in out.stdout
    assert "FAIL  test_double (1 pt): [double(2)] expected 4, got 5" in out.stdout
    assert "HIDDEN" not in out.stdout


def test_validate_runs_tests_outside_the_kernel_with_checks_verdicts(mini, tmp_path):
    """nbgrader's Validate button (its handler calls the Validator the course's server
    extension installs) gives the verdicts `check` gives above, and no test code runs in the
    learner's kernel: the testkit there counts no check at all."""
    from traitlets.config import Config
    from nbgrader.server_extensions.validate_assignment import handlers
    from autograder.validate import TrustedValidator, _load_jupyter_server_extension
    rel = mini.release / "mini"
    data = json.loads(solved_mini(rel / "mini.ipynb", "def double(x):\n    return x + 3"))
    data["cells"].append({"cell_type": "code", "execution_count": None, "metadata": {},
                          "id": "probe", "outputs": [],
                          "source": "import autograder.testkit as _t\n"
                                    "assert _t._STATS['checks'] == 0, 'tests ran in the kernel'"})
    nb = tmp_path / "mini.ipynb"
    nb.write_text(json.dumps(data))
    shutil.copy(rel / "constants.json", tmp_path)
    _load_jupyter_server_extension(type("App", (), {"log": __import__("logging")})())
    assert handlers.Validator is TrustedValidator
    results = TrustedValidator(config=Config({"Validator": {"validate_all": True}})) \
        .validate(str(nb))
    failed = results.get("failed", [])
    assert len(failed) == 1, failed
    assert "double(2)" in failed[0]["source"] and \
        "[double(2)] expected 4, got 5" in failed[0]["raw_error"]


# Harbor ------------------------------------------------------------------------------------

HARBOR = FIXTURES / "harbor" / "expected.json"


@pytest.fixture(scope="module")
def harbor(tmp_path_factory):
    assert (ROOT / "solutions" / "harbor_capacity").is_dir() and HARBOR.exists()
    if sandbox_skip_reason() is not None:
        pytest.skip(str(sandbox_skip_reason()))
    expected = json.loads(HARBOR.read_text())
    root = tmp_path_factory.mktemp("harbor_course")
    shutil.copytree(ROOT / "solutions" / "harbor_capacity", root / "solutions" / "harbor_capacity")
    course = Course(root)
    release(course, "harbor_capacity")
    for who, spec in expected["submissions"].items():
        src = ROOT / spec["notebook"].split(" ")[0]
        if who == "blank":
            src = course.release / "harbor_capacity" / "harbor_capacity.ipynb"
        dest = course.submitted / who / "harbor_capacity"
        dest.mkdir(parents=True)
        shutil.copy(src, dest / "harbor_capacity.ipynb")
    results = autograde(course, "harbor_capacity", workers=2, progress=False)
    feedback(course, "harbor_capacity")
    return course, expected, {r["student"]: r for r in results}


def test_harbor_outcomes_match_the_reference(harbor):
    _, expected, results = harbor
    for who, spec in expected["submissions"].items():
        r = results[who]
        detail = json.dumps({k: r[k] for k in ("status", "score", "reasons", "flags")})
        assert r["status"] == "graded", detail
        assert r["score"] == spec["autograded_score"], detail
        assert r["max_score"] == expected["max_score"], detail
        tests = {t["grade_id"]: t for t in r["notebooks"]["harbor_capacity"]["tests"]}
        for gid, want in spec["tests"].items():
            assert tests[gid]["points"] == want["score"], (who, gid, tests[gid])
            for phrase in want.get("message_contains", []):
                assert phrase in tests[gid]["message"], (who, gid, tests[gid]["message"])
        if who == "blank":  # zero without errors: every test says why it failed
            assert all(t["message"] and "internal" not in t["message"]
                       for t in tests.values()), tests
            assert any("not answered" in t["message"] for t in tests.values())


def test_harbor_feedback_has_no_hidden_tests(harbor):
    course, _, _ = harbor
    secret = hidden_test_lines(course, "harbor_capacity")
    for path in course.feedback.rglob("*.html"):
        text = path.read_text()
        assert "BEGIN HIDDEN TESTS" not in text and "Traceback" not in text
        assert not (secret & {line.strip() for line in text.splitlines()})


@needs_sandbox
def test_grading_bench_writes_its_report(tmp_path):
    out = tmp_path / "grading.json"
    proc = cli("bench", "--json", str(out), "--submissions", "2", root=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert set(data["ratios"]) == {"parallel_grading_speedup",
                                   "trusted_over_in_kernel_per_submission"}
    assert all(v > 0 for v in data["ratios"].values())  # ratios, never a timing bound
    assert {"serial", "parallel", "serial_tests_in_kernel"} <= set(data["timings"])
    assert data["submissions"] == 2
    assert data["machine"]["cpu_count"] and data["git_commit"]


@needs_sandbox
def test_a_deep_course_graded_through_a_symlinked_venv_still_grades(tmp_path):
    """Two set-ups that each once broke grading, in one run (either alone fails it):

    - a course deep in the file system: the kernel talks over Unix sockets, whose paths hold
      at most 107 bytes, and they must not be pushed past that (it failed with "File name too
      long");
    - a venv reached through a symlink: the sandbox mounts the venv's resolved folder, so a
      grader started as LINK/.venv/bin/python must name the kernel by that resolved folder
      (it failed with `execvp ... No such file`)."""
    venv = Path(sys.executable).parent.parent
    link = tmp_path / "linked-venv"
    link.symlink_to(venv.resolve(), target_is_directory=True)
    root = tmp_path / ("deep-" + "x" * 60) / ("course-" + "y" * 40)
    shutil.copytree(FIXTURES / "mini_assignment" / "mini", root / "solutions" / "mini")
    assert cli("release", root=root).returncode == 0
    rel = root / "exercises" / "mini" / "mini.ipynb"
    sub = root / "grading" / "submitted" / "ann" / "mini"
    sub.mkdir(parents=True)
    (sub / "mini.ipynb").write_text(solved_mini(rel, "def double(x):\n    return 2 * x"))
    python = link / "bin" / Path(sys.executable).name
    run = subprocess.run([str(python), "-m", "autograder", "--root", str(root), "autograde",
                          "mini", "--workers", "1", "--no-progress"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    result = json.loads((Course(root).results / "mini" / "ann.json").read_text())
    assert result["status"] == "graded" and result["score"] == 3, result
