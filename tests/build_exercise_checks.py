"""What the build track's exercise tests add to exercise_checks: named mistakes where some
wrong answers must be *passed* by a later part's test cell (a later part is judged on its own,
not on the learner's earlier parts), in the same single run as the mistakes that must fail."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import exercise_checks

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
