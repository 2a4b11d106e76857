"""Learner self-check: run a notebook's visible tests and say what passed and what was expected.

This runs your own notebook on your own machine (no sandbox needed), in a fresh kernel, top
to bottom, then prints one line per graded test cell. The test cells run as they do at
grading: outside your kernel, in the trusted runner, calling your functions over the same
channel (autograder.runner.channel), so an honest notebook gets the same verdicts here as there.
Hidden tests are not in your copy, so a full self-check score is necessary but not
sufficient for full marks.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

from autograder.runner.execute import run_notebook
from autograder.submitted.submission import Unreadable, load
from autograder.pipeline.worker import apply_results, grading_plan, score_cells


def self_check(path: Path, *, cell_timeout: float = 120, total_timeout: float = 1200,
               write=print) -> int:
    """Print per-test results; return 0 when every autograded test passed, 1 otherwise."""
    from jupyter_client import AsyncKernelManager

    path = Path(path).resolve()
    try:
        nb, notes = load(path)
    except (Unreadable, OSError) as e:
        write(f"cannot check {path.name}: {e}")
        return 2
    tests = score_cells(nb)
    if not tests:
        write(f"{path.name} has no graded test cells (is it an exercise notebook?)")
        return 2
    km = AsyncKernelManager(kernel_name="python3")
    report = run_notebook(nb, km, cwd=str(path.parent), cell_timeout=cell_timeout,
                          total_timeout=total_timeout, plan=grading_plan(nb),
                          kernel_output=subprocess.DEVNULL)
    apply_results(nb, report, tests)
    write(f"Self-check of {path.name} (visible tests only; hidden tests run at grading)")
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
