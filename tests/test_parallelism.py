"""The parallelism exercises (chapter 7): a valid nbgrader source whose solution passes every
visible and hidden test, a blank release that earns nothing, and messages that name the
classic mistakes.

Everything in the notebook runs in one process (the ranks are list entries, the all-reduce a
sum), so a kernel run takes about 3 s on 2 cores, mostly importing torch. The notebook helpers
come from the Harbor worksheet's tests; the sandboxed end-to-end run reuses the pipeline's
skip rule.
"""
from __future__ import annotations

import json
import shutil

import nbformat
import pytest

from test_grading_pipeline import needs_sandbox
from test_harbor_worksheet import MARKERS, _errors, _execute, _is_test, _meta
from test_kv_cache_basics import ROOT, _copy, _with_source_tests

NAME = "parallelism"
SOURCE_DIR = ROOT / "solutions" / NAME
SOURCE = SOURCE_DIR / f"{NAME}.ipynb"
RELEASED = ROOT / "exercises" / NAME / f"{NAME}.ipynb"

TEST_POINTS = {"test_column_split": 1, "test_row_split": 1, "test_parallel_mlp": 3,
               "test_allreduce_count": 1, "test_allreduce_bytes": 2, "test_bubble": 2,
               "test_micro_batches": 1, "test_choice_oproj": 1, "test_choice_second_gpu": 1}
MANUAL_POINTS = {"written_replicas": 3}
ANSWER_CELLS = {"splits", "parallel_mlp", "allreduce_count", "allreduce_bytes", "bubble",
                "micro_batches", "choice_oproj", "choice_second_gpu"}


@pytest.fixture(scope="module")
def source():
    return nbformat.read(SOURCE, as_version=4)


# ------------------------------------------------------------------ the source notebook

def test_source_assignment_specifics(source):
    # The general nbgrader rules are checked for every assignment in test_solutions_valid.py.
    first = next(c for c in source.cells if c.cell_type == "code")
    assert "from autograder.testkit import check, check_close, check_equal" in first.source
    assert "allclose as _allclose" in first.source and "silu as _silu" in first.source
    tests = {_meta(c)["grade_id"]: _meta(c)["points"] for c in source.cells if _is_test(c)}
    manual = {_meta(c)["grade_id"]: _meta(c)["points"] for c in source.cells
              if _meta(c).get("grade") and _meta(c).get("solution")}
    assert tests == TEST_POINTS and manual == MANUAL_POINTS
    answers = {_meta(c)["grade_id"] for c in source.cells
               if _meta(c).get("solution") and not _meta(c).get("grade")}
    assert answers == ANSWER_CELLS
    # Every autograded part has hidden checks beyond the visible ones.
    assert all("### BEGIN HIDDEN TESTS" in c.source for c in source.cells if _is_test(c))
    # The rubric sits above the written answer, and the intro states the totals.
    by_id = {_meta(c)["grade_id"]: c for c in source.cells if _meta(c)}
    assert "Rubric" in by_id["part5_intro"].source
    assert "Rubric" not in by_id["written_replicas"].source
    assert "(16 points)" in source.cells[0].source
    assert sum(tests.values()) == 13 and sum(manual.values()) == 3


PROBE = """
import json
print("PROBE " + json.dumps({"count": ALLREDUCES_TARGET, "m": MICRO_BATCHES_10PCT,
                             "bytes": allreduce_bytes(6, 1, 1, 256, 4),
                             "bubble": bubble(2, 4)}))
"""


def test_solution_passes_every_visible_and_hidden_test(source):
    nb = _copy(source)
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    _execute(nb, SOURCE_DIR, allow_errors=False)  # any failing check raises
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    got = json.loads(text.split("PROBE ", 1)[1])
    # 2 per block x 6 blocks; (4 - 1) / (27 + 4 - 1) = 0.1; 12 all-reduces of 256 fp32 numbers.
    assert got == {"count": 12, "m": 27, "bytes": 12_288, "bubble": pytest.approx(0.2)}


def test_the_solution_agrees_with_the_engine():
    """The notebook's formulas are the ones tinyserve implements and its tests measure."""
    from tinyserve.pipeline import bubble_formula
    assert bubble_formula(4, 27) <= 0.10 < bubble_formula(4, 26)
    assert bubble_formula(2, 4) == pytest.approx(0.2)


# ------------------------------------------------------------------ the blank release

def test_blank_release_earns_nothing_and_leaks_nothing(source):
    text = RELEASED.read_text()
    for marker in MARKERS:
        assert marker not in text
    nb = _with_source_tests(nbformat.read(RELEASED, as_version=4), source)
    _execute(nb, SOURCE_DIR, allow_errors=True)
    errors = {gid: out["ename"] for gid, out in _errors(nb).items()}
    # Blank functions raise when a test calls them; blank variables raise in their own cell,
    # and then the test finds no answer. Either way every autograded cell fails.
    variables = ("test_allreduce_count", "test_micro_batches", "test_choice_oproj",
                 "test_choice_second_gpu")
    assert errors == {gid: ("NameError" if gid in variables else "NotImplementedError")
                      for gid in TEST_POINTS}
    manual = [c for c in nb.cells if _meta(c).get("grade_id") in MANUAL_POINTS]
    assert [c.source.strip() for c in manual] == ["YOUR ANSWER HERE"]


# ------------------------------------------------------------------ the classic mistakes, named

