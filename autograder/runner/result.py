"""What running a notebook reports: each cell's outcome and the run's events, flags and
integrity report. Shared by the executor (``autograder.runner.execute``), which fills it, and the
trusted runner (``autograder.runner.trusted``), whose test cells each end in a ``CellResult``."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CellResult:
    status: str                    # ok | error | timeout | not_run
    ename: str = ""
    evalue: str = ""
    student: bool = False          # the error was raised by the student's code


@dataclass
class RunReport:
    cells: dict[int, CellResult] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    integrity: dict | None = None
    kernel_died: bool = False
    seconds: float = 0.0
    channel_calls: int = 0
    flags: list[str] = field(default_factory=list)   # for review: the worker reports them
    # The grader's own side failed (a read-only cell, a publish, the tests' work past its
    # time): the submission is not graded (failed, for the instructor), never zero marks.
    grader_failures: list[str] = field(default_factory=list)
