"""What the build track's exercise tests add to exercise_checks: named mistakes where some
wrong answers must be *passed* by a later part's test cell (a later part is judged on its own,
not on the learner's earlier parts), in the same single run as the mistakes that must fail."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pytest

import exercise_checks
from exercise_checks import ROOT, check_points_and_answers, is_test, meta

_PASSED = "<the test cell passed>"


def check_named_mistakes(source, source_dir: Path, answer_cells: set[str],
                         mistakes: Sequence[tuple], **options) -> None:
    """exercise_checks.check_named_mistakes, where a fragment of None means: with this wrong
    answer (an earlier part's) the test cell passes, it keeps its points. One run for all."""
    # exercise_checks names the test cell of mistake i "{grade_id}_{i}".
    must_pass = {f"{m[0]}_{i}" for i, m in enumerate(mistakes) if m[2] is None}
    cases = [(m[0], m[1], _PASSED) if m[2] is None else m for m in mistakes]
    errors = exercise_checks.errors

    def errors_or_passed(nb) -> dict[str, dict]:
        found = errors(nb)
        lost = {cell: found[cell].get("evalue", "")[:300] for cell in sorted(must_pass) if cell in found}
        assert not lost, f"a later part lost points for an earlier part's mistake: {lost}"
        return found | {cell: {"ename": "AssertionError", "evalue": _PASSED} for cell in must_pass}
    exercise_checks.errors = errors_or_passed
    try:
        exercise_checks.check_named_mistakes(source, source_dir, answer_cells, cases, **options)
    finally:
        exercise_checks.errors = errors


def visible_only(source):
    """A copy of ``source`` whose test cells keep their visible checks only (the hidden ones
    removed as a release removes them): what Validate and a test cell run by the learner see."""
    import re
    nb = exercise_checks.copy_notebook(source)
    for cell in nb.cells:
        if is_test(cell):
            cell.source = re.sub(r"### BEGIN HIDDEN TESTS.*?### END HIDDEN TESTS\n?", "", cell.source,
                                 flags=re.S)
    return nb


@pytest.fixture(autouse=True)
def one_thread_kernels(monkeypatch):
    """Imported by each build test module: the kernels its tests start run one torch thread,
    as the grading sandbox does (two per kernel oversubscribe a shared 2-core machine)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def check_build_source(source, source_dir: Path, test_points: dict[str, int],
                       answer_cells: set[str], total: int) -> None:
    """What every build notebook's source holds: the checks imported read-only in the first
    code cell (one shared copy, none beside the notebook), the points and answer cells, hidden
    tests in every test cell, the total in the intro, and a device picked by the template."""
    first = next(c for c in source.cells if c.cell_type == "code")
    assert meta(first)["locked"] and not meta(first)["grade"]
    assert "import autograder.build_checks as _build_checks" in first.source
    released = ROOT / "exercises" / source_dir.name
    assert not list(source_dir.glob("*.py")) and not list(released.glob("*.py"))
    tests, _ = check_points_and_answers(source, test_points, {}, answer_cells)
    assert all("### BEGIN HIDDEN TESTS" in c.source for c in source.cells if is_test(c))
    assert f"({total} points)" in source.cells[0].source and sum(tests.values()) == total
    text = "\n".join(c.source for c in source.cells)
    assert "tinyserve.default_device()" in text and ".cuda()" not in text
