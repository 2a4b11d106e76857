"""`python -m autograder mutants`: single-point mutants of a solution, graded in the sandbox.

A two-function assignment whose tests are deliberately weak in one place: `square(2) == 4`
cannot tell `x ** 2` from `x * 2`, so exactly that mutant survives and is reported with its
cell, line and change; the others lose marks. A mutant's run stops at its first failed test:
the two `clamp_low` mutants fail the first test cell, so the second is never run for them.
"""
from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from exercise_checks import needs_sandbox

from autograder.pipeline.course import Course, CourseError
from autograder.mutation.mutants import assignment_mutants, cell_mutants

ANSWER = '''def clamp_low(x: int) -> int:
    """x, or 0 if x is negative."""
    ### BEGIN SOLUTION
    return max(x, 0)
    ### END SOLUTION


def square(x: int) -> int:
    ### BEGIN SOLUTION
    return x ** 2
    ### END SOLUTION
'''
TESTS_CLAMP = ('check_equal(clamp_low(5), 5, name="clamp_low(5)")\n'
               'check_equal(clamp_low(-3), 0, name="clamp_low(-3)")')
TESTS_SQUARE = 'check_equal(square(2), 4, name="square(2)")'


def _cell(kind: str, gid: str, source: str, **flags) -> nbformat.NotebookNode:
    cell = (nbformat.v4.new_markdown_cell if kind == "md" else nbformat.v4.new_code_cell)(source)
    cell.metadata = {"nbgrader": {"grade": False, "grade_id": gid, "locked": True,
                                  "schema_version": 3, "solution": False, "task": False, **flags}}
    return cell


def make_course(root: Path) -> Course:
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}}
    nb.cells = [_cell("md", "intro", "# Tiny"),
                _cell("code", "imports", "from autograder.testkit import check, check_close, check_equal"),
                _cell("code", "answer", ANSWER, solution=True, locked=False),
                _cell("code", "test_clamp", TESTS_CLAMP, grade=True, points=1),
                _cell("code", "test_square", TESTS_SQUARE, grade=True, points=1)]
    folder = root / "solutions" / "tiny"
    folder.mkdir(parents=True)
    nbformat.write(nb, folder / "tiny.ipynb")
    return Course(root)


def test_mutants_are_single_point_changes_of_the_solution_code_only():
    mutants = cell_mutants(ANSWER, "tiny", "answer")
    changes = sorted((m.line, m.change.split(" in ")[0]) for m in mutants)
    assert changes == [(4, "`0` -> `1`"), (4, "`max(` -> `min(`"),
                       (10, "`**` -> `*`"), (10, "`2` -> `3`")]
    for m in mutants:  # the rest of the cell is untouched: one line differs, comments kept
        diff = [(a, b) for a, b in zip(ANSWER.splitlines(), m.source.splitlines()) if a != b]
        assert len(diff) == 1 and "### BEGIN SOLUTION" in m.source
    # Annotations, docstrings and code outside the markers are never mutated.
    assert all(m.line in (4, 10) for m in mutants)


def test_every_assignment_has_mutants():
    root = Path(__file__).resolve().parents[1] / "solutions"
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        assert assignment_mutants(folder), folder.name


