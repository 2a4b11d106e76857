"""What the build track's exercise tests add to exercise_checks: named mistakes where some
wrong answers must be *passed* by a later part's test cell (a later part runs on tinyserve's
earlier pieces, so a wrong earlier piece costs only its own points), all in one kernel."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import nbformat

from exercise_checks import errors, execute, is_test, meta


def check_named_mistakes(source, source_dir: Path, answer_cells: set[str],
                         mistakes: Sequence[tuple], graded_cells_only: bool = False) -> None:
    """As exercise_checks.check_named_mistakes, and a fragment of None means: with this wrong
    answer the test cell passes (it earns its points). One kernel runs every case."""
    by_id = {meta(c)["grade_id"]: c for c in source.cells if meta(c)}
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c.source) for c in source.cells
                if c.cell_type == "code" and (meta(c) or not graded_cells_only) and not is_test(c)]
    answers = [c.source for c in source.cells
               if c.cell_type == "code" and meta(c).get("grade_id") in answer_cells]
    wanted = []
    for test_id, wrong, fragment, *ename in mistakes:
        nb.cells.extend(nbformat.v4.new_code_cell(text) for text in (*answers, wrong))
        cell_id = f"{test_id}_{len(wanted)}"
        test_cell = nbformat.v4.new_code_cell(by_id[test_id].source)
        test_cell.metadata = {"nbgrader": dict(meta(by_id[test_id]), grade_id=cell_id)}
        nb.cells.append(test_cell)
        wanted.append((cell_id, fragment, ename[0] if ename else "AssertionError"))
    execute(nb, source_dir, allow_errors=True)
    found = errors(nb)
    for cell_id, fragment, ename in wanted:
        if fragment is None:
            assert cell_id not in found, (cell_id, "must pass", found.get(cell_id, {}).get("evalue"))
            continue
        assert cell_id in found, f"{cell_id}: the wrong answer passed"
        assert found[cell_id]["ename"] == ename, (cell_id, found[cell_id])
        assert fragment in found[cell_id]["evalue"], (cell_id, found[cell_id]["evalue"])
