"""Learner self-check: run a notebook's visible tests and say what passed and what was expected.

This runs your own notebook on your own machine (no sandbox needed), in a fresh kernel, top
to bottom, then prints one line per graded test cell. The test cells run as they do at
grading: outside your kernel, in the trusted runner, calling your functions over the same
channel (autograder.runner.channel), so an honest notebook gets the same verdicts here as there.
Hidden tests are not in your copy, so a full self-check score is necessary but not
sufficient for full marks.

Name the notebook as you like, from any folder: a path (from the current folder, or from the
course's folder), or the exercise's name (``python -m autograder check harbor_capacity``),
looked up in the current folder, then in the course's ``exercises/``. Setup cells (an install
cell, shell commands: :mod:`autograder.submitted.setup_cells`) are never run; the report
names each one skipped.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from autograder.runner.execute import run_notebook
from autograder.submitted.setup_cells import skip_setup_cells
from autograder.submitted.submission import Unreadable, load
from autograder.pipeline.worker import apply_results, grading_plan, score_cells


def self_check(path: Path | str, *, cell_timeout: float = 120, total_timeout: float = 1200,
               write=print) -> int:
    """Print per-test results; return 0 when every autograded test passed, 1 otherwise."""
    # This process too: on an older stack (ipykernel 6) finding the kernel's spec imports
    # ipykernel and its debugpy here, which prints the same warning from this side.
    os.environ.setdefault(QUIET_DEBUGGER, "1")
    from jupyter_client import AsyncKernelManager

    found = find_notebook(str(path))
    if isinstance(found, str):
        write(found)
        return 2
    path = found
    try:
        nb, notes = load(path)
    except (Unreadable, OSError) as e:
        write(f"cannot check {path.name}: {e}")
        return 2
    notes = notes + skip_setup_cells(nb)
    tests = score_cells(nb)
    if not tests:
        write(f"{path.name} has no graded test cells (is it an exercise notebook?)")
        return 2
    km = AsyncKernelManager(kernel_name="python3")
    report = run_notebook(nb, km, cwd=str(path.parent), env=kernel_env(),
                          cell_timeout=cell_timeout, total_timeout=total_timeout,
                          plan=grading_plan(nb), kernel_output=subprocess.DEVNULL)
    apply_results(nb, report, tests)
    write(f"Self-check of {path.name} (visible tests only; hidden tests run at grading)")
    write(f"  file: {path}")
    for note in notes + report.events:
        write(f"  note: {note}")
    auto = [t for t in tests if t["kind"] != "manual"]
    for t in tests:
        mark = ("PASS" if t["passed"] else "FAIL") if t["kind"] != "manual" else "TODO"
        pts = f"{t['max_points']:g} pt" + ("" if t["max_points"] == 1 else "s")
        line = f"  {mark}  {t['grade_id']} ({pts})"
        if t["kind"] == "manual":
            line += ": written answer, graded by your instructor" if t["needs_manual_grade"] \
                else ": no answer written yet"
        elif not t["passed"]:
            line += f": {t['message']}"
        write(line)
    passed = sum(t["max_points"] for t in auto if t["passed"])
    total = sum(t["max_points"] for t in auto)
    write(f"Visible tests: {passed:g} / {total:g} points passed.")
    manual = sum(t["max_points"] for t in tests if t["kind"] == "manual" and t["needs_manual_grade"])
    if manual:
        write(f"Answers awaiting manual grading: {manual:g} point{'s' if manual != 1 else ''} "
              "(your instructor grades them).")
    return 0 if all(t["passed"] for t in auto) else 1


#: Set to "1", debugpy keeps its warning about Python 3.11's frozen modules to itself.
QUIET_DEBUGGER = "PYDEVD_DISABLE_FILE_VALIDATION"


def kernel_env() -> dict[str, str]:
    """The kernel's environment: this one, with the debugger's warning about Python 3.11's
    frozen modules silenced (ipykernel's debugpy prints it at every start, and it reads as a
    failure; the kernel runs no debugger here)."""
    return {**os.environ, QUIET_DEBUGGER: "1"}


def find_notebook(spec: str, here: Path | None = None) -> Path | str:
    """The notebook ``spec`` names, or a message saying where it was looked for. ``spec``: a
    path from ``here`` (default: the current folder), a path inside the course's folder, or an
    exercise's name (``harbor_capacity``, ``harbor_capacity.ipynb``): ``NAME.ipynb`` and
    ``NAME/NAME.ipynb`` here, then the course's ``exercises/NAME/NAME.ipynb``. A path that is
    not there is never swapped for another notebook of the same name."""
    from autograder.pipeline.course import Course, CourseError
    try:
        from tinyserve.paths import course_root
    except ImportError:       # the grader without the course's package: no clone to look in
        def course_root() -> Path | None:
            return None
    here = (here or Path.cwd()).resolve()
    given = Path(spec).expanduser()
    name = given.name.removesuffix(".ipynb")
    roots = []
    try:
        roots.append(Course.find(here).root)
    except CourseError:
        pass
    if (here / "tinyserve" / "exercises").is_dir():      # a hosted runtime: the clone in here
        roots.append(here / "tinyserve")
    if course_root() is not None:
        roots.append(course_root())
    bare = len(given.parts) == 1            # a name, not a path: looked up by name too
    places = [here / given] + ([here / f"{name}.ipynb", here / name / f"{name}.ipynb"]
                               if bare else [])
    for root in dict.fromkeys(roots):
        places += [root / given] + ([root / "exercises" / name / f"{name}.ipynb"]
                                    if bare else [])
    places = [p for p in dict.fromkeys(places) if p.suffix == ".ipynb"]
    for place in places:
        if place.is_file():
            return place.resolve()
    return (f"cannot check {spec}: no such notebook. Looked for "
            + ", ".join(str(p) for p in places[:6])
            + ". Name a notebook file, or an exercise (python -m autograder check harbor_capacity).")