MLP = ("def parallel_mlp(x, ups, downs):\n"
       "    parts = [{inner} for u, d in zip(ups, downs)]\n"
       "    return {combine}")
GOOD_INNER = "torch.nn.functional.silu(x @ u.T) @ d.T"

# (test cell, code a learner might write in its place, a fragment the failure must contain)
MISTAKES = [
    ("test_column_split",
     "def column_split(w, n):\n    k = w.shape[1] // n\n    return [w[:, r * k:(r + 1) * k] for r in range(n)]",
     "OUTPUT features"),
    ("test_row_split",
     "def row_split(w, n):\n    k = w.shape[0] // n\n    return [w[r * k:(r + 1) * k] for r in range(n)]",
     "INPUT features"),
    ("test_parallel_mlp", MLP.format(inner=GOOD_INNER, combine="parts[0]"), "rank 0's partial"),
    ("test_parallel_mlp", MLP.format(inner=GOOD_INNER, combine="sum(parts) / len(parts)"),
     "SUMS them"),
    ("test_parallel_mlp", MLP.format(inner=GOOD_INNER, combine="torch.cat(parts, dim=-1)"),
     "concatenated"),
    ("test_parallel_mlp",
     MLP.format(inner="x @ u.T @ d.T", combine="torch.nn.functional.silu(sum(parts))"),
     "SiLU was applied after"),
    ("test_allreduce_count", "ALLREDUCES_TARGET = TARGET.num_hidden_layers", "two, after attention"),
    ("test_allreduce_count", "ALLREDUCES_TARGET = 4 * TARGET.num_hidden_layers", "both ranks"),
    ("test_allreduce_bytes", "def allreduce_bytes(l, b, t, h, e):\n    return l * b * t * h * e",
     "each block all-reduces twice"),
    ("test_allreduce_bytes",
     "def allreduce_bytes(l, b, t, h, e):\n    return 2 * l * b * t * 688 * e", "inner width"),
    ("test_bubble", "def bubble(p, m):\n    return (p - 1) / m", "m + p - 1 steps, not m"),
    ("test_bubble", "def bubble(p, m):\n    return m / (m + p - 1)", "BUSY share"),
    ("test_micro_batches", "MICRO_BATCHES_10PCT = 30", "(p - 1) / (m + p - 1)"),
    ("test_choice_oproj", 'ANSWER_OPROJ = "B"', "one lowercase letter"),
    ("test_choice_oproj", 'ANSWER_OPROJ = "c"', "partial sum"),
    ("test_choice_second_gpu", 'ANSWER_SECOND_GPU = "a"', "copies need no communication"),
]


def test_classic_mistakes_get_messages_that_name_them(source):
    """Each wrong answer runs against the real test cell (hidden tests included) in one kernel;
    the correct solution runs first, so each mistake is the only thing wrong in its cell."""
    by_id = {_meta(c)["grade_id"]: c for c in source.cells if _meta(c)}
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c.source) for c in source.cells
                if c.cell_type == "code" and not _is_test(c)]
    answers = [c.source for c in source.cells
               if c.cell_type == "code" and _meta(c).get("grade_id") in ANSWER_CELLS]
    wanted = []
    for test_id, wrong, fragment in MISTAKES:
        nb.cells.extend(nbformat.v4.new_code_cell(text) for text in (*answers, wrong))
        cell_id = f"{test_id}_{len(wanted)}"
        test_cell = nbformat.v4.new_code_cell(by_id[test_id].source)
        test_cell.metadata = {"nbgrader": dict(_meta(by_id[test_id]), grade_id=cell_id)}
        nb.cells.append(test_cell)
        wanted.append((cell_id, fragment))
    _execute(nb, SOURCE_DIR, allow_errors=True)
    errors = _errors(nb)
    for cell_id, fragment in wanted:
        assert cell_id in errors, f"{cell_id}: the wrong answer passed"
        assert errors[cell_id]["ename"] == "AssertionError", (cell_id, errors[cell_id])
        assert fragment in errors[cell_id]["evalue"], (cell_id, errors[cell_id]["evalue"])


# ------------------------------------------------------------------ end to end, sandboxed

@needs_sandbox
def test_sandboxed_grading_gives_full_marks_and_zero(source, tmp_path):
    from autograder.course import Course, release
    from autograder.grade import autograde
    course = Course(tmp_path)
    shutil.copytree(SOURCE_DIR, course.source / NAME)
    release(course, NAME)
    for who, notebook in (("solution", SOURCE), ("blank", course.release / NAME / f"{NAME}.ipynb")):
        dest = course.submitted / who / NAME
        dest.mkdir(parents=True)
        shutil.copy(notebook, dest / f"{NAME}.ipynb")
    results = {r["student"]: r for r in autograde(course, NAME, workers=2, progress=False)}
    for who, score in (("solution", sum(TEST_POINTS.values())), ("blank", 0)):
        r = results[who]
        detail = json.dumps({k: r[k] for k in ("status", "score", "reasons", "flags", "notebooks")})
        assert r["status"] == "graded" and r["score"] == score, detail
        assert r["max_score"] == sum(TEST_POINTS.values()) + sum(MANUAL_POINTS.values()), detail
        tests = {t["grade_id"]: t for t in r["notebooks"][NAME]["tests"]}
        for gid, points in TEST_POINTS.items():
            assert tests[gid]["points"] == (points if who == "solution" else 0), (who, gid, tests[gid])
