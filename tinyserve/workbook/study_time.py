"""How long a notebook takes to work through, estimated from what is in it.

The landing page's deep path and the line at the top of every chapter and exercise
("Estimated working time: about N min") come from :func:`estimate`, so the figures follow the
notebooks when they change (a test holds them equal). The rule is deliberately simple:

* **reading**: the words of the markdown cells at :data:`WORDS_PER_MINUTE`. Brysbaert's
  meta-analysis (J. Memory and Language 109, 2019) puts silent reading of English non-fiction
  at about 238 words a minute; technical prose full of numbers and formulas, read to be
  understood, goes slower, so we use 180;
* **running**: :data:`MINUTES_PER_CODE_CELL` for every code cell, to run it and read its code
  and output (the cells themselves run in seconds to about two minutes per notebook); an
  exercise's test cells are not counted, since they are run, not read, nor is the install
  cell tagged ``hosted-only`` (README, "On a hosted notebook");
* **exercises**: for every autograded answer cell :data:`MINUTES_PER_ANSWER_CELL` plus
  :data:`MINUTES_PER_SOLUTION_LINE` per line of the reference solution (a one-line choice is
  quick, a function is not), and :data:`MINUTES_PER_WRITTEN_POINT` per point of every
  hand-graded written answer.

Solution text and mark schemes are not read by the learner, so they count only as exercise
time; estimate from the source notebook in ``solutions/`` (its release has no solutions to
measure), and state the figure in the source's first cell so the release carries it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

WORDS_PER_MINUTE = 180
MINUTES_PER_CODE_CELL = 1.0
MINUTES_PER_ANSWER_CELL = 2.0
MINUTES_PER_SOLUTION_LINE = 1.0
MINUTES_PER_WRITTEN_POINT = 3.0

STATED = re.compile(r"Estimated working time: about (\d+) min")
_MARK_SCHEME = re.compile(r"### BEGIN MARK SCHEME.*?### END MARK SCHEME", re.S)
_SOLUTION = re.compile(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", re.S)


@dataclass(frozen=True)
class StudyTime:
    """Minutes to read, to run and to answer; :attr:`minutes` is their sum rounded up to 5."""
    reading: float
    running: float
    exercises: float

    @property
    def minutes(self) -> int:
        return 5 * math.ceil((self.reading + self.running + self.exercises) / 5)


def _has_heading(cell, heading: str) -> bool:
    return cell.cell_type == "markdown" and any(
        line.startswith(heading) for line in cell.source.splitlines())


def section(cells: list, start: str | None = None, stop: str | None = None) -> list:
    """The cells from the one holding a heading line that starts with `start` (the first cell
    when None) up to, not including, the one holding `stop` (the end when None). Raises
    ValueError when a heading is not found, so a renamed section cannot drop out unnoticed."""
    first = 0 if start is None else next(
        (i for i, c in enumerate(cells) if _has_heading(c, start)), None)
    if first is None:
        raise ValueError(f"no heading starting with {start!r}")
    last = len(cells) if stop is None else next(
        (i for i, c in enumerate(cells) if i > first and _has_heading(c, stop)), None)
    if last is None:
        raise ValueError(f"no heading starting with {stop!r} after {start!r}")
    return cells[first:last]


def estimate(path: str | Path, start: str | None = None, stop: str | None = None) -> StudyTime:
    """The study time of one notebook by the rule in the module docstring; with `start` and
    `stop`, of the part between those headings only (see :func:`section`), as the four-hour
    path on the landing page opens parts of notebooks."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    words = code_cells = written_points = 0
    answer_minutes = 0.0
    for cell in section(nb.cells, start, stop):
        if "hosted-only" in cell.get("metadata", {}).get("tags", []):
            continue                           # the install cell: run once, on a hosted notebook
        grading = cell.get("metadata", {}).get("nbgrader", {})
        if grading.get("solution"):            # an answer: timed as exercise work, not read
            if grading.get("grade") and cell.cell_type == "markdown":
                written_points += grading.get("points", 0)
            elif cell.cell_type == "code":
                lines = sum(len([ln for ln in body.splitlines() if ln.strip()])
                            for body in _SOLUTION.findall(cell.source))
                answer_minutes += MINUTES_PER_ANSWER_CELL + lines * MINUTES_PER_SOLUTION_LINE
                code_cells += 1
            continue
        if cell.cell_type == "code" and not grading.get("grade"):  # test cells run unread
            code_cells += 1
        elif cell.cell_type == "markdown":
            text = STATED.sub("", _MARK_SCHEME.sub("", cell.source))
            words += len(text.split())
    return StudyTime(reading=words / WORDS_PER_MINUTE,
                     running=code_cells * MINUTES_PER_CODE_CELL,
                     exercises=answer_minutes + written_points * MINUTES_PER_WRITTEN_POINT)


def stated_minutes(path: str | Path) -> int | None:
    """The minutes a notebook's first cell states ("Estimated working time: about N min")."""
    import nbformat

    cells = nbformat.read(path, as_version=4).cells
    match = STATED.search(cells[0].source) if cells else None
    return int(match.group(1)) if match else None