@needs_sandbox
def test_mutation_score_grades_each_mutant_and_names_the_survivor(tmp_path, capsys):
    from autograder.cli import main
    make_course(tmp_path)
    out = tmp_path / "report.json"
    assert main(["--root", str(tmp_path), "mutants", "tiny", "--workers", "2",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["mutants"], report["killed"], report["score"]) == (4, 3, 0.75)
    assert report["baseline"] == 2
    assert report["stopped_early"] == 2   # the clamp_low mutants: test_square was skipped
    assert report["not_graded"] == []
    [survivor] = report["survivors"]
    assert (survivor["cell"], survivor["line"]) == ("answer", 10)
    assert survivor["change"] == "`**` -> `*` in `return x ** 2`"
    printed = capsys.readouterr().out
    assert "tiny: 3/4 mutants lose marks: mutation score 0.75" in printed
    assert "survived  tiny/answer line 10: `**` -> `*`" in printed


def test_bad_sample_is_named(tmp_path):
    from autograder.cli import main
    make_course(tmp_path)
    assert main(["--root", str(tmp_path), "mutants", "tiny", "--sample", "0"]) == 2


def test_sample_is_seeded_subset(tmp_path, monkeypatch):
    import autograder.pipeline.grade
    import autograder.mutation.mutants as mutants
    make_course(tmp_path)
    graded: list[list[str]] = []

    def fake_autograde(course, name, **kw):
        subs = sorted(p.name for p in course.submitted.iterdir())
        graded.append(subs)
        return [{"student": s, "status": "failed" if s == "m0001" else "graded",
                 "score": 2 if s == "baseline" else 0,
                 "reasons": ["the kernel died"] if s == "m0001" else [], "flags": []}
                for s in subs]

    monkeypatch.setattr(autograder.pipeline.grade, "autograde", fake_autograde)
    monkeypatch.setattr(mutants, "release", lambda course, name: None)
    a = mutants.mutation_score(Course(tmp_path), "tiny", sample=2, seed=1)
    assert (a["mutants"], a["of"], a["score"]) == (2, 4, 1.0)
    assert graded == [["baseline", "m0000", "m0001"]]
    assert a["stopped_early"] == 0
    # A mutant whose run failed counts as killed, but is listed with why.
    assert [(n["status"], n["why"]) for n in a["not_graded"]] == [("failed", "the kernel died")]
    assert mutants.mutation_score(Course(tmp_path), "tiny", cells=["answer"])["mutants"] == 4
    with pytest.raises(CourseError, match="no mutants in cell.*test_clamp.*are answer"):
        mutants.mutation_score(Course(tmp_path), "tiny", cells=["test_clamp"])
    with pytest.raises(CourseError, match="unknown assignment"):
        mutants.mutation_score(Course(tmp_path), "nope")


def test_runs_stop_at_the_first_failure_only_after_a_solution_that_passes_everything(
        tmp_path, monkeypatch):
    """Stopping early is sound only if the solution passes every test: else a mutant could
    lose a cell the solution loses too, and then be charged for the cells skipped after it."""
    import autograder.pipeline.grade
    import autograder.mutation.mutants as mutants
    make_course(tmp_path)
    asked: list[bool] = []

    def fake_autograde(course, name, *, stop_at_failure=False, **kw):
        asked.append(stop_at_failure)
        tests = [{"grade_id": "test_clamp", "kind": "test", "passed": False, "message": "no"}]
        return [{"student": p.name, "status": "graded", "score": 1.0, "reasons": [],
                 "flags": [], "notebooks": {"tiny": {"tests": tests}}}
                for p in course.submitted.iterdir()]

    monkeypatch.setattr(autograder.pipeline.grade, "autograde", fake_autograde)
    monkeypatch.setattr(mutants, "release", lambda course, name: None)
    with pytest.raises(CourseError, match="solution fails test_clamp.*--full-runs"):
        mutants.mutation_score(Course(tmp_path), "tiny")
    mutants.mutation_score(Course(tmp_path), "tiny", full_runs=True)
    assert asked == [True, False]


# --- semantic mutants: the learner's mistakes (issue 26, item 5) ------------------------------

def test_every_corpus_mistake_applies_to_its_solution_once():
    from autograder.mutation.corpus import CORPUS
    from autograder.mutation.semantic import mutated_sources
    root = Path(__file__).resolve().parents[1] / "solutions"
    assert set(CORPUS) == {"build_model", "build_kv_cache", "build_batching", "build_speculative"}
    for name, mistakes in CORPUS.items():
        sources = mutated_sources(root / name, mistakes)
        assert len(sources) == len(mistakes) >= 8
        assert len({m.name for m in mistakes}) == len(mistakes)
        for m, changed in zip(mistakes, sources):
            assert set(changed) == {m.cell} and m.pieces


def test_a_mistake_that_no_longer_matches_is_refused():
    from autograder.mutation.semantic import Mistake, apply
    with pytest.raises(CourseError, match="occurs 0 times in cell 'answer'"):
        apply(Mistake("gone", "answer", (("return x ** 3", "return x"),), ("t",)), ANSWER)


@needs_sandbox
def test_semantic_report_scores_graded_and_validate_and_names_the_pieces(tmp_path, capsys):
    from autograder.mutation.semantic import Mistake, print_report, semantic_report
    course = make_course(tmp_path)
    path = course.source / "tiny" / "tiny.ipynb"          # a hidden test for square(3)
    nb = nbformat.read(path, as_version=4)
    nb.cells[4].source += ('\n### BEGIN HIDDEN TESTS\ncheck_equal(square(3), 9, name="square(3)")\n'
                           '### END HIDDEN TESTS\n')
    nbformat.write(nb, path)
    mistakes = [
        Mistake("clamp with min", "answer", (("max(x, 0)", "min(x, 0)"),), ("test_clamp",)),
        Mistake("square by doubling", "answer", (("x ** 2", "x * 2"),), ("test_square",)),
        Mistake("square by cubing", "answer", (("x ** 2", "x ** 3"),), ("test_clamp",)),
        Mistake("square as x * x", "answer", (("x ** 2", "x * x"),), ("test_square",)),
    ]
    report = semantic_report(course, "tiny", mistakes=mistakes, workers=2)
    rows = {r["mistake"]: r for r in report["mistakes"]}
    assert (rows["clamp with min"]["graded"], rows["clamp with min"]["validate"]) == (1, 1)
    assert rows["clamp with min"]["lost"] == ["test_clamp"] and rows["clamp with min"]["only_its_piece"]
    doubling = rows["square by doubling"]       # square(2) == 4 cannot tell: only the hidden test
    assert (doubling["graded"], doubling["validate"]) == (1, 2) and not doubling["caught_at_validate"]
    assert not rows["square by cubing"]["only_its_piece"]      # it cost test_square, not its own
    assert not rows["square as x * x"]["loses_marks"]      # full marks: the same values
    assert report["goals"] == {"no_full_marks": False, "caught_at_validate": False,
                               "one_piece_each": False}
    print_report(report)
    out = capsys.readouterr().out
    assert "BAD square by doubling: graded 1, Validate 2, lost in test_square  <- green at Validate" in out
    assert "costs test_square" in out and "FULL MARKS" in out
